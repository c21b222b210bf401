"""EP all-to-all overlap on one GPU: serial vs overlapped step, bounds, memory, host time.

Usage (device): ``PYTHONPATH=src python3 benchmarks/bench_overlap.py --out DIR``;
on a laptop: ``PYTHONPATH=src python benchmarks/bench_overlap.py --device cpu --tiny``.

For each configuration of the sweep, in one process:

- ``serial``: ``combined_1f1b(overlap=False)`` with the comm stream = the compute stream;
- ``overlapped``: ``combined_1f1b(overlap=True)`` with real compute + comm streams;
- ``compute_only``: the serial step with the loopback replaced by one device-side copy;
- ``comm_only``: the loopback copies alone, the same calls and bytes, on one stream;
- ``bound``: the critical path of the overlapped schedule from per-node durations measured
  in a serial step (``bound``, no contention) and in an overlapped step
  (``bound_contended``); ``efficiency = bound / overlapped``.

- ``fill_drain``: the overlapped step with the fill and the drain overlapped too
  (``combined_1f1b(fill_drain=True)``);
- ``graphs``: the overlapped and the fill/drain steps with each layer's attention run as
  CUDA graphs (:class:`~moe_overlap.blocks.GraphedBlock`), with their own bound; every copy
  is captured before the timed steps (checked).

Timing (every row): the variants above (the first configuration also the high-priority
comm stream and delayed expert wgrad) run interleaved, ``--warmup`` untimed rounds (2;
the process's first row ``--first-warmup``, 4) then ``--iters`` timed rounds (5), each
round running every variant once in an order rotated by one per round; each figure is the
median of its timed steps, stored with its samples and their spread ((max - min) / min).
``--budget-s`` skips a row whose predicted time (from the rows already run) would pass
the budget, and says so.

Then, for the first configuration: peak memory of every variant with and without
free-input, the timeline (PNG + Chrome trace) of one overlapped step, and host time per
layer pair, eager and graphed; and host time and step time at a host-bound size (H=256).

Exactness (every row, before its timed steps): one step of every variant that computes
gradients (all but ``comm_only``) from zero gradients, and of ``serial`` twice, under
deterministic kernels only (:func:`deterministic_kernels`:
``torch.use_deterministic_algorithms(True)``, not warn-only, so an operation without a
deterministic implementation raises instead of running; ``CUBLAS_WORKSPACE_CONFIG=:4096:8``;
SDPA kept off cuDNN attention, whose backward has no deterministic mode, and with
``--exact-attention math`` on its math backend only), the graphed variants with graphs
captured under those kernels. Every variant's losses and gradients must be bit-identical to
the first serial step's, and the second serial step too; anything else fails the benchmark:
the row's results are written (``exactness`` in ``results.json``: per variant what differed,
the largest difference, whether a value is not finite), the differences printed to stderr,
and the process exits 1, or with ``--continue-after-inexact`` times the rest of the sweep
first and exits 1 at the end. The timed steps run as before, in PyTorch's default mode (the
graphs recaptured in it).

``MOE_OVERLAP_BENCH_PERTURB=<variant>`` (``1``: the first variant checked) adds one ulp to
the first element of that variant's first gradient in the exactness pass: the failure path's
test.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol, cast

# cuBLAS is deterministic only with a fixed workspace per stream, and deterministic mode
# refuses cuBLAS calls without this setting (read when CUDA starts). :4096:8 (32 MiB) is
# the default size on Hopper, so the timed steps run as they did without it.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from moe_overlap import (
    Microbatch,
    ModelChunkSchedulePlan,
    ScheduleOptions,
    StreamPair,
    combined_1f1b,
    make_streams,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_slice import LoopbackMode, MoESliceModel, SliceConfig, make_microbatches
from node_timing import (
    Clock,
    NodeRecorder,
    critical_path_ms,
    fill_drain_runs,
    overlapped_runs,
    pyplot,
    slot_durations,
    write_chrome_trace,
    write_gantt_png,
)

from moe_overlap.steps import (
    OrderSearch,
    ScheduleMode,
    ScheduleOrder,
    SlotKey,
    predict_ms,
    search_order,
)

JsonDict = dict[str, object]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Bench:
    """What one measurement needs: the model, its inputs and the two stream setups."""

    model: MoESliceModel
    mbs: list[Microbatch]
    device: torch.device
    pair: StreamPair
    serial: StreamPair
    warmup: int
    iters: int


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def spread(xs: list[float]) -> float:
    """(max - min) / min of a figure's samples: how far apart the timed steps were."""
    lo = min(xs)
    return (max(xs) - lo) / lo if lo > 0 else 0.0


class Rounds(Protocol):
    """What :func:`time_interleaved` reads of a benchmark: its device, model and rounds."""

    @property
    def device(self) -> torch.device: ...
    @property
    def model(self) -> nn.Module: ...
    @property
    def warmup(self) -> int: ...
    @property
    def iters(self) -> int: ...


def time_interleaved(
    b: Rounds,
    fns: dict[str, Callable[[], object]],
    on_round: Callable[[int, dict[str, list[float]]], None] | None = None,
) -> dict[str, list[float]]:
    """Per-call milliseconds of every variant of one row, the variants interleaved.

    ``b.warmup`` untimed rounds, then ``b.iters`` timed rounds; a round runs each variant
    once, the order rotated by one every round (no variant always runs first or always
    follows the same one), so drift over the row (clocks, heat, the allocator) lands on all
    variants alike instead of on whichever ran last. Each call is timed alone: synchronized
    before, marks on the current (compute) stream around it; ``fn`` must leave the current
    stream waiting for all its work (the driver does). ``on_round`` is called after each
    timed round with its index and the samples so far.
    """
    clock = Clock(b.device)
    names = list(fns)
    out: dict[str, list[float]] = {k: [] for k in names}
    for r in range(b.warmup + b.iters):
        for j in range(len(names)):
            name = names[(r + j) % len(names)]
            b.model.zero_grad(set_to_none=False)
            _sync(b.device)
            start = clock.mark()
            fns[name]()
            end = clock.mark()
            _sync(b.device)
            if r >= b.warmup:
                out[name].append(Clock.ms(start, end))
        if on_round is not None and r >= b.warmup:
            on_round(r, out)
    return out


