"""Train the reference MoE model with expert parallelism: each rank holds its share of experts.

    torchrun --nproc-per-node 2 examples/train_ep.py                  # CPU processes, gloo
    torchrun --nproc-per-node 8 examples/train_ep.py --device cuda    # one GPU per rank, NCCL

Every rank is in one expert-parallel group and trains on its own microbatches with
``combined_1f1b``. Each step is checked against plain ``loss.backward()`` per microbatch on
a second copy of the model (losses and every gradient bit-identical, on every rank); then
the gradients are averaged over the ranks and both copies take the same SGD step. Rank 0
prints one line per step.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
from torch import Tensor

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT / "src"))

from moe_overlap import Microbatch, combined_1f1b  # noqa: E402 - after the path set-up
from moe_overlap.blocks import GroupedExperts  # noqa: E402
from moe_overlap.models import GPTMoEConfig, GPTMoEModel  # noqa: E402

# torch.distributed leaves these unannotated; give them a type once, here.
_all_reduce = cast("Callable[..., object]", dist.all_reduce)  # pyright: ignore[reportUnknownMemberType]
_new_group = cast("Callable[..., dist.ProcessGroup]", dist.new_group)  # pyright: ignore[reportUnknownMemberType]


def setup(device_kind: str) -> torch.device:
    """One process per rank (torchrun sets RANK, WORLD_SIZE, LOCAL_RANK): NCCL on a GPU each,
    or gloo on the CPU."""
    if device_kind == "cuda":
        # Deterministic cuBLAS (for the check below) needs this before CUDA starts.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    # Only for the bit-for-bit check against plain backward() below: the same kernels on
    # both paths. Training with the schedule does not need it.
    torch.use_deterministic_algorithms(True)
    return device


def microbatches(vocab: int, n: int, device: torch.device) -> list[Microbatch]:
    """This rank's microbatches (every rank draws its own; the same at every step, so the
    loss visibly falls)."""
    gen = torch.Generator().manual_seed(dist.get_rank())
    ids = [torch.randint(0, vocab, (2, 16), generator=gen).to(device) for _ in range(n)]
    return [Microbatch(input_ids=x, labels=x.roll(-1, 1)) for x in ids]


def plain_step(model: GPTMoEModel, mbs: list[Microbatch]) -> list[Tensor]:
    """What the schedule must reproduce: ``loss.backward()`` per microbatch, in order."""
    losses: list[Tensor] = []
    for mb in mbs:
        assert mb.input_ids is not None
        loss = model(mb.input_ids, labels=mb.labels)
        loss.backward()
        losses.append(loss.detach().float())
    return losses


def exact_on_every_rank(
    model: GPTMoEModel, reference: GPTMoEModel, losses: list[Tensor], plain: list[Tensor]
) -> bool:
    same = all(torch.equal(a, b) for a, b in zip(losses, plain, strict=True)) and all(
        p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad)
        for p, q in zip(model.parameters(), reference.parameters(), strict=True)
    )
    flag = torch.tensor([int(same)], device=plain[0].device)  # NCCL reduces device tensors
    _all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def sgd_step(model: GPTMoEModel, lr: float) -> None:
    """Average the gradients over the ranks (each rank's loss counts once), then SGD.

    Dense parameters are replicated: sum their gradients over the ranks. An expert lives on
    one rank and its gradient already holds every rank's tokens routed to it: only scale it.
    """
    world = dist.get_world_size()
    experts = {
        id(p) for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()
    }
    with torch.no_grad():
        for p in model.parameters():
            assert p.grad is not None
            if id(p) not in experts:
                _all_reduce(p.grad)
            p.grad.div_(world)
            p.add_(p.grad, alpha=-lr)
    model.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: gloo; cuda: one GPU per rank (LOCAL_RANK), NCCL (default: %(default)s)",
    )
    parser.add_argument(
        "--steps", type=int, default=3, help="training steps (default: %(default)s)"
    )
    parser.add_argument(
        "--microbatches",
        type=int,
        default=4,
        help="microbatches per step and rank (default: %(default)s)",
    )
    args = parser.parse_args()
    device = setup(args.device)
    world = dist.get_world_size()
    ep_group = _new_group(list(range(world)))  # the experts are sharded over these ranks
    # The ranks vote on every step's outcome over this group, so that a step that failed on
    # one rank raises on every rank (its timeout outlasts the EP group's).
    consensus = _new_group(list(range(world)), backend="gloo", timeout=timedelta(minutes=15))
    config = GPTMoEConfig(hidden_size=32, num_layers=2, num_experts=2 * world, seed=0)
    model = GPTMoEModel(config, ep_group=ep_group, device=device)
    reference = GPTMoEModel(config, ep_group=ep_group, device=device)  # the same weights
    if dist.get_rank() == 0:
        print(
            f"EP={world} over {dist.get_backend()}: each rank holds "
            f"{config.num_experts // world} of {config.num_experts} experts",
            flush=True,
        )
    mbs = microbatches(config.vocab_size, args.microbatches, device)
    for step in range(args.steps):
        losses = combined_1f1b(model, mbs, consensus_group=consensus)
        plain = plain_step(reference, mbs)
        exact = exact_on_every_rank(model, reference, losses, plain)
        mean = torch.stack(losses).sum().reshape(1)
        _all_reduce(mean)
        if dist.get_rank() == 0:
            verdict = "bit-identical to" if exact else "NOT bit-identical to"
            print(
                f"step {step}: mean loss {mean.item() / (world * len(mbs)):.4f}; losses and "
                f"gradients {verdict} loss.backward() on all {world} ranks",
                flush=True,
            )
        if not exact:
            raise SystemExit(1)
        sgd_step(model, lr=0.5)
        sgd_step(reference, lr=0.5)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
