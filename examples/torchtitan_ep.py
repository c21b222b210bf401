"""torchtitan's expert parallelism, trained with the combined-1F1B schedule.

    torchrun --nproc-per-node 2 examples/torchtitan_ep.py    # EP=2: gloo on CPU, NCCL on GPU

Each rank builds the same DeepSeek-V3 ``debugmodel`` (cut to ``--layers`` blocks), and
torchtitan shards its experts over the ranks exactly as its trainer does: the model config
gets torchtitan's sharding configs (``set_deepseek_v3_sharding_config``), ``ParallelDims``
builds the meshes and ``model.parallelize(dims)`` makes the experts DTensors over the ``ep``
mesh and wires that mesh into the model's token dispatcher (its all-to-all). The adapter
takes that model as it is. Every rank trains on its own data: the experts' gradients
come from every rank's tokens through the all-to-all, the dense ones are averaged, as
data parallelism would.

Self-check: a second copy of the model is trained by torchtitan's own forward and
``backward()`` on the same data; every step, the losses, every gradient and the
load-balancing token counts must equal the schedule's bit for bit.

On CPU the blocks' flex attention (no backward on CPU) is configured as torchtitan's causal
``ScaledDotProductAttention`` before the model is built (one document per sequence, which is
what this example feeds).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
import warnings
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT / "src"))

from moe_overlap import Microbatch, combined_1f1b  # noqa: E402 - after the path set-up
from moe_overlap.adapters.torchtitan import TorchtitanMoEAdapter  # noqa: E402

SEQ, BATCH = 16, 2


def titan(module: str) -> Any:
    """``torchtitan.<module>`` (torchtitan has no type information: ``Any``)."""
    return importlib.import_module(f"torchtitan.{module}")


def parallel_dims(device: torch.device, *, ep: int, pp: int = 1) -> Any:
    """torchtitan's ``ParallelDims`` for ``pp x ep`` over every rank, meshes built."""
    config = titan("config").ParallelismConfig(
        pipeline_parallel_degree=pp, expert_parallel_degree=ep, spmd_backend="partial_dtensor"
    )
    titan("distributed.utils").set_spmd_backend(config.spmd_backend)  # as the trainer does
    # torchtitan assumes an accelerator unless told.
    titan("distributed.parallel_dims").device_type = device.type
    dims = titan("distributed").ParallelDims.from_config(config, dist.get_world_size())
    dims.build_mesh()
    return dims


def build_model(layers: int, device: torch.device) -> nn.Module:
    """The registry's debug model with torchtitan's expert-parallel sharding configs, its
    states initialised (the same weights on every rank), not yet parallelized."""
    config = titan("models.deepseek_v3").model_registry("debugmodel").model
    blocks = list(config.layers[:layers])
    if device.type == "cpu":  # flex attention has no backward on CPU
        sdpa = titan("models.common.attention").ScaledDotProductAttention.Config()
        for block in blocks:
            block.attention = dataclasses.replace(block.attention, inner_attention=sdpa)
    config = dataclasses.replace(config, layers=blocks)
    titan("models.deepseek_v3.sharding").set_deepseek_v3_sharding_config(
        config, enable_sp=True, enable_ep=True
    )
    torch.manual_seed(0)  # pyright: ignore[reportUnknownMemberType] - unannotated
    with device:
        model = cast("nn.Module", config.build())
    cast("Any", model).init_states(buffer_device=device)
    return model


def microbatches(vocab: int, n: int, seed: int, device: torch.device) -> list[Microbatch]:
    g = torch.Generator().manual_seed(seed)
    positions = torch.arange(SEQ, device=device).expand(BATCH, SEQ)  # one document per row
    out: list[Microbatch] = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g).to(device)
        out.append(Microbatch(input_ids=ids[:, :-1], labels=ids[:, 1:], position_ids=positions))
    return out


def torchtitan_step(model: nn.Module, mbs: list[Microbatch], scale: float) -> list[Tensor]:
    """torchtitan's own forward and ``backward()`` per microbatch (the reference)."""
    cross_entropy_loss = titan("components.loss").cross_entropy_loss
    losses: list[Tensor] = []
    for mb in mbs:
        labels = cast("Tensor", mb.labels)
        logits = model(mb.input_ids, positions=mb.position_ids)
        loss = cast("Tensor", cross_entropy_loss(logits, labels)) / (labels != -100).sum()
        torch.autograd.backward(loss * scale)
        losses.append(loss.detach())
    return losses


def local(t: Tensor) -> Tensor:
    """A DTensor's shard on this rank (the experts); a plain tensor as it is."""
    to_local = getattr(t, "to_local", None)
    return cast("Tensor", to_local()) if callable(to_local) else t