def time_ms(b: Bench, fn: Callable[[], object]) -> list[float]:
    """Per-call milliseconds of one variant alone (``time_interleaved`` of one)."""
    return time_interleaved(b, {"fn": fn})["fn"]


def step(
    b: Bench,
    *,
    overlap: bool,
    options: ScheduleOptions | None = None,
    fill_drain: bool = False,
    on_plan: NodeRecorder | None = None,
) -> list[Tensor]:
    """One step of the schedule; its losses."""
    return combined_1f1b(
        b.model,
        b.mbs,
        overlap=overlap,
        streams=b.pair if overlap else b.serial,
        options=options if options is not None else ScheduleOptions(),
        fill_drain=fill_drain,
        on_plan=on_plan,
    )


def comm_only_step(b: Bench) -> None:
    """The loopback calls of one step (dispatch+combine, forward+backward), back to back."""
    cfg = b.model.config
    x = torch.randn(cfg.slots, cfg.hidden, device=b.device).to(b.model.embed_scale.dtype)
    lb = b.model.loopback
    comp, comm = b.pair.comp, b.pair.comm
    if isinstance(comp, torch.cuda.Stream) and isinstance(comm, torch.cuda.Stream):
        comm.wait_stream(comp)
        with torch.cuda.stream(comm):
            for _ in range(4 * len(b.mbs) * cfg.num_layers):
                lb(x)
        comp.wait_stream(comm)
    else:
        for _ in range(4 * len(b.mbs) * cfg.num_layers):
            lb(x)


def _recorded(
    b: Bench, *, overlap: bool, options: ScheduleOptions | None = None, graphs: bool = False
) -> NodeRecorder:
    """Per-node durations of one step (with the attention graphed when ``graphs``)."""
    rec = NodeRecorder(b.device)
    b.model.zero_grad(set_to_none=False)
    b.model.set_graphs(graphs)
    try:
        _sync(b.device)
        rec.start()
        step(b, overlap=overlap, options=options, on_plan=rec)
        _sync(b.device)
    finally:
        b.model.set_graphs(False)
    return rec


def make_bench(
    cfg: SliceConfig, args: argparse.Namespace, microbatches: int, *, warmup: int | None = None
) -> Bench:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    pair = make_streams(device)
    return Bench(
        model=MoESliceModel(cfg, dtype=dtype, device=device),
        mbs=make_microbatches(microbatches, cfg, dtype=dtype, device=device),
        device=device,
        pair=pair,
        serial=StreamPair(comp=pair.comp, comm=pair.comp),
        warmup=args.warmup if warmup is None else warmup,
        iters=args.iters,
    )


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def switched(
    enter: Callable[[], None], leave: Callable[[], None], fn: Callable[[], object]
) -> Callable[[], object]:
    """``fn`` run between ``enter`` and ``leave`` (a model setting switched for one call);
    returns what ``fn`` returns."""

    def run() -> object:
        enter()
        try:
            return fn()
        finally:
            leave()

    return run


def row_variants(b: Bench, *, main: bool) -> dict[str, Callable[[], object]]:
    """Every timed variant of a row, each one step, each leaving the model as it found it
    (eager attention, host loopback, no delayed wgrad), so that they can be interleaved.

    The graphed variants need their graphs captured first (``_capture_graphs``); the main
    row adds the high-priority comm stream and delayed expert wgrad.
    """
    model = b.model

    def graphed(fn: Callable[[], object]) -> Callable[[], object]:
        return switched(lambda: model.set_graphs(True), lambda: model.set_graphs(False), fn)

    fns: dict[str, Callable[[], object]] = {
        "serial": lambda: step(b, overlap=False),
        "overlapped": lambda: step(b, overlap=True),
        "fill_drain": lambda: step(b, overlap=True, fill_drain=True),
        "graphs_overlapped": graphed(lambda: step(b, overlap=True)),
        "graphs_fill_drain": graphed(lambda: step(b, overlap=True, fill_drain=True)),
        "compute_only": switched(
            lambda: model.set_loopback(LoopbackMode.DEVICE),
            lambda: model.set_loopback(LoopbackMode.HOST),
            lambda: step(b, overlap=False),
        ),
        "comm_only": lambda: comm_only_step(b),
        "fill_drain_recompute": switched(
            lambda: model.set_recompute(True),
            lambda: model.set_recompute(False),
            lambda: step(b, overlap=True, fill_drain=True),
        ),
    }
    if main:
        hp = make_streams(b.device, high_priority_comm=True)
        delay = ScheduleOptions(delay_wgrad_compute=True)
        fns["high_priority_comm"] = lambda: combined_1f1b(model, b.mbs, overlap=True, streams=hp)
        fns["delay_wgrad_compute"] = switched(
            lambda: model.set_delay_wgrad(True),
            lambda: model.set_delay_wgrad(False),
            lambda: step(b, overlap=True, options=delay),
        )
    return fns


