"""One rank of the torchtitan pipeline tests: ``python -m tests.adapters.titan_pp_worker``.

Reads ``RANK``, ``WORLD_SIZE``, ``MASTER_*`` and ``TITAN_PP_CASE`` (JSON: ``ep`` the
expert-parallel degree, 1 or 2; ``schedules``, torchtitan's schedule names; ``delay``
delayed weight gradients). The pipeline degree is ``WORLD_SIZE / ep``. Prints one JSON
line per schedule with this rank's verdict.

Everything pipeline-side is torchtitan's own: its module-FQN split
(``_generate_llm_fqn_per_model_part``, then ``_pipeline_module_split``, which deep-copies
the model per stage and builds torch's ``PipelineStage`` s, V-shaped for DualPipeV), its
schedule builder (``_build_pipeline_schedule``: ``scale_grads=False``, its loss returning
``(loss, metrics)`` with ``global_valid_tokens``) and its ``CrossEntropyLoss``; with
``ep=2`` each chunk is parallelized by torchtitan (``chunk.parallelize(parallel_dims)``, as
``pipeline_llm`` runs its parallelize function per chunk) on a ``pp x ep`` mesh. Each stage's
chunk is then wrapped (``stage.submod = TorchtitanMoEStage(TorchtitanMoEAdapter(chunk))``)
and the same schedule runs twice: as torch executes it, and prepared by
``prepare_schedule``. Verdicts: bit-identical losses and gradients (and
``tokens_per_expert_E``); and torch's execution of torchtitan's raw chunks (no adapter)
within float32 rounding.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe_overlap.adapters.torchtitan import TorchtitanMoEAdapter, TorchtitanMoEStage
from moe_overlap.integrations.pipelining import prepare_schedule
from tests.adapters._titan import batch, build, causal_stand_in
from tests.gloo_ranks import exit_worker

FAMILY = "deepseek_v3"
LAYERS = 4
MICROBATCHES = 4
GRAD_RTOL = 1e-4
EXPERT_GRAD_RTOL = 4 * 2**-8
"""torchtitan's grouped experts run in bfloat16 (see ``titan_ep_worker``)."""


def dims_for(pp: int, ep: int) -> Any:
    """torchtitan's ``ParallelDims`` on CPU for ``pp x ep``, meshes built."""
    import torchtitan.distributed.parallel_dims as titan_dims
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    parallelism = ParallelismConfig(
        pipeline_parallel_degree=pp, expert_parallel_degree=ep, spmd_backend="partial_dtensor"
    )
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    titan_dims.device_type = "cpu"
    dims = ParallelDims.from_config(parallelism, pp * ep)
    dims.build_mesh()
    return dims


def whole_model(ep: int) -> nn.Module:
    """The test model (every rank the same weights); with ``ep > 1`` its config carries
    torchtitan's expert-parallel sharding configs."""
    if ep == 1:
        return causal_stand_in(build(FAMILY, layers=LAYERS))
    import importlib

    from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config

    from tests.adapters._titan import FAMILIES, shrink

    module, flavor = FAMILIES[FAMILY]
    config = shrink(importlib.import_module(module).model_registry(flavor).model, layers=LAYERS)
    set_deepseek_v3_sharding_config(config, enable_sp=True, enable_ep=True)
    torch.manual_seed(0)
    model = cast(nn.Module, config.build())
    cast(Any, model).init_states(buffer_device=torch.device("cpu"))
    return causal_stand_in(model)


def split(model: nn.Module, dims: Any, schedule: str, ep: int) -> tuple[list[Any], list[nn.Module]]:
    """torchtitan's stages and chunks of ``model`` for ``schedule`` (2 stages per rank)."""
    from torchtitan.distributed.pipeline_parallel import (
        _generate_llm_fqn_per_model_part,
        _pipeline_module_split,
    )

    pp = dims.pp
    names = _generate_llm_fqn_per_model_part(2 * pp, LAYERS, 1, 1)
    stages, chunks = _pipeline_module_split(
        model, dims.get_mesh("pp"), schedule, torch.device("cpu"), names
    )
    if ep > 1:
        for chunk in chunks:
            cast(Any, chunk).parallelize(dims)
    return stages, chunks


def titan_schedule(stages: list[Any], schedule: str, pp: int) -> Any:
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed.pipeline_parallel import _build_pipeline_schedule

    parallelism = ParallelismConfig(
        pipeline_parallel_degree=pp,
        pipeline_parallel_schedule=schedule,
        pipeline_parallel_microbatch_size=2,
    )
    return _build_pipeline_schedule(
        parallelism=parallelism,
        local_batch_size=2 * MICROBATCHES,
        stages=stages,
        loss_fn=CrossEntropyLoss(CrossEntropyLoss.Config()),
    )


