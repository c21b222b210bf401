"""torchtitan's pipeline split x expert parallelism, the pipeline prepared for overlap.

    torchrun --nproc-per-node 4 examples/torchtitan_pp_ep.py    # PP=2 x EP=2, DualPipeV
    torchrun --nproc-per-node 4 examples/torchtitan_pp_ep.py --schedule Interleaved1F1B

Everything pipeline-side is torchtitan's own ``pipeline_llm``: its module-FQN split of
the model into stages (two per rank; V-shaped for DualPipeV), torch's ``PipelineStage`` s
and the schedule. The adapter enters as the parallelize function ``pipeline_llm`` runs on
each chunk: torchtitan's expert parallelism first (``chunk.parallelize(dims)``), then the
chunk wrapped as ``TorchtitanMoEStage(TorchtitanMoEAdapter(chunk))``, which becomes the
stage's module. ``prepare_schedule`` then runs the schedule's overlapped
forward-and-backward pairs as combined-1F1B steps (the all-to-all of one microbatch under
another's compute); interleaved 1F1B gets such pairs inserted (``pair=True``).

Self-check: the same split, parallelized but not wrapped, runs as torch executes
torchtitan's schedule (``positions=`` as torchtitan's trainer passes them); the losses, the
gradients and the load-balancing token counts must equal the prepared schedule's bit for
bit. Helpers (meshes, model, data) are :mod:`torchtitan_ep`'s.
"""

from __future__ import annotations

import argparse
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torchtitan_ep import (  # the EP example next to this file (it puts src/ on the path)
    build_model,
    differences,
    init_ranks,
    local,
    microbatches,
    parallel_dims,
    titan,
)

from moe_overlap.adapters.torchtitan import TorchtitanMoEAdapter, TorchtitanMoEStage
from moe_overlap.integrations.pipelining import prepare_schedule

MICROBATCHES = 4


def pipeline(model: nn.Module, dims: Any, schedule: str, *, adapted: bool) -> tuple[Any, Any]:
    """torchtitan's ``pipeline_llm``: this rank's stages of ``model`` and their schedule.
    Each chunk gets torchtitan's expert parallelism and, when ``adapted``, the adapter."""
    config, loss = titan("config"), titan("components.loss").CrossEntropyLoss

    def parallelize(chunk: nn.Module, **_: object) -> nn.Module:
        cast("Any", chunk).parallelize(dims)  # torchtitan's EP, per chunk
        return TorchtitanMoEStage(TorchtitanMoEAdapter(chunk)) if adapted else chunk

    parallelism = config.ParallelismConfig(
        pipeline_parallel_degree=dims.pp,
        expert_parallel_degree=dims.ep,
        pipeline_parallel_schedule=schedule,
        pipeline_parallel_microbatch_size=2,
    )
    sched, parts, _, _ = titan("distributed.pipeline_parallel").pipeline_llm(
        model,
        parallel_dims=dims,
        training=config.TrainingConfig(local_batch_size=2 * MICROBATCHES),
        parallelism=parallelism,
        compile_config=config.CompileConfig(),
        ac_config=None,  # no activation checkpointing
        dump_folder="",
        device=next(model.parameters()).device,
        model_config=cast("Any", model).config,
        parallelize_fn=parallelize,
        loss_fn=loss(loss.Config()),  # its trainer's: sum / global_valid_tokens
    )
    return sched, parts


def step(schedule: Any, x: Tensor, y: Tensor, **positions: Tensor) -> list[Tensor]:
    """One step as torchtitan's trainer takes it: token ids into the first stage, labels
    and the losses at the last, the loss divided by the step's labelled tokens."""
    stages = schedule._stages  # torch keeps this rank's stages there
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    losses: list[Tensor] = []
    schedule.step(
        *((x,) if first else ()),
        target=y if last else None,
        losses=losses if last else None,
        loss_kwargs={"global_valid_tokens": (y != -100).sum()},
        **positions,
    )
    return [loss.detach() for loss in losses]


def state(parts: list[nn.Module]) -> dict[str, Tensor]:
    """Every gradient (this rank's shard) and token count of this rank's stages."""
    out: dict[str, Tensor] = {}
    for i, part in enumerate(parts):
        for n, p in part.named_parameters():
            if p.grad is not None:
                out[f"{i}:{n}"] = local(p.grad)
        for n, b in part.named_buffers():
            if n.endswith("tokens_per_expert_E"):
                out[f"{i}:{n}"] = local(b)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="torchtitan's PP x EP with combined 1F1B")
    parser.add_argument(
        "--schedule",
        choices=["DualPipeV", "Interleaved1F1B"],
        default="DualPipeV",
        help="torchtitan's pipeline schedule; Interleaved1F1B gets overlapped pairs inserted "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=4,
        help="blocks of the debug model kept, split over the stages (default: %(default)s)",
    )
    args = parser.parse_args(argv)

    rank, world, device = init_ranks()
    dims = parallel_dims(device, ep=2, pp=world // 2)  # torchtitan's mesh: pp outermost

    model = build_model(args.layers, device)
    # 1. torchtitan's split, each chunk parallelized and adapted; the schedule prepared.
    schedule, parts = pipeline(model, dims, args.schedule, adapted=True)
    prepared = prepare_schedule(schedule, pair=args.schedule != "DualPipeV")
    # The reference: the same split, parallelized, as torch executes torchtitan's schedule.
    ref_schedule, ref_parts = pipeline(model, dims, args.schedule, adapted=False)

    # The EP ranks of a stage are data-parallel: each pipeline (the ranks of one EP
    # coordinate, pp outermost) trains on its own data.
    vocab = int(cast("Any", model).config.vocab_size)
    mbs = microbatches(vocab, MICROBATCHES, seed=rank % dims.ep, device=device)
    x = torch.cat([cast("Tensor", mb.input_ids) for mb in mbs])
    y = torch.cat([cast("Tensor", mb.labels) for mb in mbs])
    pos = torch.cat([cast("Tensor", mb.position_ids) for mb in mbs])
    # 2. One step each; torchtitan's trainer names the positions `positions`.
    losses = step(schedule, x, y, position_ids=pos)
    ref_losses = step(ref_schedule, x, y, positions=pos)

    compared = state(ref_parts)
    differ = differences(state(parts), compared)
    if differ or not all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True)):
        print(f"rank {rank}: NOT equal to torchtitan's own run: {differ[:3]}", flush=True)
        return 1
    stages = [s.stage_index for s in schedule._stages]
    shown = f"losses {[round(float(v), 4) for v in losses]}, " if losses else ""
    print(
        f"rank {rank}: stages {stages}, {prepared.paired} overlapped pairs, {shown}"
        f"bit-identical to torchtitan's own pipeline ({len(compared)} gradients and token "
        "counts)",
        flush=True,
    )
    dist.barrier()  # pyright: ignore[reportUnknownMemberType] - unannotated
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
