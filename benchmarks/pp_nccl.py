"""Pipeline x expert parallelism over NCCL (or gloo on CPU): exact and timed, per rank.

Trains the reference model (:class:`moe_overlap.models.GPTMoEModel`) with a torch
pipelining schedule, ``ScheduleDualPipeV`` or interleaved 1F1B with its neighbouring
forwards and backwards paired (``OVERLAP_F_B``), one process per GPU, ranks ``p * EP + e``
(pipeline rank ``p``, expert-parallel rank ``e``; two stages per pipeline rank). On every
rank it

1. runs one step of torch's own execution of the schedule, one of the same schedule prepared
   by :func:`moe_overlap.integrations.pipelining.prepare_schedule` (``prepared``) and one of
   it prepared with every pair run one after the other (``prepared_serial``), on identical
   models, and checks losses and every gradient of both bit-identical to torch's (bf16 on
   CUDA, deterministic kernels only: ``torch.use_deterministic_algorithms(True)``, not
   warn-only, for the whole run as before; ``CUBLAS_WORKSPACE_CONFIG=:4096:8``; for this
   step SDPA kept off cuDNN attention, which has no deterministic backward, or with
   ``--exact-attention math`` on its math backend only). A step that is not bit-identical
   on some rank fails the run: rank 0 writes ``pp_results.json`` with every rank's
   differences and prints them to stderr, and every rank exits 1 without timing (with
   ``--continue-after-inexact``: after timing). ``MOE_OVERLAP_BENCH_PERTURB=prepared``
   (``prepared_serial``; ``1``: ``prepared``) adds one ulp to the first gradient of that
   step on rank 0: the failure path's test;
2. times steps of both (median of ``--iters`` after ``--warmup``);
3. records the prepared schedule's timeline (one Chrome trace per rank) and the share of
   the step its compute stream was busy: the rest is pipeline bubble plus waiting;
4. times the same prepared schedule with every pair run one after the other and keeps its
   node durations (``serial_slot_durations``): the profile :mod:`moe_overlap.plan` predicts
   the overlapped step from.

At EP=1 ``--loopback`` gives the all-to-all its bytes through pinned host memory (the
one-GPU stand-in), so it is a real share of the step. Launch::

    torchrun --nproc-per-node 2 benchmarks/pp_nccl.py --out DIR              # PP=2, NCCL
    torchrun --nproc-per-node 4 benchmarks/pp_nccl.py --ep 2 --out DIR       # PP=2 x EP=2
    torchrun --nproc-per-node 2 benchmarks/pp_nccl.py --device cpu --tiny    # gloo

NVLink multicast stays off (``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``,
``NVSHMEM_DISABLE_NVLS=1``), as the device documentation asks.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

# Deterministic cuBLAS (read when CUDA starts; :4096:8 is Hopper's default workspace size).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import ScheduleDualPipeV, ScheduleInterleaved1F1B

from moe_overlap.integrations.pipelining import prepare_schedule
from moe_overlap.models import GPTMoEConfig, GPTMoEModel, GPTMoEStage, masked_cross_entropy
from moe_overlap.steps import StreamKind
from moe_overlap.timeline import Span, Timeline

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_overlap import (
    JsonDict,
    Run,
    add_ulp,
    compare,
    describe,
    deterministic_kernels,
    perturb_target,
    snapshot,
)

_SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

# torch.distributed leaves these unannotated; give them types once, here.
_all_reduce = cast("Callable[..., object]", dist.all_reduce)  # pyright: ignore[reportUnknownMemberType]
_new_group = cast("Callable[[list[int]], object]", dist.new_group)  # pyright: ignore[reportUnknownMemberType]
_barrier = cast("Callable[[], object]", dist.barrier)  # pyright: ignore[reportUnknownMemberType]
_gather_object = cast(
    "Callable[..., object]",
    dist.all_gather_object,  # pyright: ignore[reportUnknownMemberType]
)


def config_for(args: argparse.Namespace, ep: int, layers: int) -> GPTMoEConfig:
    """The model: tiny on CPU, else DeepSeek-like MoE layers (8 local experts, top-8)."""
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    dispatcher: Any = "loopback" if args.loopback and ep == 1 else "alltoall"
    if args.tiny:
        return GPTMoEConfig(
            vocab_size=96,
            num_layers=layers,
            hidden_size=32,
            ffn_hidden_size=64,
            num_experts=4 * ep,
            moe_ffn_hidden_size=16,
            moe_router_topk=2,
            dispatcher=dispatcher,
            delay_wgrad_compute=args.delay_wgrad,
            dtype=dtype,
        )
    return GPTMoEConfig(
        vocab_size=32000,
        num_layers=layers,
        first_k_dense=0,
        hidden_size=args.hidden,
        num_attention_heads=args.hidden // 128,
        ffn_hidden_size=4 * args.hidden,
        num_experts=8 * ep,
        moe_ffn_hidden_size=args.hidden // 2,
        moe_router_topk=8,
        attention="sdpa",
        dispatcher=dispatcher,
        delay_wgrad_compute=args.delay_wgrad,
        dtype=dtype,
    )


def loss_fn(logits: Tensor, labels: Tensor) -> Tensor:
    return masked_cross_entropy(logits, labels, None)


def make_schedule(
    args: argparse.Namespace,
    model: GPTMoEModel,
    pp_rank: int,
    group: dist.ProcessGroup,
    device: torch.device,
) -> Any:
    """This rank's two stages of ``model`` and the torch schedule over them."""
    pp, per = args.pp, args.layers_per_stage
    if args.schedule == "dualpipev":
        indices = [pp_rank, 2 * pp - 1 - pp_rank]
    else:
        indices = [pp_rank, pp_rank + pp]
    stages: list[Any] = [  # torch's schedules annotate list[_PipelineStageBase] (invariant)
        PipelineStage(
            GPTMoEStage(model, range(i * per, (i + 1) * per)), i, 2 * pp, device, group=group
        )
        for i in indices
    ]
    cls = ScheduleDualPipeV if args.schedule == "dualpipev" else ScheduleInterleaved1F1B
    return cls(stages, n_microbatches=args.microbatches, loss_fn=loss_fn)