def data(model: nn.Module, dp_rank: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The step's batch (token ids, labels, positions) and its labelled-token count."""
    mbs = batch(model, MICROBATCHES, seed=100 + dp_rank)
    x = torch.cat([m["input_ids"] for m in mbs])
    y = torch.cat([m["labels"] for m in mbs])
    pos = torch.cat([m["position_ids"] for m in mbs])
    return x, y, pos, (y != -100).sum()


def step(schedule: Any, stages: list[Any], x: Tensor, y: Tensor, **kwargs: object) -> list[Tensor]:
    """One training step as torchtitan's trainer takes it (losses from the last stage)."""
    first = any(s.is_first for s in stages)
    last = any(s.is_last for s in stages)
    losses: list[Tensor] = []
    args = (x,) if first else ()
    schedule.step(*args, target=y if last else None, losses=losses if last else None, **kwargs)
    return [loss.detach() for loss in losses]


def local(t: Tensor) -> Tensor:
    to_local = getattr(t, "to_local", None)
    return cast(Tensor, to_local()) if callable(to_local) else t


def state(chunks: list[nn.Module]) -> dict[str, Tensor]:
    """Every gradient and ``tokens_per_expert_E`` of this rank's chunks."""
    out: dict[str, Tensor] = {}
    for i, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            if p.grad is not None:
                out[f"{i}:{name}"] = local(p.grad).clone()
        for name, b in chunk.named_buffers():
            if name.endswith("tokens_per_expert_E"):
                out[f"{i}:{name}"] = local(b).clone()
    return out


def worst(a: dict[str, Tensor], b: dict[str, Tensor]) -> tuple[float, float, str]:
    """Largest relative difference of dense and of expert gradients, and where."""
    dense, expert, where = 0.0, 0.0, ""
    for k in a:
        d = float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-30))
        if "inner_experts" in k:
            expert = max(expert, d)
        elif d > dense:
            dense, where = d, k
    return dense, expert, where


def adapted(
    model: nn.Module, dims: Any, name: str, ep: int, delay: bool
) -> tuple[Any, list[Any], list[nn.Module]]:
    """torchtitan's schedule over its stages, each chunk wrapped in a stage module."""
    stages, chunks = split(model, dims, name, ep)
    for s, chunk in zip(stages, chunks, strict=True):
        s.submod = TorchtitanMoEStage(TorchtitanMoEAdapter(chunk, delay_wgrad_compute=delay))
    return titan_schedule(stages, name, dims.pp), stages, chunks


def main() -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    case: dict[str, Any] = json.loads(os.environ["TITAN_PP_CASE"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ep = int(case["ep"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    run_cases(case, rank, world, ep)
    dist.barrier()  # leave together (a failed rank exits at once: its peers time out)
    dist.destroy_process_group()


def run_cases(case: dict[str, Any], rank: int, world: int, ep: int) -> None:
    if True:
        dims = dims_for(world // ep, ep)
        model = whole_model(ep)
        ep_rank = rank % ep  # torchtitan's mesh: pp outermost
        x, y, pos, tokens = data(model, ep_rank)
        kw = {"loss_kwargs": {"global_valid_tokens": tokens}}
        for name in case["schedules"]:
            start = time.perf_counter()
            torch_sched, torch_stages, torch_chunks = adapted(model, dims, name, ep, False)
            ref = step(torch_sched, torch_stages, x, y, position_ids=pos, **kw)
            ours, our_stages, our_chunks = adapted(model, dims, name, ep, case["delay"])
            overlap = prepare_schedule(ours, pair=name != "DualPipeV")
            got = step(ours, our_stages, x, y, position_ids=pos, **kw)
            # torch's execution of torchtitan's own chunks, no adapter.
            raw_stages, raw_chunks = split(model, dims, name, ep)
            raw = step(
                titan_schedule(raw_stages, name, dims.pp), raw_stages, x, y, positions=pos, **kw
            )
            a, b, r = state(our_chunks), state(torch_chunks), state(raw_chunks)
            bit = (
                len(got) == len(ref)
                and all(torch.equal(p, q) for p, q in zip(got, ref, strict=True))
                and list(a) == list(b)
                and all(torch.equal(a[k], b[k]) for k in a)
            )
            dense, expert, where = worst(b, r)
            loss_diff = max(
                (abs(float(p) - float(q)) for p, q in zip(ref, raw, strict=True)), default=0.0
            )
            print(
                json.dumps(
                    {
                        "schedule": name,
                        "rank": rank,
                        "bit_identical": bit,
                        "differ": [k for k in a if k in b and not torch.equal(a[k], b[k])][:5],
                        "stages": [s.stage_index for s in our_stages],
                        "modules": [[n for n, _ in s.submod.named_children()] for s in our_stages],
                        "paired": overlap.paired,
                        "losses": [float(v) for v in got],
                        "states": len(a),
                        "vs_torchtitan_ok": loss_diff <= 1e-5
                        and dense <= GRAD_RTOL
                        and expert <= EXPERT_GRAD_RTOL
                        and list(b) == list(r),
                        "vs_torchtitan": [loss_diff, dense, expert, where],
                        "pending": sum(s.submod.pending_wgrad for s in our_stages),
                        "seconds": round(time.perf_counter() - start, 2),
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    exit_worker(main)
