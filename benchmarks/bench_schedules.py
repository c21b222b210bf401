"""The planner's searched schedules run side by side with today's, on one GPU, in one run.

For each configuration of the committed frontier (``benchmarks/results/frontier/frontier.json``,
made by ``benchmarks/frontier.py`` from the round-9 serial profiles), the benchmark's MoE
slice at those sizes (hidden 4096, 4096 tokens per microbatch, 4 MoE layers, the host
loopback all-to-all, bf16; the configuration's expert FFN width and microbatch count) runs,
interleaved round by round:

- ``serial``, ``overlapped`` (combined 1F1B), ``fill_drain`` and ``fill_drain_recompute``
  (the model's own recomputation), as ``bench_overlap.py`` runs them;
- ``searched``: the configuration's best order as the planner found it, through
  ``combined_1f1b(schedule=NodeSchedule.parse(best_order))`` with its delayed weight
  gradients and its recomputed slots (``ScheduleOptions.recompute``);
- ``compute_only`` / ``comm_only``, for max(compute, comm).

First every variant's losses and gradients are compared with the serial step's, bit for
bit, under deterministic kernels (``bench_overlap``'s exactness pass, whose
``MOE_OVERLAP_BENCH_PERTURB`` makes it see one ulp in a named variant); then the timed
rounds; then one recorded serial step's node durations (``serial_slot_durations``, as
``bench_overlap.py`` records them); then each variant's peak memory over the serial step's.
Each row shows two predictions of the planner and their errors: from the committed H200
profile (the frontier's), and from this run's serial step ("predicted here": the profile of
the device it runs on, with the frontier's ``comm_contention``), each replayed as the
frontier replays it (today's schedules from the engine's step lists, the searched one from
its order). Under the table, the same from this run's profile with the contention fitted on
this run's overlapped step (:func:`fit_here`): one figure of the machine fitted on one row,
the other rows its check.

Then, at the host-bound size (hidden 256, 256 tokens per microbatch, expert FFN 128), whether
the host keeps ahead of the GPU in each variant: the host's milliseconds of issuing one step
(the call's wall time; at this size the GPU never holds the host back) and the GPU's
milliseconds of running it back to back (queued behind a device-side sleep, so it never waits
for the host), both per layer pair (layers x microbatches pairs of one forward and one
backward per step). Each variant also runs as its graphed twin (``graphs_<variant>``: each
layer's attention as CUDA graphs, the router too with ``MOE_OVERLAP_BENCH_GRAPH_ROUTER=1``,
every copy captured before the timed steps,
checked; ``graphs_fill_drain_recompute`` is not run, the model's own recomputation refusing
graphs, and a twin the library refuses is left out with its reason), beside three plain
references (:func:`plain_step`: the model without the schedule; ``plain_recompute`` with the
model's recomputation; ``graphs_plain`` graphed), from which each schedule's share of host
time: its host time less the plain step's doing the same work, over its own (none for
``searched``, whose schedule recomputes slots itself). Every step of this pass is first
compared with the eager serial step, bit for bit, under the same deterministic kernels as the
main table's. On the CPU the graphed twins run eagerly (plumbing only). Writes
``schedules.json`` and ``schedules.md`` to ``--out``::

    python benchmarks/bench_schedules.py --out benchmarks/results/schedules     # a GPU
    python benchmarks/bench_schedules.py --tiny --device cpu --iters 1 --out /tmp/s  # smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NamedTuple, cast

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_overlap import (  # the sibling benchmark's steps and passes
    Bench,
    JsonDict,
    comm_only_step,
    describe,
    exactness,
    make_bench,
    median,
    perturb_target,
    serial_profile,
    step,
    switched,
    time_interleaved,
)
from moe_slice import LoopbackMode, MoESliceLayer, MoESliceModel, SliceConfig
from node_timing import Clock, NodeRecorder

from moe_overlap import (
    ChunkState,
    ConfigError,
    MoeOverlapError,
    ScheduleOptions,
    StreamPair,
    combined_1f1b,
)
from moe_overlap.blocks import PlainContext, discard_wgrad
from moe_overlap.plan import (
    ActivationModel,
    ContentionKind,
    Layout,
    Recompute,
    ScheduleGraph,
    SearchSpace,
    SearchStep,
    StepTimes,
    costs_from_profile,
    fit_contention,
    load_profile,
    replay_order,
    today_orders,
)
from moe_overlap.steps import Direction, NodeSchedule, Slot, Step, StreamKind

FRONTIER = Path(__file__).resolve().parent / "results" / "frontier" / "frontier.json"
TODAY = ("serial", "overlapped", "fill_drain", "fill_drain_recompute")


def searched(
    b: Bench,
    schedule: NodeSchedule,
    *,
    on_plan: NodeRecorder | None = None,
    streams: StreamPair | None = None,
) -> Callable[[], object]:
    """One step of ``schedule`` with the options its steps need (``W``: delayed weight
    gradients; ``R``: those slots recomputed), on ``streams`` (default ``b.pair``), each
    plan handed to ``on_plan``."""
    steps = schedule.steps
    delay = any(s.direction is Direction.WGRAD for s in steps)
    slots = tuple(
        sorted(
            {cast(Slot, s.slot) for s in steps if s.direction is Direction.RECOMPUTE},
            key=list(Slot).index,
        )
    )
    options = ScheduleOptions(delay_wgrad_compute=delay, recompute=slots)
    model = b.model
    pair = b.pair if streams is None else streams

    def run() -> object:
        return combined_1f1b(
            model, b.mbs, streams=pair, options=options, schedule=schedule, on_plan=on_plan
        )

    return switched(lambda: model.set_delay_wgrad(delay), lambda: model.set_delay_wgrad(False), run)


def variants(b: Bench, schedule: NodeSchedule) -> dict[str, Callable[[], object]]:
    model = b.model
    return {
        "serial": lambda: step(b, overlap=False),
        "overlapped": lambda: step(b, overlap=True),
        "fill_drain": lambda: step(b, overlap=True, fill_drain=True),
        "fill_drain_recompute": switched(
            lambda: model.set_recompute(True),
            lambda: model.set_recompute(False),
            lambda: step(b, overlap=True, fill_drain=True),
        ),
        "searched": searched(b, schedule),
        "compute_only": switched(
            lambda: model.set_loopback(LoopbackMode.DEVICE),
            lambda: model.set_loopback(LoopbackMode.HOST),
            lambda: step(b, overlap=False),
        ),
        "comm_only": lambda: comm_only_step(b),
    }


def _search_step(step: Step) -> SearchStep:
    """A node step of a :class:`NodeSchedule` as the planner's step (``R``: a recomputed
    forward)."""
    again = step.direction is Direction.RECOMPUTE
    return SearchStep(
        microbatch=cast(int, step.microbatch),
        layer=step.layer,
        slot=cast(Slot, step.slot),
        direction=Direction.FORWARD if again else step.direction,
        stream=cast(StreamKind, step.stream),
        recompute=again,
    )


class Replay(NamedTuple):
    """One variant's order as the planner replays it: the graph, the order (``None``: a
    join), the step milliseconds and each step's ``(step, start ms, end ms)``."""

    graph: ScheduleGraph
    order: list[SearchStep | None]
    step_ms: float
    spans: tuple[tuple[SearchStep, float, float], ...]