def measure(
    cfg: SliceConfig,
    args: argparse.Namespace,
    *,
    microbatches: int,
    main: bool,
    first: bool = False,
    out: Path,
) -> JsonDict:
    """Every figure for one configuration and microbatch count (``first``: the first
    configuration of the process, which gets ``--first-warmup`` warm-up rounds)."""
    b = make_bench(cfg, args, microbatches, warmup=args.first_warmup if first else None)
    model, mbs, dtype = b.model, b.mbs, b.model.embed_scale.dtype
    res: JsonDict = {
        "config": _config_json(cfg, dtype),
        "microbatches": len(mbs),
        "warmup": b.warmup,
        "iters": b.iters,
    }
    _capture_graphs(b)
    fns = row_variants(b, main=main)
    search = _search_order(b)
    found = search.order
    if found.mixed is not None:
        fns["overlapped_searched"] = lambda: step(b, overlap=True, options=_ordered(found))
    if found.forwards is not None or found.backwards is not None:
        fns["fill_drain_searched"] = lambda: step(
            b, overlap=True, options=_ordered(found), fill_drain=True
        )
    exact = exactness(b, fns, attention=args.exact_attention, perturb=args.perturb)
    res["exactness"] = exact
    if exact["failed"] and not args.continue_after_inexact:
        res["stopped"] = "not timed: the exactness pass failed (see --continue-after-inexact)"
        return res
    # The exactness pass dropped its graphs (captured under deterministic kernels): the timed
    # steps get graphs captured in the default mode, before anything is timed.
    captured = _capture_graphs(b)
    t = time_interleaved(b, fns)
    res["order"] = list(t)
    if model.graph_captures() != captured:
        raise RuntimeError("bench_overlap: graphs were captured during the timed steps")
    graph_rec = _recorded(b, overlap=False, graphs=True)
    serial_rec = _recorded(b, overlap=False)
    over_rec = _recorded(b, overlap=True)
    n = len(mbs)
    runs = overlapped_runs(n)
    bound = critical_path_ms(runs, serial_rec.shapes, serial_rec.durations())
    bound_cont = critical_path_ms(runs, over_rec.shapes, over_rec.durations())
    fd_bound = critical_path_ms(fill_drain_runs(n), serial_rec.shapes, serial_rec.durations())
    base = ("serial", "overlapped", "compute_only", "comm_only")
    m = {k: median(t[k]) for k in base}
    res["step_ms"] = m
    res["step_ms_samples"] = {k: t[k] for k in base}
    res["step_ms_spread"] = {k: spread(t[k]) for k in base}
    a2a_calls = 4 * n * cfg.num_layers
    moved = 2 * cfg.a2a_bytes(dtype) * a2a_calls
    res["comm_GBps"] = moved / (m["comm_only"] * 1e-3) / 1e9
    res["comm_to_compute"] = m["comm_only"] / m["compute_only"]
    res["bound_ms"] = bound
    res["bound_contended_ms"] = bound_cont
    res["efficiency"] = bound / m["overlapped"]
    res["efficiency_contended"] = bound_cont / m["overlapped"]
    res["speedup"] = m["serial"] / m["overlapped"]
    res["overlapped_over_max"] = m["overlapped"] / max(m["compute_only"], m["comm_only"])
    res["sum_node_ms_serial"] = sum(serial_rec.durations().values())
    res["fill_drain"] = _overlap_row(t["fill_drain"], fd_bound, m)
    b.model.set_recompute(True)
    try:
        rc_rec = _recorded(b, overlap=False)
    finally:
        b.model.set_recompute(False)
    rc_row = _overlap_row(
        t["fill_drain_recompute"],
        critical_path_ms(fill_drain_runs(n), rc_rec.shapes, rc_rec.durations()),
        m,
    )
    res["fill_drain_recompute"] = rc_row
    g_durations = graph_rec.durations()
    res["graphs"] = {
        "fill_drain": _overlap_row(
            t["graphs_fill_drain"],
            critical_path_ms(fill_drain_runs(n), graph_rec.shapes, g_durations),
            m,
        ),
        "overlapped": _overlap_row(
            t["graphs_overlapped"], critical_path_ms(runs, graph_rec.shapes, g_durations), m
        ),
    }
    res["order_search"] = _search_json(b, search, serial_rec, t, m)
    if main:
        title = (
            f"overlapped step, H={cfg.hidden} F={cfg.ffn} T={cfg.tokens} L={cfg.num_layers} "
            f"N={n} ({m['overlapped']:.1f} ms median)"
        )
        spans = over_rec.spans()
        write_gantt_png(spans, out / "timeline.png", title=title)
        write_chrome_trace(spans, out / "timeline_trace.json", title=title)
        res["host"] = host_time(b)
        res["host_graphs"] = host_time(b, graphs=True)
        res["variants"] = _variants(b, t, m, bound)
        res["memory"] = _memory(b)
    return res


#: The environment variable of the exactness pass's failure test (see the module doc).
PERTURB_ENV = "MOE_OVERLAP_BENCH_PERTURB"
#: The cuBLAS workspace settings under which cuBLAS is deterministic (its documentation).
DETERMINISTIC_CUBLAS = (":4096:8", ":16:8")
#: Every variant the exactness pass may check (``serial`` is the reference).
CHECKED = (
    "overlapped",
    "fill_drain",
    "graphs_overlapped",
    "graphs_fill_drain",
    "compute_only",
    "fill_drain_recompute",
    "high_priority_comm",
    "delay_wgrad_compute",
    "overlapped_searched",
    "fill_drain_searched",
)
#: A step's losses and its gradients by parameter name.
Run = tuple[list[Tensor], dict[str, Tensor]]


def perturb_target(known: Sequence[str]) -> str | None:
    """The variant ``MOE_OVERLAP_BENCH_PERTURB`` names (``"1"``: the first one checked);
    ``None`` when it is unset, empty or ``0``."""
    value = os.environ.get(PERTURB_ENV, "")
    if value in ("", "0"):
        return None
    if value != "1" and value not in known:
        raise SystemExit(f"{PERTURB_ENV}={value!r}: expected 1 or one of {', '.join(known)}")
    return value


def add_ulp(t: Tensor) -> None:
    """One ulp more on ``t``'s first element, in place (its bits as an integer, plus one)."""
    ints = {
        torch.float64: torch.int64,
        torch.float32: torch.int32,
        torch.bfloat16: torch.int16,
        torch.float16: torch.int16,
    }
    t.detach()[(0,) * t.dim()].view(ints[t.dtype]).add_(1)


