"""Where the planner's prediction of a searched schedule and the GPU part: node by node.

For one configuration of the committed frontier (default ``main N=4``; the benchmark's MoE
slice at ``bench_schedules.py``'s sizes), in one process:

1. one recorded serial step's node durations (``serial_slot_durations``, as
   ``bench_schedules.py`` records them): the profile every prediction below comes from;
2. ``--warmup`` untimed rounds, then ``--repeats`` recorded rounds, each running once, in an
   order rotated by one per round: ``overlapped`` (combined 1F1B), ``searched`` (the
   configuration's best order, as ``bench_schedules.py`` runs it) and ``searched_serial``
   (the same order with both streams the compute stream: each node's uncontended
   duration, its ``W`` and ``R`` steps included). Every node of every step is timed on its
   stream with ``node_timing.NodeRecorder`` (CUDA events after the node's event wait, and
   the host time it was issued); per node the median over the repeats;
3. the planner's replay of the same orders, each model with the contention fitted on this
   run's overlapped step (``bench_schedules.fit_here``; the frontier's when none fits):
   ``planner``, from the serial profile as ``bench_schedules.py`` predicts; ``one_event``,
   the same with each microbatch's steps in issue order as the engine's one event per
   microbatch runs them (:attr:`moe_overlap.plan.ScheduleGraph.one_event`);
   ``one_event_measured_w``, that from ``searched_serial``'s profile, whose ``W`` steps are
   measured (the planner's default otherwise: 50 % of the mlp's backward and 35 % of the
   pre-dispatch's, though this model delays no pre-dispatch weight gradient); ``by_kind``,
   that with each communication kind slowed by the compute beside it instead of one factor
   (:func:`moe_overlap.plan.fit_contention_by_kind` on this run's overlapped step, each
   communication node against its ``searched_serial`` time); ``by_kind_both``, that with
   each compute kind slowed by the communication beside it too
   (:func:`moe_overlap.plan.fit_compute_contention_by_kind` on the same step, each compute
   node against its ``searched_serial`` time, a backward's with its ``W``; the ``W`` and
   ``R`` kinds, which the overlapped step does not run apart, take their slot's backward's
   and forward's coefficient: the same kernels).

For ``overlapped`` and ``searched`` it reports: the step, measured against each model; per
stream the busy and idle milliseconds, measured and predicted; per node kind (slot, F/B/W/R,
stream) the mean measured duration against the uncontended one (the serial profile's for
``overlapped``, ``searched_serial``'s for ``searched``: the inflation) and the one the
planner assumed; the nodes where the measured timeline drifts from the predicted one the
most (each node's lag at its end less the lag of what it waited for), with what it waited
for on the GPU (the previous node on its stream, its microbatch's previous node on the other
stream, the host's issue, or nothing recorded) and in the model; and the allocator's
counters over the recorded steps (device and pinned-host allocations, retries). Writes
``explain.json``, ``explain.md`` and one Gantt chart per row (measured above the planner's
timeline) to ``--out`` and prints every path written. Exactness is ``bench_schedules.py``'s
job: nothing here compares results.

On a GPU: 16 steps per configuration with the defaults (``--warmup`` 2 and ``--repeats``
3 rounds of 3 rows, one serial step), each about 0.5 s at main N=4 and 1 s at main N=8 on
an H100 (``benchmarks/results/h100_2026_12_07/schedules_s*_second.md``), plus the model
build and the first step's setup; bound it with ``--configs`` and ``--repeats``::

    CUBLAS_WORKSPACE_CONFIG=:4096:8 python benchmarks/explain_prediction.py --out DIR
    CUBLAS_WORKSPACE_CONFIG=:4096:8 python benchmarks/explain_prediction.py --out DIR \\
        --configs 'main N=4' 'main N=8'    # both main configurations
    python benchmarks/explain_prediction.py --device cpu --tiny --out /tmp/x   # smoke

``--offline EXPLAIN_JSON`` recomputes the ``by_kind`` and ``by_kind_both`` models (and the
one factor they are compared with) from a recorded ``explain.json``, on the CPU, and prints
both rows' step and both streams' busy milliseconds, measured and predicted (and
``by_kind_both`` with its ``W`` and ``R`` kinds at 0, ``by_kind_both_wr0``)::

    python benchmarks/explain_prediction.py \
        --offline benchmarks/results/h100_2026_12_07b/explain/explain.json

``--fit-from EXPLAIN_JSON CONFIG`` fits those models on another recorded run's overlapped
row instead, and so predicts out of sample (main N=8 from coefficients fitted at N=4)::

    python benchmarks/explain_prediction.py \
        --offline benchmarks/results/h100_2026_12_07d/explain8/explain.json \
        --fit-from benchmarks/results/h100_2026_12_07b/explain/explain.json 'main N=4'
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_overlap import Bench, JsonDict, make_bench, profile_rows, serial_profile, step
from bench_schedules import FRONTIER, Replay, fit_here, replayed, searched
from moe_slice import SliceConfig
from node_timing import (
    Clock,
    NodeKey,
    NodeRecorder,
    NodeSpan,
    slot_durations,
    write_gantt_png,
)

from moe_overlap.plan import (
    ContentionFit,
    ContentionKind,
    MeasuredSpan,
    SearchStep,
    fit_compute_contention_by_kind,
    fit_contention_by_kind,
    load_profile,
)
from moe_overlap.steps import Direction, NodeSchedule, Slot, StreamKind

ROWS = ("overlapped", "searched")
"""The rows explained (``searched_serial`` is the searched row's uncontended reference)."""
MODELS = ("planner", "one_event", "one_event_measured_w", "by_kind", "by_kind_both")
"""The planner's replay as it predicts; with the engine's one event per microbatch; and
also from the one-stream run's profile, whose ``W`` rows are measured (the planner's
default otherwise: 50 % of the mlp's backward, 35 % of the pre-dispatch's); that with
contention per communication kind instead of one factor; that with contention per compute
kind too."""
FACTOR_MODELS = MODELS[:3]
"""The models with one contention factor (``fit_here``'s)."""
TOLERANCE_MS = 0.05
"""A node whose start is within this of a candidate's end waited for that candidate."""

_F, _B, _W, _R = Direction.FORWARD, Direction.BACKWARD, Direction.WGRAD, Direction.RECOMPUTE


@dataclass(frozen=True, slots=True)
class Node:
    """One node of a timeline, in issue order: when it ran and, measured, when the host
    issued it."""

    key: NodeKey
    stream: StreamKind
    start: float
    end: float
    issued: float | None = None

    @property
    def ms(self) -> float:
        return self.end - self.start

    def kind(self) -> str:
        """``mlp.F@comp``: slot, direction, stream."""
        return f"{self.key.slot.value}.{self.key.direction.value}@{self.stream.value}"


@dataclass(frozen=True, slots=True)
class Wait:
    """What a node waited for: ``what`` is ``stream`` (the previous node on its stream),
    ``event`` (its microbatch's previous node, on the other stream), ``data`` (a step it
    reads, in the planner's model), ``join`` (the end of a model's chunk run), ``host`` (its
    issue) or ``none`` (started at once, or after work no node recorded: ``gap_ms``)."""

    what: str
    on: NodeKey | None
    ready: float
    gap_ms: float


# --- recording --------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def allocator_counts(device: torch.device) -> dict[str, int]:
    """The CUDA caching allocators' event counters (device and pinned host): allocations,
    frees, retries, synchronizations. Empty on the CPU."""
    if device.type != "cuda":
        return {}
    out: dict[str, int] = {}
    stats = cast("dict[str, object]", torch.cuda.memory_stats(device))
    host_stats = getattr(torch.cuda, "host_memory_stats", None)  # newer torch only
    try:
        host = cast("dict[str, object]", host_stats()) if callable(host_stats) else {}
    except RuntimeError:  # no pinned allocation yet in this process
        host = {}
    for prefix, table in (("device", stats), ("host", host)):
        for k, v in table.items():
            if k.startswith("num_") and isinstance(v, int):
                out[f"{prefix}.{k}"] = v
    return out


@dataclass
class Recorded:
    """A row's recorded steps: the nodes of each (issue order), step ms, allocator deltas."""

    runs: list[list[Node]]
    step_ms: list[float]
    allocator: dict[str, int]


def record(b: Bench, run: Callable[[NodeRecorder], object], into: Recorded) -> None:
    """One step of ``run`` under a fresh :class:`NodeRecorder`, added to ``into``."""
    b.model.zero_grad(set_to_none=False)
    _sync(b.device)
    before = allocator_counts(b.device)
    rec = NodeRecorder(b.device)
    rec.start()
    run(rec)
    end = rec.clock.mark()
    _sync(b.device)
    after = allocator_counts(b.device)
    for k, v in after.items():
        into.allocator[k] = into.allocator.get(k, 0) + v - before.get(k, 0)
    into.step_ms.append(Clock.ms(rec.origin, end))
    into.runs.append(
        [Node(s.key, s.stream, s.start_ms, s.end_ms, s.issued_ms) for s in rec.spans()]
    )


def row_runs(b: Bench, schedule: NodeSchedule) -> dict[str, Callable[[NodeRecorder], object]]:
    """Each recorded row's step, given the recorder to hand its plans."""
    return {
        "overlapped": lambda rec: step(b, overlap=True, on_plan=rec),
        "searched": lambda rec: searched(b, schedule, on_plan=rec)(),
        "searched_serial": lambda rec: searched(b, schedule, on_plan=rec, streams=b.serial)(),
    }


def median_nodes(runs: list[list[Node]]) -> list[Node]:
    """Per node (in the first run's issue order), the median start, end and issue time."""
    by_key: dict[NodeKey, list[Node]] = {}
    for run in runs:
        for n in run:
            by_key.setdefault(n.key, []).append(n)
    out: list[Node] = []
    for n in runs[0]:
        same = by_key[n.key]
        issued = [x.issued for x in same if x.issued is not None]
        out.append(
            Node(
                n.key,
                n.stream,
                statistics.median(x.start for x in same),
                statistics.median(x.end for x in same),
                statistics.median(issued) if issued else None,
            )
        )
    return out


# --- the model's timeline ---------------------------------------------------------------------


def node_key(s: SearchStep) -> NodeKey:
    """A planner step as the recorder keys it (``R``: a recompute)."""
    return NodeKey(s.microbatch, s.layer, s.slot, _R if s.recompute else s.direction)


def model_nodes(replay: Replay) -> list[Node]:
    """The replay's steps as nodes, in issue order."""
    return [Node(node_key(s), s.stream, lo, hi) for s, lo, hi in replay.spans]


def join_floors(replay: Replay) -> dict[NodeKey, float]:
    """Per step after a join of the order (today's schedules: one after each chunk run),
    when everything before the join ended."""
    out: dict[NodeKey, float] = {}
    spans = iter(replay.spans)
    floor = top = 0.0
    for item in replay.order:
        if item is None:
            floor = top
            continue
        s, _, hi = next(spans)
        top = max(top, hi)
        if floor:
            out[node_key(s)] = floor
    return out


def data_preds(replay: Replay) -> dict[NodeKey, list[NodeKey]]:
    """Each step's reads in the planner's graph (a ``W`` step: none)."""
    g = replay.graph
    return {
        node_key(s): [] if s.direction is _W else [node_key(p) for p in preds]
        for mb in range(g.microbatches)
        for s, preds in g.microbatch_steps(mb)
    }


# --- contention per communication kind -------------------------------------------------------


def kind_name(kind: ContentionKind) -> str:
    return f"{kind[0].value}.{kind[1].value}"


def fit_by_kind(overlapped: Sequence[Node], alone: dict[NodeKey, float]) -> ContentionFit:
    """The contention per communication kind of a recorded overlapped step, each
    communication node against its one-stream milliseconds ``alone``."""
    return fit_contention_by_kind(
        [
            MeasuredSpan(
                n.key.slot,
                n.key.direction,
                n.stream,
                n.start,
                n.end,
                alone.get(n.key) if n.stream is StreamKind.COMM else None,
            )
            for n in overlapped
        ]
    )


def compute_alone(row: Sequence[Node], alone: dict[NodeKey, float]) -> dict[NodeKey, float]:
    """Each compute node of ``row`` by its one-stream milliseconds ``alone`` (a backward
    whose ``W`` the row does not run apart: with that ``W``'s, as the replay's backward)."""
    apart = {(n.key.microbatch, n.key.layer, n.key.slot) for n in row if n.key.direction is _W}
    out: dict[NodeKey, float] = {}
    for n in row:
        k = n.key
        if n.stream is not StreamKind.COMP or k not in alone:
            continue
        w = NodeKey(k.microbatch, k.layer, k.slot, _W)
        out[k] = alone[k]
        if k.direction is _B and (k.microbatch, k.layer, k.slot) not in apart and w in alone:
            out[k] += alone[w]
    return out


def fit_compute_by_kind(overlapped: Sequence[Node], alone: dict[NodeKey, float]) -> ContentionFit:
    """The contention per compute kind of a recorded overlapped step, each compute node
    against :func:`compute_alone`."""
    mine = compute_alone(overlapped, alone)
    return fit_compute_contention_by_kind(
        [
            MeasuredSpan(n.key.slot, n.key.direction, n.stream, n.start, n.end, mine.get(n.key))
            for n in overlapped
        ]
    )


def with_w_and_r(fit: ContentionFit) -> dict[ContentionKind, float]:
    """``fit``'s compute coefficients, each ``W`` and ``R`` kind it never saw beside the
    communication taking its slot's ``B`` and ``F`` coefficient (the same kernels: a
    weight-gradient GEMM, a forward run again)."""
    out = dict(fit.coefficients)
    for (slot, direction), c in fit.coefficients.items():
        for apart, like in ((_W, _B), (_R, _F)):
            if direction is like and (slot, apart) in fit.unseen:
                out[(slot, apart)] = c
    return out


def fit_json(fit: ContentionFit) -> JsonDict:
    """A fit as ``explain.json`` keeps it: coefficients by ``slot.direction``, the kinds
    never beside compute and those no slower than alone (both 0)."""
    return {
        "coefficients": {kind_name(k): c for k, c in fit.coefficients.items()},
        "unseen": [kind_name(k) for k in fit.unseen],
        "clamped": [kind_name(k) for k in fit.clamped],
    }


def slice_config(ffn: int, *, tiny: bool) -> SliceConfig:
    return (
        SliceConfig(ffn=ffn) if not tiny else SliceConfig(hidden=64, ffn=32, tokens=64, head_dim=16)
    )


def node_of(row: JsonDict) -> Node:
    """A node of an ``explain.json`` timeline (``mb0.L1.combine.B``, ``mb2.pre_process.F``)."""
    parts = cast(str, row["node"]).split(".")
    layer = int(parts[1][1:]) if len(parts) == 4 else None
    key = NodeKey(int(parts[0][2:]), layer, Slot(parts[-2]), Direction(parts[-1]))
    issued = cast("float | None", row.get("issued_ms"))
    stream = StreamKind(cast(str, row["stream"]))
    return Node(key, stream, cast(float, row["start_ms"]), cast(float, row["end_ms"]), issued)


def busy(replay: Replay, stream: StreamKind) -> float:
    return sum(hi - lo for s, lo, hi in replay.spans if s.stream is stream)


def comm_busy(replay: Replay) -> float:
    return busy(replay, StreamKind.COMM)


OFFLINE_MODELS = ("one_factor", "by_kind", "by_kind_both", "by_kind_both_wr0")
"""``--offline``'s models: the one factor, per communication kind, and per kind of both
streams (``W`` and ``R`` as ``B`` and ``F``; at 0)."""


def _measured_nodes(result: JsonDict) -> dict[str, list[Node]]:
    measured = cast("dict[str, list[JsonDict]]", cast(JsonDict, result["timelines"])["measured"])
    return {k: [node_of(x) for x in v] for k, v in measured.items()}


def one_stream_ms(nodes: dict[str, list[Node]]) -> dict[NodeKey, float]:
    """The one-stream run's F, B and W durations (its R steps are the planner's F again)."""
    return {n.key: n.ms for n in nodes["searched_serial"] if n.key.direction is not _R}


def fits_on(nodes: dict[str, list[Node]]) -> tuple[ContentionFit, ContentionFit]:
    """The per-kind models of both streams fitted on a configuration's overlapped row,
    each node against its :func:`one_stream_ms`."""
    alone = one_stream_ms(nodes)
    return fit_by_kind(nodes["overlapped"], alone), fit_compute_by_kind(nodes["overlapped"], alone)


def fits_of(result: JsonDict) -> tuple[ContentionFit, ContentionFit]:
    """:func:`fits_on` a recorded configuration (an ``explain.json`` result)."""
    return fits_on(_measured_nodes(result))


def offline(
    doc: JsonDict,
    configs: Sequence[JsonDict],
    fitted_on: tuple[str, tuple[ContentionFit, ContentionFit]] | None = None,
) -> list[JsonDict]:
    """Per configuration of a recorded ``explain.json``: the ``by_kind`` and
    ``by_kind_both`` models refitted on its overlapped row (or, with ``fitted_on``, a
    description and the two fits of another run: a prediction out of sample) and both rows
    replayed with them and with ``one_event_measured_w``'s one factor (this run's, else the
    frontier's), from its ``searched_serial`` profile; step and both streams' busy
    milliseconds, measured and predicted. ``configs``: the frontier's (the searched order by
    name, checked the one recorded)."""
    out: list[JsonDict] = []
    tiny = "--tiny" in cast(str, doc.get("command", ""))
    for result in cast("list[JsonDict]", doc["results"]):
        name = cast(str, result["name"])
        config = next((c for c in configs if c["name"] == name), None)
        if config is None or cast(JsonDict, config["targets"])["best"] != result["searched"]:
            raise ValueError(
                f"{name}: expected the frontier's configuration of that name searching "
                f"{result['searched']!r}, received none or another order"
            )
        fit, compute = fits_of(result) if fitted_on is None else fitted_on[1]
        profile = cast("list[JsonDict]", result["searched_serial_slot_durations"])
        layers = slice_config(cast(int, result["ffn"]), tiny=tiny).num_layers
        fitted = cast("dict[str, float | None]", result["contention_fitted_here"])
        factor = fitted.get("one_event_measured_w")
        one = cast(float, result["contention_frontier"]) if factor is None else factor

        replays = {
            "one_factor": replayed(
                profile, config, num_layers=layers, contention=one, one_event=True
            )
        }
        for m, computes in (
            ("by_kind", None),
            ("by_kind_both", with_w_and_r(compute)),
            ("by_kind_both_wr0", dict(compute.coefficients)),
        ):
            replays[m] = replayed(
                profile,
                config,
                num_layers=layers,
                contention=0.0,
                one_event=True,
                contention_by_kind=fit.coefficients,
                compute_contention_by_kind=computes,
            )
        rows: JsonDict = {}
        for row in ROWS:
            got = cast(JsonDict, cast(JsonDict, result["rows"])[row])
            streams_ = cast("dict[str, JsonDict]", got["measured_streams"])
            rows[row] = {
                "measured_step_ms": got["measured_step_ms"],
                "measured_comp_busy_ms": streams_["comp"]["busy_ms"],
                "measured_comm_busy_ms": streams_["comm"]["busy_ms"],
                **{
                    m: {
                        "step_ms": r[row].step_ms,
                        "comp_busy_ms": busy(r[row], StreamKind.COMP),
                        "comm_busy_ms": comm_busy(r[row]),
                    }
                    for m, r in replays.items()
                },
            }
        out.append(
            {
                "name": name,
                "fitted_on": "this run" if fitted_on is None else fitted_on[0],
                "one_factor": one,
                "by_kind_fit": fit_json(fit),
                "compute_by_kind_fit": fit_json(compute),
                "rows": rows,
            }
        )
    return out


def _fit_line(fit: JsonDict, beside: str) -> str:
    """A fit's coefficients other than 0, then the kinds at 0 and why."""
    coefficients = cast("dict[str, float]", fit["coefficients"])
    shown = ", ".join(f"{k} {v:.3f}" for k, v in coefficients.items() if v)
    notes = [
        f"{why}: {', '.join(kinds)}"
        for why, kinds in (
            (f"never beside {beside}", cast("list[str]", fit["unseen"])),
            ("no slower than alone", cast("list[str]", fit["clamped"])),
        )
        if kinds
    ]
    return shown + (f" (0, {'; '.join(notes)})" if notes else "")


def offline_markdown(doc: JsonDict, found: Sequence[JsonDict]) -> str:
    """:func:`offline`'s figures as tables per configuration."""
    lines = [
        f"From `{doc.get('command', '')}` on {doc.get('device', '?')}, recomputed offline.",
        "",
    ]
    for r in found:
        fit = cast(JsonDict, r["by_kind_fit"])
        coefficients = cast("dict[str, float]", fit["coefficients"])
        notes = [f"{k} never beside compute" for k in cast("list[str]", fit["unseen"])]
        notes += [f"{k} no slower than alone" for k in cast("list[str]", fit["clamped"])]
        lines += [
            f"## {r['name']}",
            "",
            f"Fitted on the overlapped row of {r['fitted_on']}: "
            + ", ".join(f"{k} {v:.3f}" for k, v in coefficients.items())
            + (f" (0: {'; '.join(notes)})" if notes else "")
            + f"; one factor {cast(float, r['one_factor']):.4f}.",
            "",
            "| row | measured step ms | one factor ms (error) | by kind ms (error) | measured "
            "comm busy ms | one factor comm busy (error) | by kind comm busy (error) |",
            "|---|---|---|---|---|---|---|",
        ]
        for row, x in cast("dict[str, JsonDict]", r["rows"]).items():
            step_ms = cast(float, x["measured_step_ms"])
            busy_ms = cast(float, x["measured_comm_busy_ms"])
            cells = [row, f"{step_ms:.1f}"]
            for key, want in (("step_ms", step_ms), ("comm_busy_ms", busy_ms)):
                if key == "comm_busy_ms":
                    cells.append(f"{busy_ms:.1f}")
                for m in ("one_factor", "by_kind"):
                    v = cast(float, cast(JsonDict, x[m])[key])
                    cells.append(f"{v:.1f} ({v / want - 1.0:+.1%})")
            lines.append("| " + " | ".join(cells) + " |")
        lines += [
            "",
            "Compute kinds fitted on the same row too (`by_kind_both`; W and R as their slot's "
            "B and F, `by_kind_both_wr0`: at 0): "
            + _fit_line(cast(JsonDict, r["compute_by_kind_fit"]), "communication")
            + ".",
            "",
            "| row | model | step ms (error) | comp busy ms (error) | comm busy ms (error) |",
            "|---|---|---|---|---|",
        ]
        for row, x in cast("dict[str, JsonDict]", r["rows"]).items():
            recorded = {
                k: cast(float, x[f"measured_{k}"])
                for k in ("step_ms", "comp_busy_ms", "comm_busy_ms")
            }
            lines.append(
                f"| {row} | measured | " + " | ".join(f"{v:.1f}" for v in recorded.values()) + " |"
            )
            for m in OFFLINE_MODELS:
                got = cast(JsonDict, x[m])
                cells = [
                    f"{cast(float, got[k]):.1f} ({cast(float, got[k]) / v - 1.0:+.1%})"
                    for k, v in recorded.items()
                ]
                lines.append(f"| {row} | {m} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


# --- the analysis -----------------------------------------------------------------------------


def waits(
    nodes: Sequence[Node],
    preds: dict[NodeKey, list[NodeKey]] | None,
    *,
    event: bool,
    joins: dict[NodeKey, float] | None = None,
) -> dict[NodeKey, Wait]:
    """What each node waited for: of its candidates (the previous node on its stream; with
    ``event`` its microbatch's previous node but ``W`` (a ``W`` waits for its stream only);
    ``preds``' steps; a model's join, ``joins``; the host's issue when recorded), the one
    ready last."""
    out: dict[NodeKey, Wait] = {}
    last_on: dict[StreamKind, Node] = {}
    last_of: dict[int, Node] = {}
    ends = {n.key: n for n in nodes}
    for n in nodes:
        cands: list[tuple[float, str, NodeKey | None]] = []
        if n.stream in last_on:
            p = last_on[n.stream]
            cands.append((p.end, "stream", p.key))
        if n.key.direction is not _W:
            if event and n.key.microbatch in last_of:
                p = last_of[n.key.microbatch]
                cands.append((p.end, "stream" if p.stream is n.stream else "event", p.key))
            for k in (preds or {}).get(n.key, []):
                if k in ends:
                    p = ends[k]
                    cands.append((p.end, "stream" if p.stream is n.stream else "data", k))
        if n.issued is not None:
            cands.append((n.issued, "host", None))
        if joins is not None and n.key in joins:
            cands.append((joins[n.key], "join", None))
        ready, what, on = max(cands, key=lambda c: c[0], default=(0.0, "none", None))
        gap = n.start - ready
        if gap > TOLERANCE_MS:  # started later than anything recorded explains
            what, on = "none", None
        out[n.key] = Wait(what, on, ready, max(0.0, gap))
        last_on[n.stream] = n
        if n.key.direction is not _W:
            last_of[n.key.microbatch] = n
    return out


def label(key: NodeKey | None) -> str:
    return "-" if key is None else key.label()


def streams(nodes: Sequence[Node], step_ms: float) -> dict[str, JsonDict]:
    """Per stream: busy (its nodes' milliseconds) and idle (the rest of the step)."""
    out: dict[str, JsonDict] = {}
    for kind in (StreamKind.COMP, StreamKind.COMM):
        busy = sum(n.ms for n in nodes if n.stream is kind)
        out[kind.value] = {"busy_ms": busy, "idle_ms": step_ms - busy}
    return out


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def kinds(
    measured: Sequence[Node],
    uncontended: Sequence[Node] | None,
    profile: dict[tuple[int | None, Slot, Direction], float],
    model: Sequence[Node],
) -> list[JsonDict]:
    """Per node kind: mean measured ms, the uncontended mean (``uncontended``' nodes, else
    the serial profile's), the inflation, and the mean the planner assumed."""
    groups: dict[str, list[Node]] = {}
    for n in measured:
        groups.setdefault(n.kind(), []).append(n)
    assumed: dict[str, list[float]] = {}
    for n in model:
        assumed.setdefault(n.kind(), []).append(n.ms)
    alone: dict[str, list[float]] = {}
    for n in uncontended or ():  # on one stream, still keyed by its slot's stream
        alone.setdefault(n.kind(), []).append(n.ms)
    rows: list[JsonDict] = []
    for kind, ns in sorted(groups.items()):
        if uncontended is not None:
            base = _mean(alone.get(kind, []))
        else:
            base = _mean(
                [
                    profile[k]
                    for n in ns
                    if (k := (n.key.layer, n.key.slot, n.key.direction)) in profile
                ]
            )
        mean = cast(float, _mean([n.ms for n in ns]))
        rows.append(
            {
                "kind": kind,
                "count": len(ns),
                "measured_ms": mean,
                "uncontended_ms": base,
                "inflation": None if not base else mean / base,
                "planner_ms": _mean(assumed.get(kind, [])),
            }
        )
    return rows


def drift(
    measured: Sequence[Node],
    model: Sequence[Node],
    got: dict[NodeKey, Wait],
    want: dict[NodeKey, Wait],
    *,
    top: int,
    threshold_ms: float,
) -> JsonDict:
    """Each node's lag (measured start less predicted start) and how much it grew there:
    its lag at its end less the lag at the end of what it waited for (on the GPU); split
    into the wait's share (it started later after that than the model says) and the
    duration's (it ran longer). The ``top`` largest, and the first ``top`` in measured
    order that grew more than ``threshold_ms``."""
    at = {n.key: n for n in model}
    lag_end: dict[NodeKey, float] = {}
    rows: list[JsonDict] = []
    issued_before: NodeKey | None = None
    on_stream: dict[StreamKind, NodeKey] = {}
    for n in measured:
        p = at.get(n.key)
        w = got[n.key]
        # What its lag grows from: what it waited for; after the host's issue, the node
        # issued before it; after unrecorded work, the node before it on its stream.
        base = (
            w.on
            if w.on is not None
            else issued_before
            if w.what == "host"
            else on_stream.get(n.stream)
        )
        issued_before = on_stream[n.stream] = n.key
        if p is None:
            continue
        lag_end[n.key] = n.end - p.end
        before = lag_end.get(base, 0.0) if base is not None else 0.0
        lag = n.start - p.start
        rows.append(
            {
                "node": n.key.label(),
                "stream": n.stream.value,
                "measured_start_ms": n.start,
                "predicted_start_ms": p.start,
                "lag_ms": lag,
                "growth_ms": lag_end[n.key] - before,
                "wait_share_ms": lag - before,
                "duration_share_ms": n.ms - p.ms,
                "waited_for": f"{got[n.key].what} {label(w.on)}",
                "model_waited_for": f"{want[n.key].what} {label(want[n.key].on)}",
                "gap_ms": w.gap_ms,
            }
        )
    largest = sorted(rows, key=lambda r: -cast(float, r["growth_ms"]))[:top]
    first = [r for r in rows if cast(float, r["growth_ms"]) > threshold_ms][:top]
    first.sort(key=lambda r: cast(float, r["measured_start_ms"]))
    return {
        "largest": sorted(largest, key=lambda r: cast(float, r["measured_start_ms"])),
        "first": first,
    }


def wait_totals(nodes: Sequence[Node], got: dict[NodeKey, Wait]) -> dict[str, float]:
    """Per stream and cause, the milliseconds its nodes waited (start less the previous
    node's end on the stream)."""
    out: dict[str, float] = {}
    last: dict[StreamKind, float] = {}
    for n in nodes:
        idle = n.start - last.get(n.stream, 0.0)
        last[n.stream] = n.end
        if idle > 0:
            k = f"{n.stream.value} waiting on {got[n.key].what}"
            out[k] = out.get(k, 0.0) + idle
    return dict(sorted(out.items()))


def explain_row(
    measured: list[Node],
    step_ms: float,
    replays: dict[str, Replay],
    uncontended: list[Node] | None,
    profile: dict[tuple[int | None, Slot, Direction], float],
    args: argparse.Namespace,
) -> JsonDict:
    """Every figure of one row against each model."""
    got = waits(measured, None, event=True)
    keys = {n.key for n in measured}
    out: JsonDict = {
        "measured_step_ms": step_ms,
        "measured_streams": streams(measured, step_ms),
        "measured_waits": wait_totals(measured, got),
        "nodes": len(measured),
    }
    models: JsonDict = {}
    for m, replay in replays.items():
        nodes = model_nodes(replay)
        want = waits(nodes, data_preds(replay), event=m != "planner", joins=join_floors(replay))
        model_keys = {n.key for n in nodes}
        models[m] = {
            "predicted_step_ms": replay.step_ms,
            "error": replay.step_ms / step_ms - 1.0,
            "streams": streams(nodes, replay.step_ms),
            "waits": wait_totals(nodes, want),
            "kinds": kinds(measured, uncontended, profile, nodes),
            "drift": drift(
                measured,
                nodes,
                got,
                want,
                top=args.top,
                threshold_ms=max(0.1, 0.005 * replay.step_ms),
            ),
            "only_measured": sorted(k.label() for k in keys - model_keys),
            "only_predicted": sorted(k.label() for k in model_keys - keys),
        }
    out["models"] = models
    return out


def spans_of(nodes: Sequence[Node]) -> list[NodeSpan]:
    return [NodeSpan(n.key, n.stream, n.start, n.end, n.issued) for n in nodes]


def node_rows(nodes: Sequence[Node]) -> list[JsonDict]:
    return [
        {
            "node": n.key.label(),
            "stream": n.stream.value,
            "start_ms": n.start,
            "end_ms": n.end,
            "issued_ms": n.issued,
        }
        for n in nodes
    ]


def explain(config: JsonDict, args: argparse.Namespace, contention: float) -> JsonDict:
    """One configuration: record, replay, compare; the Gantt charts written to ``args.out``."""
    n = cast(int, config["microbatches"])
    ffn = cast(int, config["ffn"])
    cfg = slice_config(ffn, tiny=args.tiny)
    rounds = argparse.Namespace(device=args.device, warmup=args.warmup, iters=args.repeats)
    b = make_bench(cfg, rounds, n)
    schedule = NodeSchedule.parse(cast(str, config["best_order"]))
    runs = row_runs(b, schedule)
    for _ in range(args.warmup):
        for run in runs.values():
            b.model.zero_grad(set_to_none=False)
            run(NodeRecorder(b.device))
    profile = serial_profile(b)
    recorded = {k: Recorded([], [], {}) for k in runs}
    names = list(runs)
    for r in range(args.repeats):
        for j in range(len(names)):
            k = names[(r + j) % len(names)]
            record(b, runs[k], recorded[k])
    median_ms = {k: statistics.median(v.step_ms) for k, v in recorded.items()}
    nodes = {k: median_nodes(v.runs) for k, v in recorded.items()}
    alone = one_stream_ms(nodes)
    profiles = {"planner": profile, "one_event": profile}
    profiles["one_event_measured_w"] = profile_rows(slot_durations(alone))
    fitted: dict[str, float | None] = {}
    replays: dict[str, dict[str, Replay]] = {}
    for m in FACTOR_MODELS:
        fitted[m] = fit_here(
            profiles[m], config, num_layers=cfg.num_layers, overlapped_ms=median_ms["overlapped"]
        )
        used = contention if fitted[m] is None else cast(float, fitted[m])
        replays[m] = replayed(
            profiles[m],
            config,
            num_layers=cfg.num_layers,
            contention=used,
            one_event=m != "planner",
        )
    by_kind, compute = fits_on(nodes)
    for m, computes in (("by_kind", None), ("by_kind_both", with_w_and_r(compute))):
        replays[m] = replayed(
            profiles["one_event_measured_w"],
            config,
            num_layers=cfg.num_layers,
            contention=0.0,
            one_event=True,
            contention_by_kind=by_kind.coefficients,
            compute_contention_by_kind=computes,
        )
    table = load_profile(profile)
    rows: JsonDict = {}
    slug = re.sub(r"[^A-Za-z0-9]+", "_", cast(str, config["name"])).strip("_")
    pngs: list[str] = []
    for row in ROWS:
        explained = explain_row(
            nodes[row],
            median_ms[row],
            {m: replays[m][row] for m in MODELS},
            nodes["searched_serial"] if row == "searched" else None,
            table,
            args,
        )
        explained["allocator"] = recorded[row].allocator
        explained["samples_ms"] = recorded[row].step_ms
        rows[row] = explained
        png = args.out / f"gantt_{slug}_{row}.png"
        planner = model_nodes(replays["planner"][row])
        write_gantt_png(
            spans_of(nodes[row]),
            png,
            title=(
                f"{config['name']}, {row}: measured ({median_ms[row]:.1f} ms) above the "
                f"planner's replay ({replays['planner'][row].step_ms:.1f} ms)"
            ),
            compare=spans_of(planner),
        )
        pngs.append(str(png))
    return {
        "name": config["name"],
        "microbatches": n,
        "ffn": ffn,
        "searched": cast(JsonDict, config["targets"])["best"],
        "contention_fitted_here": fitted,
        "contention_by_kind_fitted_here": fit_json(by_kind),
        "compute_contention_by_kind_fitted_here": fit_json(compute),
        "contention_frontier": contention,
        "searched_serial_step_ms": median_ms["searched_serial"],
        "rows": rows,
        "serial_slot_durations": profile,
        "searched_serial_slot_durations": profiles["one_event_measured_w"],
        "timelines": {
            "measured": {k: node_rows(v) for k, v in nodes.items()},
            **{m: {row: node_rows(model_nodes(replays[m][row])) for row in ROWS} for m in MODELS},
        },
        "pngs": pngs,
    }


# --- the report -------------------------------------------------------------------------------


def _f(x: object, fmt: str = ".2f") -> str:
    return "-" if x is None else format(cast(float, x), fmt)


def markdown(doc: JsonDict) -> str:
    lines = [f"`{doc['command']}` on {doc['device']}", ""]
    for r in cast("list[JsonDict]", doc["results"]):
        fitted = cast("dict[str, float | None]", r["contention_fitted_here"])
        fits = ", ".join(
            f"{m} {_f(v, '.3f') if v is not None else 'none'}" for m, v in fitted.items()
        )
        by_kind = cast(JsonDict, r["contention_by_kind_fitted_here"])["coefficients"]
        fits += "; by_kind " + ", ".join(
            f"{k} {_f(v, '.3f')}" for k, v in cast("dict[str, float]", by_kind).items()
        )
        compute = r.get("compute_contention_by_kind_fitted_here")
        if compute is not None:
            fits += "; by_kind_both adds " + _fit_line(cast(JsonDict, compute), "communication")
        named = ", ".join(("measured", *MODELS))
        lines += [
            f"## {r['name']} ({r['microbatches']} microbatches, expert FFN {r['ffn']})",
            "",
            f"Searched: {r['searched']}. Contention fitted on this run's overlapped step, per "
            f"model: {fits} (none: the frontier's, {_f(r['contention_frontier'], '.3f')}). The "
            f"searched order on one stream: {_f(r['searched_serial_step_ms'], '.1f')} ms.",
            "",
            "| row | measured ms | "
            + " | ".join(f"{m} ms (error)" for m in MODELS)
            + f" | comp busy / idle ms: {named} | comm busy / idle ms: {named} |",
            "|---|---|" + "---|" * (len(MODELS) + 2),
        ]
        rows = cast("dict[str, JsonDict]", r["rows"])
        for name, row in rows.items():
            models = cast("dict[str, JsonDict]", row["models"])
            cells = [name, _f(row["measured_step_ms"], ".1f")]
            for m in MODELS:
                mm = models[m]
                cells.append(
                    f"{_f(mm['predicted_step_ms'], '.1f')} ({cast(float, mm['error']):+.1%})"
                )
            for s in ("comp", "comm"):
                parts = [cast("dict[str, JsonDict]", row["measured_streams"])[s]]
                parts += [cast("dict[str, JsonDict]", models[m]["streams"])[s] for m in MODELS]
                cells.append(
                    ", ".join(
                        f"{_f(p['busy_ms'], '.1f')} / {_f(p['idle_ms'], '.1f')}" for p in parts
                    )
                )
            lines.append("| " + " | ".join(cells) + " |")
        for name, row in rows.items():
            by_model = cast("dict[str, JsonDict]", row["models"])
            last = MODELS[-1]
            lines += [
                "",
                f"### {name}: node kinds (mean ms per node)",
                "",
                "| kind | nodes | measured | uncontended | inflation | planner assumed "
                f"| {last} assumed |",
                "|---|---|---|---|---|---|---|",
            ]
            other = {
                cast(str, k["kind"]): k["planner_ms"]
                for k in cast("list[JsonDict]", by_model[last]["kinds"])
            }
            for k in cast("list[JsonDict]", by_model["planner"]["kinds"]):
                lines.append(
                    f"| {k['kind']} | {k['count']} | {_f(k['measured_ms'], '.3f')} | "
                    f"{_f(k['uncontended_ms'], '.3f')} | {_f(k['inflation'], '.3f')} | "
                    f"{_f(k['planner_ms'], '.3f')} | {_f(other.get(cast(str, k['kind'])), '.3f')} |"
                )
            waits_m = cast("dict[str, float]", row["measured_waits"])
            lines += ["", "Idle ms before a node, by what it waited for: measured "]
            lines[-1] += ", ".join(f"{k} {v:.1f}" for k, v in waits_m.items()) or "none"
            for m in MODELS:
                w = cast("dict[str, float]", cast("dict[str, JsonDict]", row["models"])[m]["waits"])
                lines[-1] += f"; {m} " + (", ".join(f"{k} {v:.1f}" for k, v in w.items()) or "none")
            alloc = {k: v for k, v in cast("dict[str, int]", row["allocator"]).items() if v}
            lines += [
                "",
                "Allocator events over the recorded steps: "
                + (", ".join(f"{k} {v}" for k, v in sorted(alloc.items())) or "none"),
            ]
            for m in MODELS:
                mm = cast("dict[str, JsonDict]", row["models"])[m]
                d = cast(JsonDict, mm["drift"])
                lines += [
                    "",
                    f"Where {name} drifts most from the {m} timeline (growth: lag at its end less "
                    "that of what it waited for; ms):",
                    "",
                    "| node | start ms measured / predicted | lag | growth (wait + duration) "
                    "| waited for (GPU) | waited for (model) |",
                    "|---|---|---|---|---|---|",
                ]
                for x in cast("list[JsonDict]", d["largest"]):
                    lines.append(
                        f"| {x['node']}@{x['stream']} | {_f(x['measured_start_ms'], '.1f')} / "
                        f"{_f(x['predicted_start_ms'], '.1f')} | {_f(x['lag_ms'], '.1f')} | "
                        f"{_f(x['growth_ms'])} ({_f(x['wait_share_ms'])} + "
                        f"{_f(x['duration_share_ms'])}) | {x['waited_for']} | "
                        f"{x['model_waited_for']} |"
                    )
                missing = cast("list[str]", mm["only_measured"]) + cast(
                    "list[str]", mm["only_predicted"]
                )
                if missing:
                    lines += ["", f"Unmatched nodes ({len(missing)}): {', '.join(missing[:8])}"]
        lines += ["", "Charts: " + ", ".join(Path(p).name for p in cast("list[str]", r["pngs"]))]
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="tiny sizes (CPU smoke run)")
    p.add_argument("--frontier", type=Path, default=FRONTIER)
    p.add_argument("--configs", nargs="*", default=["main N=4"], help="configuration names")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    p.add_argument("--repeats", type=int, default=3, help="recorded rounds (medians)")
    p.add_argument("--top", type=int, default=10, help="nodes listed per drift table")
    p.add_argument("--out", type=Path, help="folder for explain.json/.md, PNGs (required)")
    p.add_argument(
        "--offline",
        type=Path,
        metavar="EXPLAIN_JSON",
        help="recompute the by_kind models from a recorded explain.json (CPU; nothing written)",
    )
    p.add_argument(
        "--fit-from",
        nargs=2,
        metavar=("EXPLAIN_JSON", "CONFIG"),
        help="with --offline: fit the by_kind models on the overlapped row of CONFIG in another "
        "recorded explain.json instead (a prediction out of sample)",
    )
    args = p.parse_args(argv)
    if args.fit_from is not None and args.offline is None:
        p.error("--fit-from: only with --offline")
    if args.offline is not None:
        try:
            recorded = cast(JsonDict, json.loads(cast(Path, args.offline).read_text("utf-8")))
            known = cast(JsonDict, json.loads(args.frontier.read_text("utf-8")))
            fitted_on = None
            if args.fit_from is not None:
                path, config = cast("list[str]", args.fit_from)
                other = cast(JsonDict, json.loads(Path(path).read_text("utf-8")))
                their = cast("list[JsonDict]", other["results"])
                match = [r for r in their if r["name"] == config]
                if not match:
                    names = ", ".join(repr(r["name"]) for r in their)
                    p.error(f"--fit-from: no configuration {config!r} in {path} (it has {names})")
                fitted_on = (f"{config} in {path}", fits_of(match[0]))
            found = offline(recorded, cast("list[JsonDict]", known["configs"]), fitted_on)
        except (OSError, ValueError, KeyError, TypeError) as e:
            p.error(f"--offline: expected an explain.json written by explain_prediction.py: {e}")
        print(offline_markdown(recorded, found))
        return
    if args.out is None:
        p.error("--out: required (or --offline)")
    if args.repeats < 1:
        p.error("--repeats: expected at least 1")
    frontier = cast(JsonDict, json.loads(args.frontier.read_text("utf-8")))
    configs = cast("list[JsonDict]", frontier["configs"])
    chosen = [c for c in configs if c["name"] in args.configs]
    unknown = set(args.configs) - {cast(str, c["name"]) for c in configs}
    if unknown:
        p.error(
            f"--configs: unknown {sorted(unknown)}; the frontier has {[c['name'] for c in configs]}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    contention = cast(float, frontier["comm_contention"])
    results: list[JsonDict] = []
    for c in chosen:
        print(f"explain_prediction: {c['name']} ...", file=sys.stderr, flush=True)
        results.append(explain(c, args, contention))
    given = sys.argv[1:] if argv is None else argv
    doc: JsonDict = {
        "command": "python benchmarks/explain_prediction.py " + shlex.join(given),
        "device": _device(args.device),
        "results": results,
    }
    (args.out / "explain.json").write_text(json.dumps(doc, indent=1) + "\n", "utf-8")
    text = markdown(doc)
    (args.out / "explain.md").write_text(text, "utf-8")
    print(text)
    for r in results:
        for png in cast("list[str]", r["pngs"]):
            print(f"wrote {png}")
    print(f"wrote {args.out / 'explain.json'}")
    print(f"wrote {args.out / 'explain.md'}")


def _device(device: str) -> str:
    if torch.device(device).type == "cuda":
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    return f"CPU (torch {torch.__version__})"


if __name__ == "__main__":
    main()