def predict(
    profile: list[JsonDict],
    config: JsonDict,
    *,
    num_layers: int,
    contention: float,
    contention_by_kind: Mapping[ContentionKind, float] | None = None,
    compute_contention_by_kind: Mapping[ContentionKind, float] | None = None,
) -> dict[str, float]:
    """Each variant's step milliseconds as ``frontier.py`` predicts them, from the serial
    node durations ``profile`` (``serial_slot_durations`` rows) with ``contention``:
    today's from the engine's step lists (:func:`~moe_overlap.plan.today_orders`; with
    recompute, pre-dispatch and mlp of every layer), the searched one from
    ``config``'s ``best_order`` on the graph its steps and name say (delayed weight
    gradients, recomputed slots, recompute started early), each replayed
    (:func:`~moe_overlap.plan.replay_order`) with the shares, recompute cost and event
    model the frontier was searched with (``config["space"]``; the planner's defaults
    where the frontier names none); with ``contention_by_kind`` or
    ``compute_contention_by_kind`` (a frontier searched with them), that model in place of
    ``contention``."""
    per_kind = contention_by_kind is not None or compute_contention_by_kind is not None
    replays = replayed(
        profile,
        config,
        num_layers=num_layers,
        contention=0.0 if per_kind else contention,
        contention_by_kind=contention_by_kind,
        compute_contention_by_kind=compute_contention_by_kind,
    )
    return {k: r.step_ms for k, r in replays.items()}