@contextmanager
def deterministic_kernels(device: torch.device, attention: str) -> Generator[str, None, None]:
    """The exactness pass's kernels; yields their description.

    ``torch.use_deterministic_algorithms(True)`` (not warn-only: an operation without a
    deterministic implementation raises instead of running) with a deterministic cuBLAS
    workspace; SDPA restricted to backends that are deterministic in that mode: flash and
    memory-efficient attention run their deterministic backward there, the math backend is
    plain matrix products and softmax; cuDNN attention (PyTorch's first choice on Hopper) has
    no deterministic backward and is left out. ``attention="math"``: the math backend only.
    """
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if device.type == "cuda" and config not in DETERMINISTIC_CUBLAS:
        raise SystemExit(
            f"exactness pass: CUBLAS_WORKSPACE_CONFIG={config!r} is not deterministic; "
            f"set one of {DETERMINISTIC_CUBLAS} before CUDA starts"
        )
    backends = (
        [SDPBackend.MATH]
        if attention == "math"
        else [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    )
    found = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(True)
    try:
        with sdpa_kernel(backends):
            yield (
                f"torch.use_deterministic_algorithms(True), CUBLAS_WORKSPACE_CONFIG={config}, "
                f"SDPA backends {[x.name for x in backends]}"
            )
    finally:
        torch.use_deterministic_algorithms(found[0], warn_only=found[1])


def snapshot(model: torch.nn.Module, losses: list[Tensor], *, copy: bool = True) -> Run:
    """A step's losses and every gradient by parameter name: copies (the model's next step
    overwrites them), or with ``copy=False`` the tensors themselves."""
    grads = {
        n: p.grad.detach().clone() if copy else p.grad.detach()
        for n, p in model.named_parameters()
        if p.grad is not None
    }
    return [x.detach().clone() if copy else x.detach() for x in losses], grads


def _abs_diff(got: Tensor, want: Tensor) -> tuple[float, list[str]]:
    """The largest finite absolute difference, and the sides holding a NaN or an inf."""
    bad = [
        side
        for side, t in (("variant", got), ("reference", want))
        if not bool(torch.isfinite(t).all())
    ]
    d = (got.double() - want.double()).abs()
    d = d[torch.isfinite(d)]
    return (float(d.max()) if d.numel() else 0.0), bad


def compare(got: Run, want: Run) -> JsonDict:
    """Is ``got`` bit-identical to ``want``: losses, then every gradient; what differs."""
    (got_losses, got_grads), (want_losses, want_grads) = got, want
    details: list[str] = []
    if len(got_losses) != len(want_losses):
        details.append(f"{len(got_losses)} losses against {len(want_losses)}")
    else:
        for i, (g, w) in enumerate(zip(got_losses, want_losses, strict=True)):
            if not torch.equal(g, w):
                details.append(f"loss {i}: {g.item()!r} against {w.item()!r}")
    losses_equal = not details
    details += [
        f"{n}: a gradient on one side only" for n in sorted(set(got_grads) ^ set(want_grads))
    ]
    differing: list[str] = []
    largest, not_finite = 0.0, False
    for name, want_grad in want_grads.items():
        got_grad = got_grads.get(name)
        if got_grad is None or torch.equal(got_grad, want_grad):
            continue
        differing.append(name)
        if got_grad.shape != want_grad.shape:
            details.append(
                f"{name}: shape {tuple(got_grad.shape)} against {tuple(want_grad.shape)}"
            )
            continue
        d, bad = _abs_diff(got_grad, want_grad)
        largest, not_finite = max(largest, d), not_finite or bool(bad)
        details.append(
            f"{name}: max abs diff {d:.3e}"
            + (f" (not finite in {' and '.join(bad)})" if bad else "")
        )
    return {
        "bit_identical": not details,
        "losses_equal": losses_equal,
        "tensors": len(want_grads),
        "tensors_differing": len(differing),
        "max_abs_diff": largest,
        "not_finite": not_finite,
        "differences": details[:20],
    }


def describe(variant: str, reference: str, cmp: JsonDict) -> str:
    """One line: what made ``variant`` differ from ``reference``."""
    head = (
        f"{variant} is not bit-identical to {reference}: "
        f"losses {'equal' if cmp['losses_equal'] else 'differ'}, "
        f"{cmp['tensors_differing']} of {cmp['tensors']} gradients differ, largest abs diff "
        f"{cast(float, cmp['max_abs_diff']):.3e}, "
        f"{'NaN/inf present' if cmp['not_finite'] else 'all finite'}"
    )
    return f"{head}; " + "; ".join(cast("list[str]", cmp["differences"])[:6])


def exactness(
    b: Bench, fns: dict[str, Callable[[], object]], *, attention: str, perturb: str | None
) -> JsonDict:
    """The row's exactness pass (see the module doc): every variant of ``fns`` that computes
    gradients against the first of two serial steps, from zero gradients, under
    :func:`deterministic_kernels`; the graphed variants on graphs captured under those
    kernels (the row's graphs are dropped first and these after). ``failed``: the variants
    not bit-identical (``serial (run to run)``: the second serial step)."""
    names = [k for k in fns if k not in ("serial", "comm_only")]
    graphed = any(k.startswith("graphs_") for k in names)

    def run(name: str) -> Run:
        b.model.zero_grad(set_to_none=False)
        out = fns[name]()
        _sync(b.device)
        return snapshot(b.model, cast("list[Tensor]", out) if isinstance(out, list) else [])

    rows: dict[str, JsonDict] = {}
    if graphed:
        b.model.drop_graphs()
    with deterministic_kernels(b.device, attention) as kernels:
        want = run("serial")
        rows["serial (run to run)"] = compare(run("serial"), want)
        if graphed:
            _capture_graphs(b)
        for name in names:
            got = run(name)
            if perturb == name or (perturb == "1" and name == names[0]):
                add_ulp(next(iter(got[1].values())))
            rows[name] = compare(got, want)
    b.model.zero_grad(set_to_none=False)
    if graphed:
        b.model.drop_graphs()
    return {
        "kernels": kernels,
        "attention": attention,
        "reference": "serial",
        "perturbed": perturb,
        "variants": rows,
        "failed": [k for k, r in rows.items() if not r["bit_identical"]],
    }


def _ordered(order: ScheduleOrder) -> ScheduleOptions:
    return ScheduleOptions(order=order)


def _search_order(b: Bench) -> OrderSearch:
    """The step order :func:`moe_overlap.steps.search_order` finds from a serial step's
    node durations (two warm-up steps first)."""
    for _ in range(2):
        step(b, overlap=False)
    rec = _recorded(b, overlap=False)
    shape = next(iter(rec.shapes.values()))
    return search_order(shape, slot_durations(rec.durations()))


def profile_rows(durations: dict[SlotKey, float]) -> list[JsonDict]:
    """Node durations as ``serial_slot_durations`` rows (``{"layer", "slot", "direction",
    "ms"}``, which :func:`moe_overlap.plan.load_profile` reads)."""
    return [
        {"layer": k[0], "slot": k[1].value, "direction": k[2].value, "ms": ms}
        for k, ms in sorted(durations.items(), key=lambda kv: str(kv[0]))
    ]


def serial_profile(b: Bench) -> list[JsonDict]:
    """One recorded serial step's node durations (warm the model first) as
    :func:`profile_rows`."""
    return profile_rows(slot_durations(_recorded(b, overlap=False).durations()))


def _search_json(
    b: Bench,
    search: OrderSearch,
    serial_rec: NodeRecorder,
    t: dict[str, list[float]],
    base: dict[str, float],
) -> JsonDict:
    """What the search found, its predicted steps, and the measured searched variants."""
    n = len(b.mbs)
    shape = next(iter(serial_rec.shapes.values()))
    durations = slot_durations(serial_rec.durations())
    out: JsonDict = {
        "order": str(search.order),
        "tried": {k.value: v for k, v in search.tried.items()},
        "run_ms_megatron": {k.value: v for k, v in search.megatron_ms.items()},
        "run_ms_found": {k.value: v for k, v in search.found_ms.items()},
        # The serial step's node durations: what moe_overlap.plan predicts the row from.
        "serial_slot_durations": profile_rows(durations),
    }
    for name, mode in (
        ("overlapped", ScheduleMode.OVERLAPPED),
        ("fill_drain", ScheduleMode.FILL_DRAIN),
    ):
        found_ms = predict_ms(shape, durations, n, mode, order=search.order)
        out[f"predicted_{name}_ms"] = {
            "megatron": predict_ms(shape, durations, n, mode),
            "found": found_ms,
        }
        key = f"{name}_searched"
        if key in t:
            out[key] = _overlap_row(t[key], found_ms, base)
    return out


def _overlap_row(samples: list[float], bound: float, base: dict[str, float]) -> JsonDict:
    """The figures of an overlapped variant against its row's serial, compute and comm."""
    med = median(samples)
    return {
        "overlapped_ms": med,
        "samples": samples,
        "spread": spread(samples),
        "bound_ms": bound,
        "efficiency": bound / med,
        "speedup": base["serial"] / med,
        "overlapped_over_max": med / max(base["compute_only"], base["comm_only"]),
    }


def _capture_graphs(b: Bench) -> int:
    """Capture every graph copy the graphed variants use, before anything is timed
    (capturing synchronizes and empties the allocator's cache); the number captured."""
    b.model.set_graphs(True)
    try:
        for _ in range(3):
            step(b, overlap=True, fill_drain=True)
    finally:
        b.model.set_graphs(False)
    return b.model.graph_captures()


def _variants(
    b: Bench, t: dict[str, list[float]], base: dict[str, float], bound: float
) -> JsonDict:
    """The overlapped step with a high-priority comm stream, and with delayed expert wgrad
    (timed with the rest of the row, in ``t``).

    Compute-only and comm-only are the base configuration's (the same work); the delayed
    wgrad bound comes from a serial step with delayed wgrad (its own step lists, with
    ``WGRAD`` steps).
    """
    delay = ScheduleOptions(delay_wgrad_compute=True)
    b.model.set_delay_wgrad(True)
    try:
        ser_rec = _recorded(b, overlap=False, options=delay)
        over_rec = _recorded(b, overlap=True, options=delay)
    finally:
        b.model.set_delay_wgrad(False)
    runs = overlapped_runs(len(b.mbs))
    dw_bound = critical_path_ms(runs, ser_rec.shapes, ser_rec.durations())
    dw_bound_c = critical_path_ms(runs, over_rec.shapes, over_rec.durations())
    dw = _overlap_row(t["delay_wgrad_compute"], dw_bound, base)
    dw["bound_contended_ms"] = dw_bound_c
    dw["efficiency_contended"] = dw_bound_c / median(t["delay_wgrad_compute"])
    return {
        "high_priority_comm": _overlap_row(t["high_priority_comm"], bound, base),
        "delay_wgrad_compute": dw,
    }


def _config_json(cfg: SliceConfig, dtype: torch.dtype) -> JsonDict:
    d: JsonDict = {
        k: (v.value if isinstance(v, LoopbackMode) else v)
        for k, v in dataclasses.asdict(cfg).items()
        if k not in ("cuda_graph_modules",)
    }
    d["capacity"] = cfg.capacity
    d["remote_fraction"] = cfg.remote_fraction
    d["a2a_MB_per_call"] = cfg.a2a_bytes(dtype) / 1e6
    d["dtype"] = str(dtype)
    return d


def _memory(b: Bench) -> JsonDict:
    """Peak memory of one step of each variant, free-input on and off.

    The graphed cases run last, after the eager ones, with the graphs captured afresh:
    their pools (the graphs' activations and static buffers) count in their peak only.
    """
    out: JsonDict = {}
    if b.device.type != "cuda":
        return {"note": "CUDA only"}
    cases = [
        (f"{kind}free_input_{free}", overlap, free, fd, graphs, rc)
        for kind, overlap, fd, graphs, rc in (
            ("", True, False, False, False),
            ("serial_", False, False, False, False),
            ("fill_drain_", True, True, False, False),
            ("fill_drain_recompute_", True, True, False, True),
            ("serial_recompute_", False, False, False, True),
            ("graphs_", True, False, True, False),
            ("fill_drain_graphs_", True, True, True, False),
        )
        for free in (True, False)
    ]
    b.model.drop_graphs()
    torch.cuda.empty_cache()
    for name, overlap, free, fd, graphs, rc in cases:
        opts = ScheduleOptions(free_input=free)
        b.model.set_graphs(graphs)
        b.model.set_recompute(rc)
        step(b, overlap=overlap, options=opts, fill_drain=fd)  # warm the allocator
        b.model.zero_grad(set_to_none=False)
        _sync(b.device)
        torch.cuda.reset_peak_memory_stats(b.device)
        base = torch.cuda.memory_allocated(b.device)
        step(b, overlap=overlap, options=opts, fill_drain=fd)
        _sync(b.device)
        peak = torch.cuda.max_memory_allocated(b.device)
        out[name] = {"peak_GB": peak / 1e9, "above_start_GB": (peak - base) / 1e9}
        b.model.set_recompute(False)
        b.model.set_graphs(False)
        if graphs:
            b.model.drop_graphs()
            torch.cuda.empty_cache()
    return out


def host_time(b: Bench, *, graphs: bool = False, router: bool = False) -> JsonDict:
    """Host seconds of issuing each chunk run of overlapped steps (no sync inside a run),
    with the attention (and with ``router`` the router) CUDA-graphed when ``graphs``."""
    original = ModelChunkSchedulePlan.__dict__["run"]
    run_fn: Callable[..., torch.Tensor | None] = original.__func__
    records: list[tuple[bool, bool, float]] = []
    spans: list[tuple[torch.cuda.Event | float, torch.cuda.Event | float]] = []
    clock = Clock(b.device)

    def timed(*args: object, **kwargs: object) -> torch.Tensor | None:
        ev0 = clock.mark()
        t0 = time.perf_counter()
        result = run_fn(*args, **kwargs)
        dt = time.perf_counter() - t0
        ev1 = clock.mark()
        records.append((args[0] is not None, args[1] is not None, dt))
        spans.append((ev0, ev1))
        return result

    b.model.set_graphs(graphs, router=router)
    for _ in range(3):  # captures the graphs when asked, then warms the allocator
        step(b, overlap=True)
    setattr(ModelChunkSchedulePlan, "run", staticmethod(timed))  # noqa: B010 - restored below
    try:
        samples: list[dict[str, float]] = []
        for _ in range(max(1, b.iters)):
            records.clear()
            spans.clear()
            b.model.zero_grad(set_to_none=False)
            _sync(b.device)
            step(b, overlap=True)
            _sync(b.device)
            gpu = [Clock.ms(s, e) for s, e in spans]
            samples.append(_host_sample(records, gpu, b.model.config.num_layers))
    finally:
        setattr(ModelChunkSchedulePlan, "run", original)  # noqa: B010
        b.model.set_graphs(False)
    out: JsonDict = {k: median([s[k] for s in samples]) for k in samples[0]}
    out["spread"] = {k: spread([s[k] for s in samples]) for k in samples[0]}
    out["samples"] = samples
    return out


def _host_sample(
    records: list[tuple[bool, bool, float]], gpu_ms: list[float], layers: int
) -> dict[str, float]:
    paired = [(r[2], g) for r, g in zip(records, gpu_ms, strict=True) if r[0] and r[1]]
    first = records[0][2]
    return {
        "first_run_host_ms_per_layer": first * 1e3 / layers,
        "paired_host_ms_per_layer_pair": median([h for h, _ in paired]) * 1e3 / layers,
        "paired_gpu_ms_per_layer_pair": median([g for _, g in paired]) / layers,
    }


def ffn_sweep(args: argparse.Namespace) -> list[SliceConfig]:
    """The main configuration first, then the expert FFN sizes (the comm:compute sweep)."""
    if args.tiny:
        base = SliceConfig(hidden=64, ffn=32, tokens=64, head_dim=16, num_layers=2)
        return [base, dataclasses.replace(base, ffn=128)]
    base = SliceConfig(hidden=args.hidden, ffn=args.ffn, tokens=args.tokens)
    return [base, *(dataclasses.replace(base, ffn=f) for f in args.sweep_ffn if f != base.ffn)]


def shape_sweep(args: argparse.Namespace) -> list[SliceConfig]:
    """Token and hidden sizes around the main configuration."""
    if args.tiny:
        return []
    base = SliceConfig(hidden=args.hidden, ffn=args.ffn, tokens=args.tokens)
    out = [dataclasses.replace(base, tokens=t) for t in args.sweep_tokens if t != base.tokens]
    out += [dataclasses.replace(base, hidden=h) for h in args.sweep_hidden if h != base.hidden]
    return out


def closest_to_balance(results: list[JsonDict]) -> SliceConfig | None:
    """The configuration whose comm:compute ratio is nearest 1 (on a log scale)."""
    best: tuple[float, SliceConfig] | None = None
    for r in results:
        ratio = float(str(r["comm_to_compute"]))
        dist = abs(math.log(ratio)) if ratio > 0 else math.inf
        cfg = r["slice_config"]
        assert isinstance(cfg, SliceConfig)
        if best is None or dist < best[0]:
            best = (dist, cfg)
    return None if best is None else best[1]


def _table(results: list[JsonDict]) -> str:
    """One line per row and one per overlapped variant; ``sprd%``: the largest spread
    ((max - min) / min of the timed steps) of the line's step times."""
    head = (
        f"{'H':>5} {'F':>5} {'T':>5} {'N':>2} {'variant':>8} {'serial':>8} {'overlap':>8} "
        f"{'comp':>8} {'comm':>8} {'bound':>8} {'eff':>5} {'effC':>5} {'c:c':>5} {'spdup':>5} "
        f"{'ov/max':>6} {'sprd%':>5}"
    )
    lines = [head]
    labels = {
        "fill_drain": "filldr",
        "fill_drain_recompute": "fd-rcmp",
        "graphs_overlapped": "gr-ov",
        "graphs_fill_drain": "gr-fd",
        "high_priority_comm": "hi-prio",
        "delay_wgrad_compute": "dwgrad",
        "overlapped_searched": "ov-srch",
        "fill_drain_searched": "fd-srch",
    }
    for r in results:
        c = r["config"]
        m = r["step_ms"]
        sp = cast("dict[str, float]", r.get("step_ms_spread", {}))
        assert isinstance(c, dict)
        assert isinstance(m, dict)
        key = f"{c['hidden']:>5} {c['ffn']:>5} {c['tokens']:>5} {r['microbatches']:>2}"
        sprd = f"{100 * max(sp.values()):5.1f}" if sp else f"{'-':>5}"
        lines.append(
            f"{key} {'-':>8} {m['serial']:8.1f} "
            f"{m['overlapped']:8.1f} {m['compute_only']:8.1f} {m['comm_only']:8.1f} "
            f"{r['bound_ms']:8.1f} {r['efficiency']:5.2f} {r['efficiency_contended']:5.2f} "
            f"{r['comm_to_compute']:5.2f} {r['speedup']:5.2f} {r['overlapped_over_max']:6.2f} "
            f"{sprd}"
        )
        graphs = cast("dict[str, dict[str, object]]", r.get("graphs", {}))
        fill = cast("dict[str, object] | None", r.get("fill_drain"))
        fill_rc = cast("dict[str, object] | None", r.get("fill_drain_recompute"))
        searched = cast("dict[str, object]", r.get("order_search", {}))
        variants = {
            **({"fill_drain": fill} if fill is not None else {}),
            **({"fill_drain_recompute": fill_rc} if fill_rc is not None else {}),
            **{
                k: cast("dict[str, object]", v)
                for k, v in searched.items()
                if k.endswith("_searched")
            },
            **{f"graphs_{k}": v for k, v in graphs.items()},
            **cast("dict[str, dict[str, object]]", r.get("variants", {})),
        }
        for name, v in variants.items():
            label = labels[name]
            eff_c = v.get("efficiency_contended")
            eff_c_s = f"{eff_c:5.2f}" if isinstance(eff_c, float) else f"{'-':>5}"
            v_sp = v.get("spread")
            v_sp_s = f"{100 * v_sp:5.1f}" if isinstance(v_sp, float) else f"{'-':>5}"
            ov, bnd, eff = v["overlapped_ms"], v["bound_ms"], v["efficiency"]
            spd, ovm = v["speedup"], v["overlapped_over_max"]
            for x in (ov, bnd, eff, spd, ovm):
                assert isinstance(x, float)
            lines.append(
                f"{key} {label:>8} {'':>8} {ov:8.1f} {'':>8} {'':>8} "
                f"{bnd:8.1f} {eff:5.2f} {eff_c_s} {'':>5} {spd:5.2f} {ovm:6.2f} {v_sp_s}"
            )
    return "\n".join(lines)


def write_sweep_png(results: list[JsonDict], path: Path, *, where: str) -> None:
    """Speed-up and efficiency against the comm:compute ratio, at 4 microbatches, titled
    with ``where`` they were measured (device, torch)."""
    plt = pyplot()
    pts = sorted(
        (float(str(r["comm_to_compute"])), float(str(r["speedup"])), float(str(r["efficiency"])))
        for r in results
        if r["microbatches"] == 4
    )
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label="speed-up serial/overlapped")
    ax.plot([p[0] for p in pts], [p[2] for p in pts], "s--", label="efficiency bound/overlapped")
    ax.axvline(1.0, color="grey", lw=0.5)
    ax.set_xscale("log")
    ax.set_xlabel("comm-only step time / compute-only step time (ratio, log scale)")
    ax.set_ylabel("ratio (x)")
    ax.set_title(
        f"bench_overlap.py sweep, {len(pts)} configurations at 4 microbatches\n{where}",
        fontsize=9,
    )
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