def state(model: nn.Module) -> dict[str, Tensor]:
    """What a step leaves: every gradient (this rank's shard) and the token counts."""
    out = {n: local(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    out.update({n: b for n, b in model.named_buffers() if n.endswith("tokens_per_expert_E")})
    return out


def differences(ours: dict[str, Tensor], own: dict[str, Tensor]) -> list[str]:
    if list(ours) != list(own):
        return [f"other tensors: {sorted(set(ours) ^ set(own))}"]
    return [n for n in own if not torch.equal(ours[n], own[n])]


def average_dense_gradients(model: nn.Module) -> None:
    """Data parallelism over the ranks: the dense gradients averaged (the experts' already
    hold every rank's tokens), the experts' divided alike."""
    world = dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None and local(p.grad) is p.grad:
            dist.all_reduce(p.grad)  # pyright: ignore[reportUnknownMemberType] - unannotated
        if p.grad is not None:
            p.grad.div_(world)


def init_ranks() -> tuple[int, int, torch.device]:
    """The process group (NCCL on GPU, gloo on CPU), this rank's device, deterministic
    algorithms (on GPU too: bit for bit needs them); returns rank, world size, device."""
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        quiet_cpu_autocast()
    torch.use_deterministic_algorithms(True)
    return dist.get_rank(), dist.get_world_size(), device


def quiet_cpu_autocast() -> None:
    """torchtitan's router computes its gate under ``autocast(dtype=float32)``; CPU autocast
    has no float32, so torch warns once per process and runs the gate unchanged, in the
    model's float32 all the same. Nothing differs: the warning is silenced."""
    warnings.filterwarnings(
        "ignore",
        message="In CPU autocast, but the target dtype is not supported",
        category=UserWarning,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="torchtitan's EP with combined 1F1B")
    parser.add_argument(
        "--layers",
        type=int,
        default=3,
        help="blocks of the debug model kept (default: %(default)s)",
    )
    parser.add_argument(
        "--steps", type=int, default=3, help="training steps (default: %(default)s)"
    )
    parser.add_argument(
        "--microbatches",
        type=int,
        default=2,
        help="microbatches per step and rank (default: %(default)s)",
    )
    args = parser.parse_args(argv)

    rank, world, device = init_ranks()
    dims = parallel_dims(device, ep=world)

    # 1. The model, parallelized by torchtitan; the adapter takes it as it is.
    model = build_model(args.layers, device)
    cast("Any", model).parallelize(dims)
    adapter = TorchtitanMoEAdapter(model)
    # The reference: the same model, the same parallelism, trained by torchtitan's code.
    reference = build_model(args.layers, device)
    cast("Any", reference).parallelize(dims)

    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, reference)]
    vocab = int(cast("Any", model).config.vocab_size)
    experts = model.get_submodule("layers.1.moe.routed_experts.inner_experts")
    if rank == 0:
        w1 = experts.get_parameter("w1_EFD")
        print(
            f"EP={world}: layers.1 experts {type(w1).__name__} {list(w1.shape)}, "
            f"{list(local(w1).shape)} on each rank",
            flush=True,
        )

    for step in range(args.steps):
        mbs = microbatches(vocab, args.microbatches, seed=100 * step + rank, device=device)
        scale = 1 / len(mbs)
        # 2. One step: the schedule overlaps one microbatch's all-to-all with another's compute.
        losses = combined_1f1b(adapter, mbs, options=adapter.schedule_options(), loss_scale=scale)
        own_losses = torchtitan_step(reference, mbs, scale)
        compared = state(reference)
        differ = differences(state(model), compared)
        same = all(torch.equal(a.detach(), b) for a, b in zip(losses, own_losses, strict=True))
        if differ or not same:
            print(
                f"rank {rank}: step {step + 1}: NOT equal to torchtitan's own run: "
                f"losses {'equal' if same else 'differ'}, {differ[:3]}",
                flush=True,
            )
            return 1
        # 3. Data parallelism and the optimizer step, the same for both.
        for m, opt in zip((model, reference), optimizers, strict=True):
            average_dense_gradients(m)
            opt.step()  # pyright: ignore[reportUnknownMemberType] - unannotated closure
            opt.zero_grad()
        loss = torch.stack([x.detach() for x in losses]).mean()
        print(
            f"rank {rank}: step {step + 1}: loss {float(loss):.4f}, bit-identical to "
            f"torchtitan's own forward and backward (loss, "
            f"{len(compared)} gradients and token counts)",
            flush=True,
        )
    dist.barrier()  # pyright: ignore[reportUnknownMemberType] - unannotated
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