def by_kind_of(
    frontier: JsonDict, key: str = "contention_by_kind"
) -> dict[ContentionKind, float] | None:
    """The frontier's contention per kind (``frontier.py --contention-by-kind``; with
    ``key="compute_contention_by_kind"``, ``--compute-contention-by-kind``'s), if any."""
    given = cast("dict[str, float] | None", frontier.get(key))
    if not given:
        return None
    out: dict[ContentionKind, float] = {}
    for name, c in given.items():
        slot, _, direction = name.partition(".")
        out[(Slot(slot), Direction(direction))] = float(c)
    return out


def replayed(
    profile: list[JsonDict],
    config: JsonDict,
    *,
    num_layers: int,
    contention: float,
    one_event: bool = False,
    contention_by_kind: Mapping[ContentionKind, float] | None = None,
    compute_contention_by_kind: Mapping[ContentionKind, float] | None = None,
) -> dict[str, Replay]:
    """:func:`predict`'s replays, whole; with ``one_event`` (or a frontier searched with
    it), each on its graph with :attr:`~moe_overlap.plan.ScheduleGraph.one_event` (the
    engine's one event per microbatch); with ``contention_by_kind`` (``contention`` then
    0), each communication step slowed by the compute beside it, per kind
    (:attr:`~moe_overlap.plan.StepTimes.contention_by_kind`), and with
    ``compute_contention_by_kind`` each compute step by the communication beside it
    (:attr:`~moe_overlap.plan.StepTimes.compute_contention_by_kind`)."""
    space = space_of(config)
    one_event = one_event or space.one_event
    costs = costs_from_profile(
        load_profile(profile), num_layers=num_layers, comm_contention=contention
    )
    n = cast(int, config["microbatches"])
    steps = [_search_step(s) for s in NodeSchedule.parse(cast(str, config["best_order"])).steps]
    base = ScheduleGraph(microbatches=n, moe=costs.moe, one_event=one_event)
    every = Recompute((Slot.PRE_DISPATCH, Slot.MLP)).triples(n, num_layers)
    recomputed = base.replace(recompute=every)
    name = cast(str, cast(JsonDict, config["targets"])["best"])
    best = base.replace(
        delay_wgrad=any(s.direction is Direction.WGRAD for s in steps),
        recompute=frozenset((s.microbatch, s.layer, s.slot) for s in steps if s.recompute),
        early_recompute=re.search(r"\brecompute=\S+ early\b", name) is not None,
    )
    orders = {k: (base, today_orders(base)[k]) for k in ("serial", "overlapped", "fill_drain")}
    orders["fill_drain_recompute"] = (recomputed, today_orders(recomputed)["fill_drain"])
    orders["searched"] = (best, steps)
    memory = ActivationModel(units={})  # only the step time is read
    out: dict[str, Replay] = {}
    for k, (graph, order) in orders.items():
        times = StepTimes(
            times=costs.times,
            wgrad_share=dict(space.wgrad_share),
            recompute_cost=space.recompute_cost,
            comm_contention=costs.comm_contention,
            delay_wgrad=graph.delay_wgrad,
            contention_by_kind=contention_by_kind,
            compute_contention_by_kind=compute_contention_by_kind,
        )
        r = replay_order(order, graph, times, memory)
        out[k] = Replay(graph, list(order), r.step_ms, r.spans)
    return out


def space_of(config: JsonDict) -> SearchSpace:
    """The search space's shares, recompute cost and event model the frontier of
    ``config`` was searched with (its ``space``, which ``main`` copies from the
    frontier's top level; the planner's defaults for what it does not name)."""
    given = cast(JsonDict, config.get("space", {}))
    default = SearchSpace()
    shares = cast("dict[str, float] | None", given.get("wgrad_share"))
    return dataclasses.replace(
        default,
        wgrad_share=default.wgrad_share
        if shares is None
        else tuple((Slot(k), float(v)) for k, v in shares.items()),
        recompute_cost=float(cast(float, given.get("recompute_cost", default.recompute_cost))),
        one_event=bool(given.get("one_event", False)),
    )


