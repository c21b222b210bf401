"""Exact under concurrency: every composition, many runs, bit for bit, shaken and not.

A race between the compute and communication streams shows in some runs, not all, and
mostly at sizes where kernels are long. This script runs each composition of the library
``--runs`` times at benchmark scale under deterministic algorithms (new memory is filled
with NaN, so a read before a write shows) and checks every run's losses and gradients
bit-identical to a reference computed once:

- ``combined_1f1b`` (overlapped, fill/drain, recompute, delayed wgrad, early release,
  chunked all-to-all, fill/drain given as a whole node schedule without joins, the
  planner's best schedule of ``benchmarks/results/frontier``: several microbatches in flight,
  delayed weight gradients, recomputation started early), every one with the loopback
  all-to-all: against plain
  per-microbatch ``backward()`` on an identical model;
- torch pipelining schedules prepared by ``prepare_schedule`` (paired interleaved 1F1B,
  DualPipeV, ZBV zero bubble), two stages on this rank, loopback all-to-all: against
  torch's own execution of the same schedule on an identical model.

``--shake`` repeats every run with seeded random delays queued on each stream at node
boundaries (:func:`moe_overlap.streams.shake`), so the streams slide against each other.
``--without-record-stream-fix`` reproduces issue 37's race (see docs/correctness.md):
the layer nodes then skip ``record_stream`` for the gradients of their ``node.detach``
copies. Exits 1 when any run (without that switch) is not bit-identical. Launch::

    python benchmarks/stress_exact.py --out benchmarks/results/stress      # H200
    python benchmarks/stress_exact.py --device cpu --tiny --runs 1         # smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
import time
from collections.abc import Callable, Generator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    ScheduleDualPipeV,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

from moe_overlap import Microbatch, ScheduleOptions, combined_1f1b, make_streams
from moe_overlap.blocks import finish_wgrad
from moe_overlap.integrations.pipelining import prepare_schedule
from moe_overlap.models import GPTMoEConfig, GPTMoEModel, GPTMoEStage, masked_cross_entropy
from moe_overlap.plan import ScheduleGraph, node_schedule, today_orders
from moe_overlap.steps import Direction, NodeSchedule, Slot
from moe_overlap.streams import shake

C1F1B = (
    "overlapped",
    "fill_drain",
    "recompute",
    "delay_wgrad",
    "early_release",
    "a2a_chunks",
    "node_schedule",
    "frontier",
)
PIPELINES = ("pp_interleaved", "pp_dualpipev", "pp_zbv")
COMPOSITIONS = C1F1B + PIPELINES


def config_for(args: argparse.Namespace, composition: str) -> GPTMoEConfig:
    """The model: tiny on CPU, else DeepSeek-like MoE layers at ``--hidden``."""
    cuda = args.device == "cuda"
    extra: dict[str, Any] = {}
    if composition == "recompute":
        extra["recompute"] = ("norm", "activation", "attention_core")
    if composition in ("delay_wgrad", "frontier"):
        extra["delay_wgrad_compute"] = True
    if composition == "a2a_chunks":
        extra["moe_a2a_chunks"] = 2
    if args.tiny:
        base = GPTMoEConfig(
            vocab_size=96,
            num_layers=args.layers,
            first_k_dense=0,
            hidden_size=32,
            ffn_hidden_size=64,
            num_experts=4,
            moe_ffn_hidden_size=16,
            moe_router_topk=2,
            dispatcher="loopback",
        )
    else:
        base = GPTMoEConfig(
            vocab_size=32000,
            num_layers=args.layers,
            first_k_dense=0,
            hidden_size=args.hidden,
            num_attention_heads=args.hidden // 128,
            ffn_hidden_size=4 * args.hidden,
            num_experts=8,
            moe_ffn_hidden_size=args.hidden // 2,
            moe_router_topk=8,
            attention="sdpa",
            dispatcher="loopback",
            dtype=torch.bfloat16 if cuda else torch.float32,
        )
    return dataclasses.replace(base, **extra)


FRONTIER = Path(__file__).resolve().parent / "results" / "frontier" / "frontier.json"


def frontier_order(microbatches: int, layers: int, frontier: Path = FRONTIER) -> NodeSchedule:
    """The committed frontier's best order for ``microbatches`` (``benchmarks/frontier.py``:
    several microbatches in flight, delayed weight gradients, recomputation started early);
    ``frontier``: another frontier file (``--frontier``)."""
    for c in json.loads(frontier.read_text(encoding="utf-8"))["configs"]:
        schedule = NodeSchedule.parse(c["best_order"])
        uses_r = any(s.direction is Direction.RECOMPUTE for s in schedule.steps)
        n_layers = 1 + max(s.layer for s in schedule.steps if s.layer is not None)
        if schedule.microbatches == microbatches and n_layers == layers and uses_r:
            return schedule
    raise SystemExit(
        f"stress_exact: {frontier} has no best order of {microbatches} microbatches and "
        f"{layers} layers with recomputation; run the frontier composition with "
        "--microbatches 4 or 8 and --layers 4"
    )


def grads_of(model: nn.Module) -> dict[str, Tensor | None]:
    return {
        n: (p.grad.detach().clone() if p.grad is not None else None)
        for n, p in model.named_parameters()
    }


def mismatches(
    model: nn.Module, want: dict[str, Tensor | None], got: list[Tensor], losses: list[Tensor]
) -> list[str]:
    """Every loss and gradient that is not bit-identical (name, largest difference, NaN)."""
    out: list[str] = []
    for i, (g, w) in enumerate(zip(got, losses, strict=True)):
        if not torch.equal(g.detach().float(), w.detach().float()):
            out.append(f"loss {i}: {g.item()!r} against {w.item()!r}")
    for name, p in model.named_parameters():
        ref = want[name]
        if (p.grad is None) != (ref is None):
            out.append(f"{name}: gradient on one side only")
        elif p.grad is not None and ref is not None and not torch.equal(p.grad, ref):
            finite = bool(torch.isfinite(p.grad).all())
            diff = (p.grad.float() - ref.float()).abs().max().item()
            out.append(f"{name}: max abs diff {diff:.3e}" + ("" if finite else " (not finite)"))
    return out


@contextmanager
def shaken(on: bool, seed: int, max_us: float) -> Generator[None]:
    with shake(seed, max_us=max_us) if on else nullcontext():
        yield


class C1F1BCase:
    """``combined_1f1b`` of one composition against plain backward (reference computed once)."""

    def __init__(self, args: argparse.Namespace, composition: str, device: torch.device) -> None:
        config = config_for(args, composition)
        self.model = GPTMoEModel(config, device=device)
        plain = GPTMoEModel(config, device=device)
        gen = torch.Generator().manual_seed(0)
        seq = args.seq
        self.mbs = [
            Microbatch(input_ids=t[:, :-1].to(device), labels=t[:, 1:].to(device))
            for t in (
                torch.randint(0, config.vocab_size, (args.batch, seq + 1), generator=gen)
                for _ in range(args.microbatches)
            )
        ]
        self.losses: list[Tensor] = []
        for mb in self.mbs:
            assert mb.input_ids is not None
            loss = plain(mb.input_ids, labels=mb.labels)
            loss.backward()
            finish_wgrad(plain)
            self.losses.append(loss.detach().float())
        self.want = grads_of(plain)
        del plain
        options = self.model.schedule_options()
        if composition == "early_release":
            options = dataclasses.replace(options, ep_overlap_early_attn_memory_release=True)
        self.options: ScheduleOptions = options
        self.fill_drain = composition == "fill_drain"
        self.schedule: NodeSchedule | None = None
        if composition == "node_schedule":  # fill/drain as node steps, no joins
            graph = ScheduleGraph(microbatches=len(self.mbs), moe=(True,) * config.num_layers)
            self.schedule = node_schedule(today_orders(graph)["fill_drain"])
        if composition == "frontier":  # the planner's best order of this many microbatches
            self.schedule = frontier_order(len(self.mbs), config.num_layers, args.frontier)
            self.options = dataclasses.replace(options, recompute=(Slot.PRE_DISPATCH, Slot.MLP))
        self.streams = make_streams(device)

    def run(self) -> list[str]:
        self.model.zero_grad(set_to_none=True)
        got = combined_1f1b(
            self.model,
            self.mbs,
            options=self.options,
            streams=self.streams,
            fill_drain=self.fill_drain,
            schedule=self.schedule,
        )
        return mismatches(self.model, self.want, list(got), self.losses)


def _loss_fn(logits: Tensor, labels: Tensor) -> Tensor:
    return masked_cross_entropy(logits, labels, None)


class PipelineCase:
    """A prepared torch schedule (two stages on this rank) against torch's own execution."""

    def __init__(self, args: argparse.Namespace, composition: str, device: torch.device) -> None:
        config = config_for(args, composition)
        self.device = device
        reference = GPTMoEModel(config, device=device)
        self.model = GPTMoEModel(config, device=device)
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(
            0, config.vocab_size, (args.batch * args.microbatches, args.seq + 1), generator=gen
        )
        self.x, self.y = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
        kind = composition.removeprefix("pp_")
        ref_schedule = self._schedule(args, kind, reference)
        self.losses = self._step(ref_schedule)
        self.want = grads_of(reference)
        del ref_schedule, reference
        self.schedule = self._schedule(args, kind, self.model)
        prepare_schedule(self.schedule, pair=kind == "interleaved")
        self._step(self.schedule)  # the first step infers shapes (torch's plain path)

    def _schedule(self, args: argparse.Namespace, kind: str, model: GPTMoEModel) -> Any:
        per = args.layers // 2
        stages: list[Any] = [
            PipelineStage(GPTMoEStage(model, range(i * per, (i + 1) * per)), i, 2, self.device)
            for i in (0, 1)
        ]
        cls = {
            "interleaved": ScheduleInterleaved1F1B,
            "dualpipev": ScheduleDualPipeV,
            "zbv": ScheduleZBVZeroBubble,
        }[kind]
        return cls(stages, n_microbatches=args.microbatches, loss_fn=_loss_fn)

    def _step(self, schedule: Any) -> list[Tensor]:
        losses: list[Tensor] = []
        schedule.step(self.x, target=self.y, losses=losses)
        return [loss.detach().float() for loss in losses]

    def run(self) -> list[str]:
        self.model.zero_grad(set_to_none=True)
        got = self._step(self.schedule)
        return mismatches(self.model, self.want, got, self.losses)


