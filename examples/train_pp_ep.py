"""Train the reference MoE model with pipeline x expert parallelism: a torch schedule whose
``OVERLAP_F_B`` actions overlap one microbatch's all-to-all with another's compute.

    torchrun --nproc-per-node 4 examples/train_pp_ep.py                 # PP=2 x EP=2, gloo
    torchrun --nproc-per-node 2 examples/train_pp_ep.py --ep 1          # PP=2
    torchrun --nproc-per-node 4 examples/train_pp_ep.py --schedule interleaved --delay-wgrad

Ranks ``p * EP + e``: pipeline rank ``p``, expert-parallel rank ``e``. Each rank builds the
whole (tiny, seeded) model with its experts sharded over its EP group, and takes its two
pipeline stages from it (``ScheduleDualPipeV``: stages ``p`` and ``2*PP-1-p``; interleaved
1F1B: ``p`` and ``p+PP``, its neighbouring forwards and backwards paired into
``OVERLAP_F_B``). Every step runs twice, on two identical models: with torch's own
execution of the schedule, and prepared by ``moe_overlap`` (one call). The last stage's
ranks print the losses and whether they, and every gradient on every rank, are
bit-identical; each EP rank trains on its own data (dense gradients averaged over the EP
group, expert gradients scaled to the group's mean loss), then one SGD step. With
``--timeline DIR`` each rank writes the last step's plan timeline as a Chrome trace.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT / "src"))

from torch.distributed.pipelining import PipelineStage  # noqa: E402 - after the path set-up
from torch.distributed.pipelining.schedules import (  # noqa: E402
    ScheduleDualPipeV,
    ScheduleInterleaved1F1B,
)

from moe_overlap.blocks import GroupedExperts  # noqa: E402
from moe_overlap.integrations.pipelining import prepare_schedule  # noqa: E402
from moe_overlap.models import (  # noqa: E402
    GPTMoEConfig,
    GPTMoEModel,
    GPTMoEStage,
    masked_cross_entropy,
)
from moe_overlap.timeline import Timeline  # noqa: E402

BATCH, SEQ = 2, 16
# Layer boundaries of the four stages: uneven on purpose (stage 0 holds only the dense
# layer; the others one or two MoE layers).
BOUNDS = (0, 1, 3, 4, 6)

# torch.distributed leaves these unannotated; give them a type once, here.
_all_reduce = cast(
    "Callable[..., object]",
    dist.all_reduce,  # pyright: ignore[reportUnknownMemberType]
)
_new_group = cast(
    "Callable[[list[int]], object]",
    dist.new_group,  # pyright: ignore[reportUnknownMemberType]
)
_barrier = cast(
    "Callable[[], object]",
    dist.barrier,  # pyright: ignore[reportUnknownMemberType]
)


def loss_fn(logits: Tensor, labels: Tensor) -> Tensor:
    return masked_cross_entropy(logits, labels, None)


def build(ep_group: dist.ProcessGroup | None, *, delay: bool) -> GPTMoEModel:
    config = GPTMoEConfig(
        vocab_size=96,
        num_layers=BOUNDS[-1],
        hidden_size=32,
        ffn_hidden_size=64,
        num_experts=4,
        moe_ffn_hidden_size=16,
        moe_router_topk=2,
        delay_wgrad_compute=delay,
        seed=0,
    )
    return GPTMoEModel(config, ep_group=ep_group)


def stage_indices(schedule: str, pp: int, pp_rank: int) -> list[int]:
    if schedule == "dualpipev":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank, pp_rank + pp]


def make_schedule(
    args: argparse.Namespace, model: GPTMoEModel, pp_rank: int, pp_group: dist.ProcessGroup
) -> Any:
    stages: list[Any] = []
    for index in stage_indices(args.schedule, args.pp, pp_rank):
        module = GPTMoEStage(model, range(BOUNDS[index], BOUNDS[index + 1]))
        stages.append(
            PipelineStage(module, index, 2 * args.pp, torch.device("cpu"), group=pp_group)
        )
    cls = ScheduleDualPipeV if args.schedule == "dualpipev" else ScheduleInterleaved1F1B
    return cls(stages, n_microbatches=args.microbatches, loss_fn=loss_fn)


def batch(step: int, ep_rank: int, microbatches: int) -> tuple[Tensor, Tensor]:
    """Arithmetic sequences mod the vocabulary (learnable: next = previous + stride)."""
    gen = torch.Generator().manual_seed(1_000 * step + ep_rank)
    n = BATCH * microbatches
    start = torch.randint(0, 96, (n, 1), generator=gen)
    stride = torch.randint(1, 4, (n, 1), generator=gen)
    tokens = (start + stride * torch.arange(SEQ + 1)) % 96
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def train_step(
    model: GPTMoEModel,
    schedule: Any,
    x: Tensor,
    y: Tensor,
    pp_rank: int,
    ep_group: dist.ProcessGroup | None,
    ep: int,
    lr: float,
) -> list[float]:
    """One schedule step, the EP-group gradient reduction and an SGD step; the losses."""
    model.zero_grad(set_to_none=True)
    losses: list[Tensor] = []
    if pp_rank == 0:
        schedule.step(x, target=y, losses=losses)
    else:
        schedule.step(target=y, losses=losses)
    experts = {
        id(p) for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()
    }
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is None:
                continue
            if id(p) in experts:
                p.grad.div_(ep)
            elif ep > 1:
                _all_reduce(p.grad, group=ep_group)
                p.grad.div_(ep)
        for p in model.parameters():
            if p.grad is not None:
                p.add_(p.grad, alpha=-lr)
    return [float(v.detach()) for v in losses]


def same_grads(a: nn.Module, b: nn.Module) -> bool:
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        if p.grad is None or q.grad is None:
            if (p.grad is None) != (q.grad is None):
                return False
        elif not torch.equal(p.grad, q.grad):
            return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--ep",
        type=int,
        default=2,
        help="expert-parallel size; the pipeline size is the number of processes divided by it "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--schedule",
        choices=("dualpipev", "interleaved"),
        default="dualpipev",
        help="torch's ScheduleDualPipeV, or ScheduleInterleaved1F1B with its neighbouring "
        "forwards and backwards paired (default: %(default)s)",
    )
    parser.add_argument(
        "--microbatches",
        type=int,
        default=4,
        help="microbatches per step (default: %(default)s)",
    )
    parser.add_argument(
        "--steps", type=int, default=3, help="training steps (default: %(default)s)"
    )
    parser.add_argument(
        "--lr", type=float, default=0.5, help="SGD learning rate (default: %(default)s)"
    )
    parser.add_argument(
        "--delay-wgrad",
        action="store_true",
        help="build the prepared model with delayed weight gradients; torch's run keeps "
        "them in backward (default: off)",
    )
    parser.add_argument(
        "--timeline",
        type=Path,
        default=None,
        help="folder for each rank's Chrome trace of the last step, created if missing "
        "(default: none written)",
    )
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world, ep = dist.get_rank(), dist.get_world_size(), args.ep
    if world % ep or world // ep < 1:
        raise SystemExit(f"world size {world} is not PP x EP for --ep {ep}")
    args.pp = pp = world // ep
    pp_rank, ep_rank = divmod(rank, ep)
    ep_groups = [_new_group([p * ep + e for e in range(ep)]) for p in range(pp)]
    pp_groups = [_new_group([p * ep + e for p in range(pp)]) for e in range(ep)]
    ep_group = cast("dist.ProcessGroup", ep_groups[pp_rank]) if ep > 1 else None
    pp_group = cast("dist.ProcessGroup", pp_groups[ep_rank])
    torch.use_deterministic_algorithms(True)

    reference = build(ep_group, delay=False)
    reference_schedule = make_schedule(args, reference, pp_rank, pp_group)
    model = build(ep_group, delay=args.delay_wgrad)
    timeline = Timeline(rank=rank)
    schedule = make_schedule(args, model, pp_rank, pp_group)
    overlap = prepare_schedule(schedule, pair=args.schedule == "interleaved", observer=timeline)
    last = 2 * pp - 1 in stage_indices(args.schedule, pp, pp_rank)
    if rank == 0:
        print(
            f"PP={pp} x EP={ep}, {args.schedule}, {args.microbatches} microbatches, "
            f"delayed wgrad {'on' if args.delay_wgrad else 'off'}; "
            f"{overlap.paired} OVERLAP_F_B actions per step on rank 0",
            flush=True,
        )
    for step in range(args.steps):
        x, y = batch(step, ep_rank, args.microbatches)
        timeline.clear()
        want = train_step(reference, reference_schedule, x, y, pp_rank, ep_group, ep, args.lr)
        got = train_step(model, schedule, x, y, pp_rank, ep_group, ep, args.lr)
        same = torch.tensor([float(got == want and same_grads(model, reference))])
        _all_reduce(same, op=dist.ReduceOp.MIN)
        if last and ep_rank == 0:
            shown = " ".join(f"{v:.4f}" for v in got)
            same_text = bool(same.item())
            print(f"step {step + 1}: losses {shown} | matches torch's schedule: {same_text}")
    if args.timeline is not None:
        args.timeline.mkdir(parents=True, exist_ok=True)
        timeline.to_chrome_trace(args.timeline / f"rank{rank}.json")
    _barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