def peak_gb(b: Bench, fn: Callable[[], object]) -> float | None:
    """Peak allocated memory of one step of ``fn`` (after one warm step); CUDA only."""
    if b.device.type != "cuda":
        return None
    fn()
    b.model.zero_grad(set_to_none=False)
    torch.cuda.synchronize(b.device)
    torch.cuda.reset_peak_memory_stats(b.device)
    fn()
    torch.cuda.synchronize(b.device)
    return torch.cuda.max_memory_allocated(b.device) / 1e9


def fit_here(
    profile: list[JsonDict], config: JsonDict, *, num_layers: int, overlapped_ms: float
) -> float | None:
    """The ``comm_contention`` at which the planner predicts ``overlapped_ms`` for the
    overlapped step (:func:`moe_overlap.plan.fit_contention`, as ``frontier.py`` fits it):
    this machine's figure, fitted on one row and checked on the others. ``None`` when the
    profile does not explain the measured step (outside what contentions 0 to 2 predict)."""
    costs = costs_from_profile(load_profile(profile), num_layers=num_layers)
    layout = Layout(microbatches=cast(int, config["microbatches"]))
    try:
        return fit_contention(costs, layout, "combined_1f1b", overlapped_ms)
    except ConfigError:
        return None


def measure(
    config: JsonDict,
    args: argparse.Namespace,
    contention: float,
    contention_by_kind: Mapping[ContentionKind, float] | None = None,
    compute_contention_by_kind: Mapping[ContentionKind, float] | None = None,
) -> JsonDict:
    """Every figure of one frontier configuration (``contention`` and the coefficients per
    kind: the frontier's)."""
    n = cast(int, config["microbatches"])
    ffn = cast(int, config["ffn"])
    cfg = SliceConfig(ffn=ffn) if not args.tiny else SliceConfig(hidden=256, ffn=128, tokens=256)
    b = make_bench(cfg, args, n)
    schedule = NodeSchedule.parse(cast(str, config["best_order"]))
    fns = variants(b, schedule)
    perturb = perturb_target([k for k in (*fns, *HOST_ROWS) if k not in ("serial", "comm_only")])
    exact = exactness(b, fns, attention=args.exact_attention, perturb=perturb)
    times = time_interleaved(b, fns)
    ms = {k: median(v) for k, v in times.items()}
    profile = serial_profile(b)
    here = predict(
        profile,
        config,
        num_layers=cfg.num_layers,
        contention=contention,
        contention_by_kind=contention_by_kind,
        compute_contention_by_kind=compute_contention_by_kind,
    )
    fitted = fit_here(profile, config, num_layers=cfg.num_layers, overlapped_ms=ms["overlapped"])
    refit = (
        None
        if fitted is None
        else predict(profile, config, num_layers=cfg.num_layers, contention=fitted)
    )
    peaks = {k: peak_gb(b, fns[k]) for k in (*TODAY, "searched")}
    today = cast("dict[str, JsonDict]", config["today"])
    targets = cast(JsonDict, config["targets"])
    predicted = {k: cast(float, today[k]["step_ms"]) for k in TODAY}
    predicted["searched"] = cast(float, targets["best_ms"])
    serial_gb = peaks["serial"]
    top = max(ms["compute_only"], ms["comm_only"])
    rows: dict[str, JsonDict] = {}
    for k in (*TODAY, "searched"):
        memory = (
            None if serial_gb is None or peaks[k] is None else cast(float, peaks[k]) / serial_gb
        )
        rows[k] = {
            "step_ms": ms[k],
            "samples_ms": times[k],
            "over_max_compute_comm": ms[k] / top,
            "speedup": ms["serial"] / ms[k],
            "peak_GB": peaks[k],
            "memory_x_serial": memory,
            "predicted_ms": predicted[k],
            "prediction_error": predicted[k] / ms[k] - 1.0,
            "predicted_here_ms": here[k],
            "prediction_here_error": here[k] / ms[k] - 1.0,
            "predicted_fitted_ms": None if refit is None else refit[k],
            "prediction_fitted_error": None if refit is None else refit[k] / ms[k] - 1.0,
        }
    return {
        "name": config["name"],
        "microbatches": n,
        "ffn": ffn,
        "searched": targets["best"],
        "compute_only_ms": ms["compute_only"],
        "comm_only_ms": ms["comm_only"],
        "exactness_failed": exact["failed"],
        "rows": rows,
        # This run's serial step: what "predicted here" comes from (load_profile reads it).
        "serial_slot_durations": profile,
        # The contention fitted on this run's overlapped step ("predicted_fitted_ms").
        "contention_fitted_here": fitted,
    }