def _without_record_stream_fix() -> None:
    """Reproduce issue 37's race: layer nodes skip ``record_stream`` for their copies'
    gradients (a fault injected on purpose, through the private module that holds it)."""

    def skip(tensor: Tensor, stream: object) -> None:
        del tensor, stream

    layer_node = importlib.import_module("moe_overlap.engine.core._layer_node")
    setattr(layer_node, "record_tensor_on", skip)  # noqa: B010  # a fault, injected


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny model (CPU smoke run)")
    p.add_argument("--compositions", nargs="+", choices=COMPOSITIONS, default=list(COMPOSITIONS))
    p.add_argument("--runs", type=int, default=10, help="runs per composition and shaking")
    p.add_argument("--shake", choices=("both", "on", "off"), default="both")
    p.add_argument("--max-delay-us", type=float, default=3000.0)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layers", type=int, default=4, help="pipelines: half per stage")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--without-record-stream-fix", action="store_true")
    p.add_argument(
        "--frontier",
        type=Path,
        default=FRONTIER,
        help="the frontier whose best order the frontier composition runs (default: "
        "benchmarks/results/frontier/frontier.json)",
    )
    p.add_argument("--out", type=Path, default=None, help="folder for stress.json")
    args = p.parse_args()
    if args.tiny:
        args.seq = 16
    if args.without_record_stream_fix:
        _without_record_stream_fix()
    device = torch.device(args.device)
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    else:
        torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    if any(c in PIPELINES for c in args.compositions) and not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        backend = "nccl" if device.type == "cuda" else "gloo"  # torch's p2p needs NCCL on CUDA
        dist.init_process_group(backend, rank=0, world_size=1)
    shakes = {"both": (False, True), "on": (True,), "off": (False,)}[args.shake]
    rows: list[dict[str, object]] = []
    for composition in args.compositions:
        t0 = time.perf_counter()
        make: Callable[..., Any] = PipelineCase if composition in PIPELINES else C1F1BCase
        case = make(args, composition, device)
        setup_s = time.perf_counter() - t0
        for on in shakes:
            bad: list[dict[str, object]] = []
            t1 = time.perf_counter()
            for run in range(args.runs):
                with shaken(on, seed=run, max_us=args.max_delay_us):
                    found = case.run()
                if found:
                    bad.append({"run": run, "mismatch": found[:8]})
            if device.type == "cuda":
                torch.cuda.synchronize()
            row: dict[str, object] = {
                "composition": composition,
                "shaken": on,
                "runs": args.runs,
                "not_bit_identical": len(bad),
                "bad_runs": bad[:4],
                "seconds_per_run": (time.perf_counter() - t1) / max(1, args.runs),
                "setup_s": setup_s,
            }
            rows.append(row)
            print(
                f"{composition:15s} shaken={on!s:5s} {len(bad)}/{args.runs} not bit-identical"
                + (f"  first: {bad[0]['mismatch']}" if bad else ""),
                flush=True,
            )
        del case
        if device.type == "cuda":
            torch.cuda.empty_cache()
    summary = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "command": " ".join(sys.argv),
        "without_record_stream_fix": args.without_record_stream_fix,
        "rows": rows,
    }
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / "stress.json"
        path.write_text(json.dumps(summary, indent=1))
        print(f"wrote {path}", flush=True)
    total = sum(cast(int, r["not_bit_identical"]) for r in rows)
    print(f"runs not bit-identical: {total} of {sum(cast(int, r['runs']) for r in rows)}")
    if dist.is_initialized():
        dist.destroy_process_group()
    if total and not args.without_record_stream_fix:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