def run_step(schedule: Any, x: Tensor, y: Tensor, pp_rank: int) -> list[Tensor]:
    losses: list[Tensor] = []
    if pp_rank == 0:
        schedule.step(x, target=y, losses=losses)
    else:
        schedule.step(target=y, losses=losses)
    return losses


#: The steps checked against torch's execution of the schedule.
CHECKED = ("prepared", "prepared_serial")


def grads_of(net: nn.Module, losses: list[Tensor]) -> Run:
    """A step's losses and gradients by parameter name (not copied: each model is its
    own)."""
    return snapshot(net, losses, copy=False)


def busy_ms(spans: list[Span], stream: StreamKind) -> float:
    """Milliseconds of ``stream`` covered by at least one span (overlaps counted once)."""
    busy, end = 0.0, float("-inf")
    for s in sorted((s for s in spans if s.stream is stream), key=lambda s: s.start_ms):
        lo = max(s.start_ms, end)
        if s.end_ms > lo:
            busy += s.end_ms - lo
        end = max(end, s.end_ms)
    return busy


def timed(device: torch.device, fn: Callable[[], object], warmup: int, iters: int) -> list[float]:
    out: list[float] = []
    for i in range(warmup + iters):
        _barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny model (CPU smoke run)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size")
    p.add_argument("--schedule", choices=("dualpipev", "interleaved"), default="dualpipev")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--layers-per-stage", type=int, default=2)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--loopback", action="store_true", help="EP=1: all-to-all bytes via host")
    p.add_argument("--delay-wgrad", action="store_true")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--exact-attention",
        choices=("sdpa", "math"),
        default="sdpa",
        help="attention kernels of the exactness step: sdpa = SDPA's deterministic backends "
        "(never cuDNN); math = SDPA's math backend only",
    )
    p.add_argument(
        "--continue-after-inexact",
        action="store_true",
        help="time the steps even when the exactness step failed (every rank still exits 1)",
    )
    args = p.parse_args()
    perturb = perturb_target(CHECKED)
    if args.tiny:
        args.batch, args.seq = 2, 16
    os.environ.update(_SAFE_ENV)
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world, ep = dist.get_rank(), dist.get_world_size(), args.ep
    if world % ep:
        raise SystemExit(f"pp_nccl: world size {world} is not PP x EP for --ep {ep}")
    args.pp = world // ep
    pp_rank, ep_rank = divmod(rank, ep)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else None
    device = device or torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.use_deterministic_algorithms(True)
    ep_groups = [_new_group([q * ep + e for e in range(ep)]) for q in range(args.pp)]
    pp_groups = [_new_group([q * ep + e for q in range(args.pp)]) for e in range(ep)]
    ep_group = cast("dist.ProcessGroup", ep_groups[pp_rank]) if ep > 1 else None
    pp_group = cast("dist.ProcessGroup", pp_groups[ep_rank])
    config = config_for(args, ep, 2 * args.pp * args.layers_per_stage)

    # torch's own execution runs no backward_dw: its model computes weight grads at once.
    plain = dataclasses.replace(config, delay_wgrad_compute=False)
    reference = GPTMoEModel(plain, ep_group=ep_group, device=device)
    model = GPTMoEModel(config, ep_group=ep_group, device=device)
    torch_schedule = make_schedule(args, reference, pp_rank, pp_group, device)
    ours = make_schedule(args, model, pp_rank, pp_group, device)
    timeline = Timeline(rank=rank)
    overlap = prepare_schedule(ours, pair=args.schedule == "interleaved", observer=timeline)
    # The same schedule with every pair run one after the other: its node durations are the
    # serial profile that moe_overlap.plan predicts the overlapped step from.
    profiled = GPTMoEModel(config, ep_group=ep_group, device=device)
    serial = make_schedule(args, profiled, pp_rank, pp_group, device)
    profile = Timeline(rank=rank)
    prepare_schedule(serial, pair=args.schedule == "interleaved", overlap=False, observer=profile)
    gen = torch.Generator().manual_seed(ep_rank)
    tokens = torch.randint(
        0, config.vocab_size, (args.batch * args.microbatches, args.seq + 1), generator=gen
    )
    x, y = tokens[:, :-1].to(device), tokens[:, 1:].to(device)

    checked = {"prepared": (ours, model), "prepared_serial": (serial, profiled)}
    rows: dict[str, JsonDict] = {}
    with deterministic_kernels(device, args.exact_attention) as kernels:
        want = grads_of(reference, run_step(torch_schedule, x, y, pp_rank))
        for name, (schedule, net) in checked.items():
            got = grads_of(net, run_step(schedule, x, y, pp_rank))
            if rank == 0 and (perturb == name or (perturb == "1" and name == CHECKED[0])):
                add_ulp(next(iter(got[1].values())))
            rows[name] = compare(got, want)
    mismatch = {name: r["differences"] for name, r in rows.items() if not r["bit_identical"]}
    flag = torch.tensor([float(not mismatch)], device=device)
    _all_reduce(flag, op=dist.ReduceOp.MIN)
    exact = bool(flag.item())
    every: list[object] = [None] * world
    _gather_object(every, {"rank": rank, "exactness": rows})
    summary: JsonDict = {
        "pp": args.pp,
        "ep": ep,
        "schedule": args.schedule,
        "microbatches": args.microbatches,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "bit_identical": exact,
        "exactness": {
            "kernels": kernels,
            "attention": args.exact_attention,
            "reference": "torch's execution of the schedule",
            "perturbed": perturb,
            "ranks": every,
        },
    }
    if not exact and rank == 0:
        for entry in every:
            r_rows = cast("dict[str, JsonDict]", cast(JsonDict, entry)["exactness"])
            for name, r in r_rows.items():
                if not r["bit_identical"]:
                    print(
                        f"pp_nccl: EXACTNESS FAILED on rank {cast(JsonDict, entry)['rank']} "
                        f"({kernels}): " + describe(name, "torch's execution", r),
                        file=sys.stderr,
                        flush=True,
                    )
    if not exact and not args.continue_after_inexact:
        if rank == 0:
            print(f"matches torch's schedule on every rank: {exact}", flush=True)
            _write(args.out, summary)
        _barrier()
        dist.destroy_process_group()
        raise SystemExit(
            f"pp_nccl rank {rank}: a prepared step is not bit-identical to torch's execution "
            "under deterministic kernels (see rank 0's stderr); not timed "
            "(--continue-after-inexact)"
        )

    def step(schedule: Any, net: nn.Module) -> None:
        net.zero_grad(set_to_none=True)
        timeline.clear()
        run_step(schedule, x, y, pp_rank)

    torch_ms = timed(device, lambda: step(torch_schedule, reference), args.warmup, args.iters)
    ours_ms = timed(device, lambda: step(ours, model), args.warmup, args.iters)
    spans = timeline.spans()

    def serial_step() -> None:
        profiled.zero_grad(set_to_none=True)
        profile.clear()
        run_step(serial, x, y, pp_rank)

    serial_ms = timed(device, serial_step, args.warmup, args.iters)
    durations = [
        {"layer": k[0], "slot": k[1].value, "direction": k[2].value, "ms": ms}
        for k, ms in sorted(profile.slot_durations().items(), key=lambda kv: str(kv[0]))
    ]
    last = ours_ms[-1] if ours_ms else float("nan")
    row: dict[str, object] = {
        "rank": rank,
        "mismatch": mismatch,
        "pp_rank": pp_rank,
        "ep_rank": ep_rank,
        "torch_step_ms": statistics.median(torch_ms) if torch_ms else None,
        "overlapped_step_ms": statistics.median(ours_ms) if ours_ms else None,
        "overlapped_step_ms_samples": ours_ms,
        "serial_prepared_step_ms": statistics.median(serial_ms) if serial_ms else None,
        "serial_slot_durations": durations,
        "overlap_f_b_actions": overlap.paired,
        "comp_busy_ms": busy_ms(spans, StreamKind.COMP),
        "comm_busy_ms": busy_ms(spans, StreamKind.COMM),
        "last_step_ms": last,
    }
    ranks: list[object] = [None] * world
    _gather_object(ranks, row)
    if rank == 0:
        summary["ranks"] = ranks
        print(json.dumps(summary), flush=True)
        print(f"matches torch's schedule on every rank: {exact}", flush=True)
        _write(args.out, summary)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        timeline.to_chrome_trace(args.out / f"pp_rank{rank}.json")
    _barrier()
    dist.destroy_process_group()
    if not exact:
        raise SystemExit(
            f"pp_nccl rank {rank}: a prepared step is not bit-identical to torch's execution "
            "under deterministic kernels (timed anyway: --continue-after-inexact)"
        )


def _write(out: Path | None, summary: JsonDict) -> None:
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "pp_results.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