# torch's device-side busy wait (``torch.cuda._sleep``, unannotated), typed once here.
_cuda_sleep = cast("Callable[[int], None]", getattr(torch.cuda, "_sleep", None))

HOST_BOUND = SliceConfig(hidden=256, ffn=128, tokens=256, head_dim=64)
"""The host-bound size (``bench_overlap.py``'s): issuing a step is slower than running it."""


def host_and_gpu_ms(b: Bench, fn: Callable[[], object]) -> tuple[float, float | None]:
    """One step's host milliseconds of issuing it and, on CUDA, the GPU's milliseconds of
    running it with all of it queued first (behind a sleep longer than the issuing)."""
    cuda = b.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(b.device)
    t0 = time.perf_counter()
    fn()
    host = (time.perf_counter() - t0) * 1e3
    if not cuda:
        return host, None
    torch.cuda.synchronize(b.device)
    clock = Clock(b.device)
    _cuda_sleep(int(3 * host * 2e6))  # ~2 GHz: three times the issuing, in cycles
    start = clock.mark()
    fn()
    end = clock.mark()
    torch.cuda.synchronize(b.device)
    return host, Clock.ms(start, end)


GRAPHED = tuple(f"graphs_{k}" for k in (*TODAY, "searched"))
"""The graphed twins of the host-bound pass: attention (and, with ``GRAPH_ROUTER``, the
router) as CUDA graphs."""
GRAPH_ROUTER = os.environ.get("MOE_OVERLAP_BENCH_GRAPH_ROUTER") == "1"
"""The router graphed too: off by default, its capture in this model is one CUDA invalidates
(the library's ``ConfigError`` names the usual causes; ``docs/graphs.md``)."""
NOT_GRAPHED = {
    "graphs_fill_drain_recompute": (
        "not run: the model's own recomputation (MoESliceModel.set_recompute) refuses CUDA graphs"
    )
}
"""Twins this model cannot run, and why (their rows say it)."""
PLAIN = ("plain", "plain_recompute", "graphs_plain")
"""The host-bound pass's references: the same model without the schedule."""
HOST_ROWS = (*TODAY, "searched", *GRAPHED, *PLAIN)
PLAIN_OF = {
    "serial": "plain",
    "overlapped": "plain",
    "fill_drain": "plain",
    "fill_drain_recompute": "plain_recompute",
    "graphs_serial": "graphs_plain",
    "graphs_overlapped": "graphs_plain",
    "graphs_fill_drain": "graphs_plain",
}
"""The plain step doing the same work as each schedule (its schedule's share of host time)."""
NO_PLAIN = "the schedule recomputes whole slots itself: no plain step does the same work"


def plain_step(b: Bench) -> list[Tensor]:
    """The same model without the schedule: per microbatch, its pre-process, every layer's
    four slots in order on one :class:`~moe_overlap.blocks.PlainContext` (nothing
    detached), the loss and ``loss.backward()``, on the current stream; the losses.

    What :func:`~moe_overlap.combined_1f1b` promises to equal, bit for bit."""
    model = b.model
    losses: list[Tensor] = []
    for mb in b.mbs:
        state = ChunkState(mb)
        pre = model._preprocess(None, None, decoder_input=mb.decoder_input)  # pyright: ignore[reportPrivateUsage]
        x = pre.decoder_input
        for layer in model.decoder.layers:
            assert isinstance(layer, MoESliceLayer)
            ctx = PlainContext(state)
            for slot in (
                layer.slot_pre_dispatch,
                layer.slot_dispatch,
                layer.slot_mlp,
                layer.slot_combine,
            ):
                out = slot(ctx, (x,))
                assert isinstance(out, Tensor)
                x = out
        loss = model.output(x, None, None)
        torch.autograd.backward([loss])
        losses.append(loss.detach())
    return losses