#: The method's floor for a figure that is reported: warm-up rounds and timed rounds per row
#: (``readme_table.py`` refuses results below it). The first row of a process warms more.
MIN_WARMUP, MIN_ITERS, FIRST_WARMUP = 2, 5, 4


def predict_row_s(results: list[JsonDict], microbatches: int, base_microbatches: int) -> float:
    """Seconds a row of ``microbatches`` should take: the median wall time of the rows so
    far other than the first (which also draws the timeline, memory and host time), scaled
    by the microbatch count; 0 before any such row."""
    walls = [
        float(str(r["wall_s"])) * base_microbatches / float(str(r["microbatches"]))
        for r in results[1:]
    ]
    return median(walls) * microbatches / base_microbatches if walls else 0.0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--tiny",
        action="store_true",
        help="tiny sizes, the host-bound row too (CPU smoke run)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="default: benchmarks/results (a --tiny run: a temporary folder, so that a smoke "
        "run never overwrites the device results the README is generated from)",
    )
    p.add_argument("--microbatches", type=int, default=4, help="per step, for the sweep")
    p.add_argument(
        "--more-microbatches",
        type=int,
        nargs="*",
        default=[8],
        help="also run these counts at the main and the comm~compute configuration",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help=f"untimed rounds of every variant per row (default {MIN_WARMUP}; --tiny: 1)",
    )
    p.add_argument(
        "--first-warmup",
        type=int,
        default=None,
        help=f"the same for the process's first row (default {FIRST_WARMUP}; --tiny: 1)",
    )
    p.add_argument(
        "--iters",
        type=int,
        default=None,
        help=f"timed rounds per row, variants interleaved (default {MIN_ITERS}; --tiny: 2)",
    )
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--sweep-ffn", type=int, nargs="*", default=[512, 256, 1024, 4096, 8192])
    p.add_argument("--sweep-tokens", type=int, nargs="*", default=[2048])
    p.add_argument("--sweep-hidden", type=int, nargs="*", default=[2048, 7168])
    p.add_argument(
        "--budget-s",
        type=float,
        default=math.inf,
        help="skip a configuration when the seconds used so far plus its predicted time "
        "(from the rows already run) would pass this",
    )
    p.add_argument(
        "--exact-attention",
        choices=("sdpa", "math"),
        default="sdpa",
        help="attention kernels of the exactness pass: sdpa = SDPA's deterministic backends "
        "(flash / memory-efficient with their deterministic backward, never cuDNN); math = "
        "SDPA's math backend only (more memory: the S x S scores)",
    )
    p.add_argument(
        "--continue-after-inexact",
        action="store_true",
        help="a row whose exactness pass fails is still timed, and the sweep goes on; the "
        "process still exits 1 at the end",
    )
    args = p.parse_args(argv)
    args.perturb = perturb_target(CHECKED)
    if args.warmup is None:
        args.warmup = 1 if args.tiny else MIN_WARMUP
    if args.first_warmup is None:
        args.first_warmup = max(args.warmup, 1 if args.tiny else FIRST_WARMUP)
    if args.iters is None:
        args.iters = 2 if args.tiny else MIN_ITERS
    if args.out is None:
        args.out = Path("/tmp/bench_overlap_tiny") if args.tiny else Path("benchmarks/results")
    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    env: JsonDict = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "argv": sys.argv,
        "warmup": args.warmup,
        "first_warmup": args.first_warmup,
        "iters": args.iters,
        "exact_attention": args.exact_attention,
        "method": (
            "per row: warm-up rounds then timed rounds, each round runs every variant once "
            "(order rotated by one per round), each step synchronized and timed alone; "
            "figure = median, spread = (max - min) / min"
        ),
    }
    print(json.dumps(env), flush=True)
    results: list[JsonDict] = []
    skipped: list[str] = []
    inexact: list[str] = []
    env["exactness_failed"] = inexact

    def run(cfg: SliceConfig, n: int, *, main: bool = False) -> None:
        label = f"H={cfg.hidden} F={cfg.ffn} T={cfg.tokens} N={n}"
        used = time.perf_counter() - t_start
        predicted = predict_row_s(results, n, args.microbatches)
        if used + predicted > args.budget_s:
            skipped.append(label)
            print(
                f"skipped (time budget): {label}: {used:.0f} s used + {predicted:.0f} s "
                f"predicted > --budget-s {args.budget_s:.0f}",
                flush=True,
            )
            return
        t0 = time.perf_counter()
        try:
            r = measure(cfg, args, microbatches=n, main=main, first=not results, out=args.out)
        except torch.OutOfMemoryError as exc:  # keep the rest of the sweep
            print(f"OOM for {label}: {exc}", flush=True)
            return
        r["wall_s"] = time.perf_counter() - t0
        r["predicted_s"] = predicted
        print(json.dumps(r), flush=True)
        exact = cast(JsonDict, r["exactness"])
        failed = cast("list[str]", exact["failed"])
        variants = cast("dict[str, JsonDict]", exact["variants"])
        if failed:
            inexact.extend(f"{label}: {name}" for name in failed)
            for name in failed:
                print(
                    f"bench_overlap: EXACTNESS FAILED at {label} ({exact['kernels']}): "
                    + describe(name, "serial", variants[name]),
                    file=sys.stderr,
                    flush=True,
                )
        else:
            print(
                f"{label}: exact, {len(variants)} of {len(variants)} comparisons with serial "
                f"bit-identical ({exact['kernels']})",
                flush=True,
            )
        if "stopped" in r:
            r["slice_config"] = cfg
            results.append(r)
            _save(args.out, env, results, skipped)
            raise SystemExit(
                f"bench_overlap: stopped at {label}: {', '.join(failed)} not bit-identical "
                f"to serial under deterministic kernels; results in {args.out / 'results.json'}"
            )
        print(
            f"{label}: {r['wall_s']:.1f} s (predicted {predicted:.1f}); spread of "
            + ", ".join(
                f"{k} {100 * v:.1f}%"
                for k, v in cast("dict[str, float]", r["step_ms_spread"]).items()
            ),
            flush=True,
        )
        r["slice_config"] = cfg
        results.append(r)
        if args.device == "cuda":
            torch.cuda.empty_cache()
        _save(args.out, env, results, skipped)

    ffn_cfgs = ffn_sweep(args)
    for i, cfg in enumerate(ffn_cfgs):
        run(cfg, args.microbatches, main=i == 0)
    balanced = closest_to_balance(results)
    env["balanced_config"] = None if balanced is None else dataclasses.asdict(balanced)
    for n in args.more_microbatches:
        twice = [ffn_cfgs[0]] if balanced in (None, ffn_cfgs[0]) else [ffn_cfgs[0], balanced]
        for cfg in twice:
            assert cfg is not None
            run(cfg, n)
    for cfg in shape_sweep(args):
        run(cfg, args.microbatches)
    host_small = _host_small(args)
    print(json.dumps({"host_small": host_small}), flush=True)
    env["wall_s"] = time.perf_counter() - t_start
    _save(args.out, env, results, skipped, host_small)
    write_sweep_png(results, args.out / "sweep.png", where=f"{env['device']}, torch {env['torch']}")
    print(_table(results), flush=True)
    if balanced is not None:
        print(
            f"comm~compute configuration: H={balanced.hidden} F={balanced.ffn} T={balanced.tokens}",
            flush=True,
        )
    print(f"skipped: {skipped}; wall {env['wall_s']:.1f} s", flush=True)
    if inexact:
        raise SystemExit(
            f"bench_overlap: not bit-identical to serial under deterministic kernels: "
            f"{'; '.join(inexact)} (timed anyway: --continue-after-inexact)"
        )