def host_variants(b: Bench, schedule: NodeSchedule) -> dict[str, Callable[[], object]]:
    """The host-bound pass's steps (:data:`HOST_ROWS` less :data:`NOT_GRAPHED`): today's
    and the searched schedule, each graphed twin (each layer's attention, and the router with
    :data:`GRAPH_ROUTER`, run as CUDA graphs, as ``bench_overlap.py`` graphs them), and the
    plain references."""
    model = b.model
    today = variants(b, schedule)

    def graphed(fn: Callable[[], object]) -> Callable[[], object]:
        return switched(
            lambda: model.set_graphs(True, router=GRAPH_ROUTER), lambda: model.set_graphs(False), fn
        )

    fns = {k: today[k] for k in (*TODAY, "searched")}
    fns.update({f"graphs_{k}": graphed(fn) for k, fn in dict(fns).items()})
    fns["plain"] = lambda: plain_step(b)
    fns["plain_recompute"] = switched(
        lambda: model.set_recompute(True),
        lambda: model.set_recompute(False),
        lambda: plain_step(b),
    )
    fns["graphs_plain"] = graphed(lambda: plain_step(b))
    for k in NOT_GRAPHED:
        del fns[k]
    return fns


def graph_replays(model: MoESliceModel) -> int:
    """How many graphed forwards the layers have replayed so far."""
    layers = [m for m in model.decoder.layers if isinstance(m, MoESliceLayer)]
    return sum(g.stats.forward_replays for m in layers for g in (m.attn_graph, m.router_graph))


def refused(b: Bench, fns: dict[str, Callable[[], object]]) -> dict[str, str]:
    """One step of each graphed variant of ``fns``; those the library refuses (its own
    error), with the first line of why. A refused step's pending weight gradients are
    dropped, so the next step starts clean."""
    out: dict[str, str] = {}
    for k in [k for k in fns if k.startswith("graphs_")]:
        b.model.zero_grad(set_to_none=False)
        try:
            fns[k]()
        except MoeOverlapError as error:
            out[k] = f"not run: {str(error).splitlines()[0]}"
            discard_wgrad(b.model)
    b.model.zero_grad(set_to_none=False)
    return out


def host_bound(config: JsonDict, args: argparse.Namespace) -> JsonDict:
    """Host and GPU milliseconds per layer pair of each variant at the host-bound size,
    eager and graphed, with the share of host time the schedule adds over the plain step.

    In order: one step of each graphed twin (a twin the library refuses is left out, its
    row saying why); the exactness pass (every step against the eager serial step, bit for
    bit, under deterministic kernels, as the main table's); every graphed twin run until
    its graphs are captured; then the timed steps, which must capture none."""
    n = cast(int, config["microbatches"])
    cfg = HOST_BOUND if not args.tiny else SliceConfig(hidden=64, ffn=32, tokens=64, head_dim=16)
    b = make_bench(cfg, args, n)
    fns = host_variants(b, NodeSchedule.parse(cast(str, config["best_order"])))
    skipped = {**NOT_GRAPHED, **refused(b, fns)}
    fns = {k: fn for k, fn in fns.items() if k not in skipped}
    perturb = perturb_target([k for k in (*HOST_ROWS, "compute_only") if k != "serial"])
    exact = exactness(b, fns, attention=args.exact_attention, perturb=perturb)
    failed = cast("list[str]", exact["failed"])
    replays: dict[str, int] = {}
    for k in [k for k in fns if k.startswith("graphs_")]:  # captured before any timing
        for _ in range(max(1, args.warmup - 1) if b.device.type == "cuda" else 0):
            fns[k]()
        before = graph_replays(b.model)
        fns[k]()
        replays[k] = graph_replays(b.model) - before
    captured = b.model.graph_captures()
    pairs = cfg.num_layers * n
    rows: dict[str, JsonDict] = {}
    for k, fn in fns.items():
        for _ in range(max(1, args.warmup)):
            fn()
        samples = [host_and_gpu_ms(b, fn) for _ in range(max(1, args.iters))]
        host = median([h for h, _ in samples]) / pairs
        gpus = [g for _, g in samples if g is not None]
        gpu = median(gpus) / pairs if gpus else None
        rows[k] = {
            "host_ms_per_layer_pair": host,
            "gpu_ms_per_layer_pair": gpu,
            "host_over_gpu": None if gpu is None else host / gpu,
            "bit_identical_to_serial": (k if k != "serial" else "serial (run to run)")
            not in failed,
        }
        if k in replays:
            rows[k]["graph_replays_per_step"] = replays[k]
    if b.model.graph_captures() != captured:
        raise RuntimeError("bench_schedules: graphs were captured during the timed steps")
    for k, row in rows.items():
        if k in PLAIN:
            continue
        ref = PLAIN_OF.get(k)
        if ref is not None and ref not in rows:  # refused by the library (its row says why)
            row["no_plain_reference"] = f"{ref} was not run"
            ref = None
        elif ref is None:
            row["no_plain_reference"] = NO_PLAIN
        base = None if ref is None else cast(float, rows[ref]["host_ms_per_layer_pair"])
        host = cast(float, row["host_ms_per_layer_pair"])
        row["plain_reference"] = ref
        row["schedule_host_ms_per_layer_pair"] = None if base is None else host - base
        row["schedule_share_of_host"] = None if base is None else (host - base) / host
    out: JsonDict = {"name": config["name"], "microbatches": n, "layer_pairs": pairs}
    out.update({k: rows[k] if k in rows else {"skipped": skipped[k]} for k in HOST_ROWS})
    out["graphs_captured"] = captured
    out["graphs_on_device"] = b.device.type == "cuda"
    out["exactness"] = exact
    out["exactness_failed"] = failed
    return out