def _host_small(args: argparse.Namespace) -> JsonDict:
    """Host cost where the GPU never holds the host back: sizes so small that issuing is
    slower than running; step times of the overlapped and fill/drain steps, eager and
    graphed, interleaved (``--tiny``: at the tiny sweep's first size)."""
    if args.tiny:
        small = ffn_sweep(args)[0]
    else:
        small = SliceConfig(hidden=256, ffn=128, tokens=256, head_dim=64)
    sb = make_bench(small, args, args.microbatches)
    out: JsonDict = {"config": _config_json(small, sb.model.embed_scale.dtype)}
    out.update(host_time(sb))
    out["graphs"] = host_time(sb, graphs=True)
    _capture_graphs(sb)
    fns = row_variants(sb, main=False)
    names = ("overlapped", "fill_drain", "graphs_overlapped", "graphs_fill_drain")
    t = time_interleaved(sb, {k: fns[k] for k in names})
    for k in names:
        out[f"{k}_ms"] = median(t[k])
        out[f"{k}_samples"] = t[k]
        out[f"{k}_spread"] = spread(t[k])
    return out


def _save(
    out: Path,
    env: JsonDict,
    results: list[JsonDict],
    skipped: list[str],
    host_small: JsonDict | None = None,
) -> None:
    rows = [{k: v for k, v in r.items() if k != "slice_config"} for r in results]
    doc: JsonDict = {"env": env, "results": rows, "skipped": skipped}
    if host_small is not None:
        doc["host_small"] = host_small
    (out / "results.json").write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