HOST_NOTES = """
Each schedule's `graphs_` twin runs each layer's attention as CUDA graphs (the router too
with MOE_OVERLAP_BENCH_GRAPH_ROUTER=1), all captured before the timed steps. `plain`: the same model without the schedule (per
microbatch its slots in order, then `loss.backward()`; `plain_recompute` with the model's
own recomputation, `graphs_plain` graphed); "schedule's share" is the host time a schedule
adds over the plain step doing the same work, over its own. "bit-identical": its losses and
gradients against the eager serial step's, under deterministic kernels.
"""

CPU_NOTE = """
On the CPU the graphed twins run eagerly (a graphed block needs CUDA) and host time includes
the kernels themselves: these rows check the benchmark's plumbing only.
"""


def host_table(rows: list[JsonDict]) -> str:
    lines = [
        "| configuration | schedule | host ms per layer pair | GPU ms per layer pair "
        "| host / GPU | schedule's host ms per layer pair (share) | bit-identical |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for k in HOST_ROWS:
            v = cast(JsonDict, r[k])
            if "skipped" in v:
                lines.append(f"| {r['name']} | {k} | {v['skipped']} | | | | |")
                continue
            gpu, ratio = v["gpu_ms_per_layer_pair"], v["host_over_gpu"]
            extra = v.get("schedule_host_ms_per_layer_pair")
            share = (
                "reference"
                if k in PLAIN
                else "-"
                if extra is None
                else f"{cast(float, extra):.3f} ({cast(float, v['schedule_share_of_host']):.0%})"
            )
            lines.append(
                f"| {r['name']} | {k} | {cast(float, v['host_ms_per_layer_pair']):.3f} | "
                f"{'-' if gpu is None else f'{cast(float, gpu):.3f}'} | "
                f"{'-' if ratio is None else f'{cast(float, ratio):.2f}'} | {share} | "
                f"{'yes' if v['bit_identical_to_serial'] else 'no'} |"
            )
    text = "\n".join(lines) + "\n" + HOST_NOTES
    if not all(r["graphs_on_device"] for r in rows):
        text += CPU_NOTE
    return text


def table(results: list[JsonDict]) -> str:
    lines = [
        "| configuration | schedule | step ms | x max(compute, comm) | speed-up | memory x serial "
        "| predicted ms (error) | predicted here ms (error) | bit-identical |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        failed = cast("list[str]", r["exactness_failed"])
        for k, row in cast("dict[str, JsonDict]", r["rows"]).items():
            mem = row["memory_x_serial"]
            lines.append(
                f"| {r['name']} | {k} | {cast(float, row['step_ms']):.1f} | "
                f"{cast(float, row['over_max_compute_comm']):.3f} | "
                f"{cast(float, row['speedup']):.3f} | "
                f"{'-' if mem is None else f'{cast(float, mem):.3f}'} | "
                f"{cast(float, row['predicted_ms']):.1f} ({cast(float, row['prediction_error']):+.1%}) | "
                f"{cast(float, row['predicted_here_ms']):.1f} "
                f"({cast(float, row['prediction_here_error']):+.1%}) | "
                f"{'no' if k in failed else 'yes'} |"
            )
    for r in results:
        fitted = r.get("contention_fitted_here")
        rows = cast("dict[str, JsonDict]", r["rows"])
        if fitted is None:
            lines.append(f"\n{r['name']}: no contention in [0, 2] gives the overlapped step.")
            continue
        errors = ", ".join(
            f"{k} {cast(float, row['prediction_fitted_error']):+.1%}" for k, row in rows.items()
        )
        lines.append(
            f"\n{r['name']}: with the contention fitted on this run's overlapped step "
            f"({cast(float, fitted):.3f}), predicted here: {errors}."
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="tiny sizes (CPU smoke run)")
    p.add_argument("--frontier", type=Path, default=FRONTIER)
    p.add_argument("--configs", nargs="*", default=None, help="configuration names (all)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--exact-attention", default="sdpa", choices=("sdpa", "math"))
    p.add_argument(
        "--skip",
        nargs="*",
        default=(),
        choices=("main", "host"),
        help="skip the main sizes' pass or the host-bound one",
    )
    p.add_argument("--out", type=Path, required=True, help="folder for schedules.json/.md")
    args = p.parse_args(argv)
    frontier = cast(JsonDict, json.loads(args.frontier.read_text("utf-8")))
    configs = cast("list[JsonDict]", frontier["configs"])
    contention = cast(float, frontier["comm_contention"])
    chosen = [
        {**c, "space": frontier.get("space", {})}
        for c in configs
        if args.configs is None or c["name"] in args.configs
    ]
    results: list[JsonDict] = []
    hosts: list[JsonDict] = []
    for c in chosen:
        if "main" not in args.skip:
            print(f"bench_schedules: {c['name']} ...", file=sys.stderr, flush=True)
            compute = by_kind_of(frontier, "compute_contention_by_kind")
            results.append(measure(c, args, contention, by_kind_of(frontier), compute))
        if "host" not in args.skip:
            print(f"bench_schedules: {c['name']}, host-bound size ...", file=sys.stderr, flush=True)
            hosts.append(host_bound(c, args))
    args.out.mkdir(parents=True, exist_ok=True)
    given = sys.argv[1:] if argv is None else argv
    command = "python benchmarks/bench_schedules.py " + shlex.join(given)
    doc = {
        "command": command,
        "device": _device(args.device),
        "results": results,
        "host_bound": hosts,
    }
    (args.out / "schedules.json").write_text(json.dumps(doc, indent=1) + "\n", "utf-8")
    text = f"`{command}` on {doc['device']}\n\n"
    if results:
        text += table(results)
    if hosts:
        text += "\nAt the host-bound size (hidden 256, 256 tokens, expert FFN 128):\n\n"
        text += host_table(hosts)
    (args.out / "schedules.md").write_text(text, "utf-8")
    print(text)
    print(f"wrote {args.out / 'schedules.json'} and {args.out / 'schedules.md'}")
    for h in hosts:  # what differed at the host-bound size (the rows say which)
        exact = cast(JsonDict, h["exactness"])
        for k in cast("list[str]", h["exactness_failed"]):
            cmp = cast("dict[str, JsonDict]", exact["variants"])[k]
            print(f"{h['name']}, host-bound size: {describe(k, 'serial', cmp)}", file=sys.stderr)
    if any(r["exactness_failed"] for r in (*results, *hosts)):
        raise SystemExit("bench_schedules: a variant was not bit-identical to the serial step")


def _device(device: str) -> str:
    if torch.device(device).type == "cuda":
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    return f"CPU (torch {torch.__version__})"


if __name__ == "__main__":
    main()
