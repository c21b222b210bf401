"""Per-node device timing, the critical-path bound and the timeline of a schedule.

:class:`NodeRecorder` is an ``on_plan`` callback: it wraps every node of a plan, per
instance, so each forward / backward / delayed-wgrad / recompute body records a start and an
end event on the stream it runs on. The start is recorded after the node's wait on its
microbatch's event, so a duration is the node's own work, not its wait. Each span also
keeps when the host issued it (the host clock from the same origin).

:func:`critical_path_ms` replays the schedule's step lists (:func:`moe_overlap.steps.chunk_steps`)
with those durations (:func:`moe_overlap.steps.makespan`): a step starts when its stream is
free and the previous step of its microbatch has finished (a delayed weight-gradient step
waits on its stream only); the bound is the sum of each chunk run's makespan (a run ends with
both microbatches joined to the compute stream, so runs do not overlap).
"""

from __future__ import annotations

import importlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeVar, cast

import torch

from moe_overlap import ModelChunkSchedulePlan, NoopScheduleNode, ScheduleNode, TransformerLayerNode
from moe_overlap.steps import (
    ChunkShape,
    Direction,
    Role,
    Slot,
    SlotKey,
    Step,
    StreamKind,
    backward_pair_steps,
    chunk_steps,
    forward_pair_steps,
    makespan,
)

__all__ = [
    "ChunkRun",
    "Clock",
    "NodeKey",
    "NodeRecorder",
    "critical_path_ms",
    "fill_drain_runs",
    "overlapped_runs",
    "pyplot",
    "run_steps",
    "slot_durations",
    "write_chrome_trace",
    "write_gantt_png",
]


_T = TypeVar("_T")

# torch leaves the Event constructor unannotated; type it once, here.
_cuda_event = cast("Callable[..., torch.cuda.Event]", torch.cuda.Event)


class Clock:
    """Timing marks on the current stream: CUDA events on a GPU, the host clock on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self, stream: torch.cuda.Stream | None = None) -> torch.cuda.Event | float:
        """Record a mark on ``stream`` (default: the current stream)."""
        if not self.cuda:
            return time.perf_counter()
        event = _cuda_event(enable_timing=True)
        event.record(stream)
        return event

    @staticmethod
    def ms(start: torch.cuda.Event | float, end: torch.cuda.Event | float) -> float:
        """Milliseconds from ``start`` to ``end`` (after synchronizing, on a GPU)."""
        if isinstance(start, torch.cuda.Event):
            assert isinstance(end, torch.cuda.Event), "marks of one clock"
            elapsed: float = start.elapsed_time(end)
            return elapsed
        assert not isinstance(end, torch.cuda.Event), "marks of one clock"
        return (end - start) * 1e3


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (typed loosely: its stubs are partial)."""
    matplotlib: Any = importlib.import_module("matplotlib")
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")


class NodeKey(NamedTuple):
    """One node execution: microbatch, layer (``None`` for pre/post-process), slot, direction."""

    microbatch: int
    layer: int | None
    slot: Slot
    direction: Direction

    def label(self) -> str:
        layer = "" if self.layer is None else f"L{self.layer}."
        return f"mb{self.microbatch}.{layer}{self.slot.value}.{self.direction.value}"


@dataclass(frozen=True, slots=True)
class NodeSpan:
    """A node execution placed on the timeline, in ms from the step's start; ``issued_ms``:
    when the host issued its start mark, on the host clock from the same origin (``None``:
    not recorded)."""

    key: NodeKey
    stream: StreamKind
    start_ms: float
    end_ms: float
    issued_ms: float | None = None


class _Pending(NamedTuple):
    key: NodeKey
    stream: StreamKind
    start: torch.cuda.Event | float
    end: torch.cuda.Event | float
    issued: float


_COMM_SLOTS = (Slot.DISPATCH, Slot.COMBINE)


class NodeRecorder:
    """An ``on_plan`` callback timing every node of every plan with device events."""

    def __init__(self, device: torch.device) -> None:
        self.clock = Clock(device)
        self.host_origin = time.perf_counter()
        self.origin = self.clock.mark()
        self.pending: list[_Pending] = []
        self.shapes: dict[int, ChunkShape] = {}

    def start(self) -> None:
        """Record the step's time origin on the current (compute) stream (and the host's:
        with the device idle, as after a synchronize, the two clocks start together)."""
        self.host_origin = time.perf_counter()
        self.origin = self.clock.mark()

    def __call__(self, plan: ModelChunkSchedulePlan) -> None:
        mb = plan.microbatch_index
        assert mb is not None, "combined_1f1b numbers its microbatches"
        self.shapes[mb] = plan.shape
        nodes: list[tuple[int | None, Slot, ScheduleNode]] = []
        if plan.pre_process is not None:
            nodes.append((None, Slot.PRE_PROCESS, plan.pre_process))
        for lp in plan.layers:
            nodes += [(lp.index, slot, node) for slot, node in lp.nodes.items()]
        if plan.post_process is not None:
            nodes.append((None, Slot.POST_PROCESS, plan.post_process))
        for layer, slot, node in nodes:
            if not isinstance(node, NoopScheduleNode):
                self._wrap(node, mb, layer, slot)

    def _timed(self, key: NodeKey, stream: StreamKind, body: Callable[[], _T]) -> _T:
        issued = time.perf_counter()
        start = self.clock.mark()
        out = body()
        end = self.clock.mark()
        self.pending.append(_Pending(key, stream, start, end, issued))
        return out

    def _wrap(self, node: ScheduleNode, mb: int, layer: int | None, slot: Slot) -> None:
        stream = StreamKind.COMM if slot in _COMM_SLOTS else StreamKind.COMP
        fwd, bwd = node.forward_func, node.backward_impl
        f_key = NodeKey(mb, layer, slot, Direction.FORWARD)
        b_key = NodeKey(mb, layer, slot, Direction.BACKWARD)
        forwarding = [False]  # inside the forward: its forward_impl call is not a recompute

        def forward_func(*args: torch.Tensor | None) -> torch.Tensor | tuple[torch.Tensor, ...]:
            forwarding[0] = True
            try:
                return self._timed(f_key, stream, lambda: fwd(*args))
            finally:
                forwarding[0] = False

        def backward_impl(
            outputs: tuple[torch.Tensor, ...], grads: tuple[torch.Tensor | None, ...]
        ) -> None:
            self._timed(b_key, stream, lambda: bwd(outputs, grads))

        # Per-instance overrides: the node calls these inside its stream context, after
        # waiting on its microbatch's event.
        node.forward_func = forward_func
        setattr(node, "backward_impl", backward_impl)  # noqa: B010 - a method, per instance
        if isinstance(node, TransformerLayerNode) and node.delay_wgrad_compute:
            dw = node.backward_dw
            w_key = NodeKey(mb, layer, slot, Direction.WGRAD)
            setattr(node, "backward_dw", lambda: self._timed(w_key, stream, dw))  # noqa: B010
        if isinstance(node, TransformerLayerNode) and node.recomputes:
            # A recompute step (R) runs the slot's forward_impl again on the node's stream,
            # after its event wait: timed there, unless the forward itself is calling it.
            impl = node.forward_impl
            r_key = NodeKey(mb, layer, slot, Direction.RECOMPUTE)

            def forward_impl(*args: torch.Tensor | None) -> torch.Tensor | tuple[torch.Tensor, ...]:
                if forwarding[0]:
                    return impl(*args)
                return self._timed(r_key, stream, lambda: impl(*args))

            setattr(node, "forward_impl", forward_impl)  # noqa: B010 - a method, per instance

    def spans(self) -> list[NodeSpan]:
        """The recorded node executions (call after synchronizing)."""
        return [
            NodeSpan(
                p.key,
                p.stream,
                Clock.ms(self.origin, p.start),
                Clock.ms(self.origin, p.end),
                (p.issued - self.host_origin) * 1e3,
            )
            for p in self.pending
        ]

    def durations(self) -> dict[NodeKey, float]:
        """Milliseconds of each node execution (call after synchronizing)."""
        return {s.key: s.end_ms - s.start_ms for s in self.spans()}


class ChunkRun(NamedTuple):
    """One ``ModelChunkSchedulePlan.run``: the forward and the backward microbatch; or one
    ``run_pair``: two forwards (``f``, ``f2``) or two backwards (``b``, ``b2``)."""

    f: int | None
    b: int | None
    f2: int | None = None
    b2: int | None = None


def overlapped_runs(n: int) -> list[ChunkRun]:
    """``F0 | F1+B0 | ... | F(n-1)+B(n-2) | B(n-1)``, as ``combined_1f1b`` runs them."""
    return [ChunkRun(0, None), *(ChunkRun(i, i - 1) for i in range(1, n)), ChunkRun(None, n - 1)]


def fill_drain_runs(n: int) -> list[ChunkRun]:
    """``F0+F1 | F2+B0 | ... | F(n-1)+B(n-3) | B(n-2)+B(n-1)``: ``fill_drain=True``."""
    if n < 2:
        return overlapped_runs(n)
    steady = [ChunkRun(i, i - 2) for i in range(2, n)]
    return [ChunkRun(0, None, f2=1), *steady, ChunkRun(None, n - 2, b2=n - 1)]


def run_steps(run: ChunkRun, shapes: dict[int, ChunkShape]) -> list[Step]:
    """The steps of one chunk run, as the plans walk them."""
    if run.f2 is not None:
        assert run.f is not None
        return forward_pair_steps(shapes[run.f], shapes[run.f2])
    if run.b2 is not None:
        assert run.b is not None
        return backward_pair_steps(shapes[run.b], shapes[run.b2])
    f_shape = shapes[run.f] if run.f is not None else None
    b_shape = shapes[run.b] if run.b is not None else None
    return chunk_steps(f_shape, b_shape)


def critical_path_ms(
    runs: Sequence[ChunkRun],
    shapes: dict[int, ChunkShape],
    durations: dict[NodeKey, float],
) -> float:
    """Sum over chunk runs of the makespan (:func:`moe_overlap.steps.makespan`) of the
    run's steps with the given durations."""
    total = 0.0
    for run in runs:
        which: dict[Role | None, int | None] = {
            Role.F: run.f,
            Role.B: run.b,
            Role.F2: run.f2,
            Role.B2: run.b2,
        }

        def duration(step: Step, which: dict[Role | None, int | None] = which) -> float:
            mb, slot = which[step.role], step.slot
            assert mb is not None
            assert slot is not None
            return durations.get(NodeKey(mb, step.layer, slot, step.direction), 0.0)

        total += makespan(run_steps(run, shapes), duration)
    return total


def slot_durations(durations: dict[NodeKey, float]) -> dict[SlotKey, float]:
    """Mean duration of each ``(layer, slot, direction)`` over the microbatches."""
    sums: dict[SlotKey, list[float]] = {}
    for key, ms in durations.items():
        sums.setdefault((key.layer, key.slot, key.direction), []).append(ms)
    return {k: sum(v) / len(v) for k, v in sums.items()}


def write_chrome_trace(spans: Sequence[NodeSpan], path: Path, *, title: str) -> None:
    """A Perfetto / chrome://tracing file: one track per stream, one slice per node."""
    tid = {StreamKind.COMP: 1, StreamKind.COMM: 2}
    events: list[dict[str, object]] = [
        {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": title}},
        *(
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": t, "args": {"name": f"{k.value}"}}
            for k, t in tid.items()
        ),
    ]
    for s in spans:
        events.append(
            {
                "name": s.key.label(),
                "cat": s.key.direction.value,
                "ph": "X",
                "ts": round(s.start_ms * 1e3, 3),
                "dur": round((s.end_ms - s.start_ms) * 1e3, 3),
                "pid": 0,
                "tid": tid[s.stream],
            }
        )
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))


def write_gantt_png(
    spans: Sequence[NodeSpan],
    path: Path,
    *,
    title: str,
    compare: Sequence[NodeSpan] | None = None,
    labels: tuple[str, str] = ("measured", "predicted"),
) -> None:
    """A per-stream Gantt chart titled ``title``: forward slots blue, backward orange, weight
    gradients green, recomputes purple (a legend says so), one row per stream; with
    ``compare``, its two rows under ``spans``' (``labels`` name the two timelines)."""
    plt = pyplot()
    colors = {
        Direction.FORWARD: "#4C78A8",
        Direction.BACKWARD: "#F58518",
        Direction.WGRAD: "#54A24B",
        Direction.RECOMPUTE: "#B279A2",
    }
    timelines = [(spans, 2 if compare is not None else 0)]
    if compare is not None:
        timelines.append((compare, 0))
    fig, ax = plt.subplots(figsize=(16, 3.2 if compare is None else 5.0))
    longest = max((x.end_ms for group, _ in timelines for x in group), default=1.0)
    for group, base in timelines:
        rows = {StreamKind.COMP: base + 1, StreamKind.COMM: base}
        for s in group:
            ax.broken_barh(
                [(s.start_ms, s.end_ms - s.start_ms)],
                (rows[s.stream] - 0.4, 0.8),
                facecolors=colors.get(s.key.direction, "#999999"),
                edgecolors="black",
                linewidth=0.3,
            )
            if s.end_ms - s.start_ms > 0.02 * longest:
                ax.text(
                    (s.start_ms + s.end_ms) / 2,
                    rows[s.stream],
                    f"{s.key.microbatch}{s.key.slot.value[:3]}{s.key.direction.value}",
                    ha="center",
                    va="center",
                    fontsize=6,
                )
    if compare is None:
        ax.set_yticks([0, 1], ["comm stream", "comp stream"])
    else:
        ticks = [f"{labels[1]} comm", f"{labels[1]} comp", f"{labels[0]} comm"]
        ax.set_yticks([0, 1, 2, 3], [*ticks, f"{labels[0]} comp"])
    ax.set_xlabel("time from the step's start (ms); bars: microbatch, slot, F/B/W/R")
    ax.set_title(title)
    patches: Any = importlib.import_module("matplotlib.patches")
    names = {Direction.FORWARD: "forward", Direction.BACKWARD: "backward"}
    names[Direction.WGRAD] = "weight gradient"
    shown = {s.key.direction for group, _ in timelines for s in group}
    if Direction.RECOMPUTE in shown:
        names[Direction.RECOMPUTE] = "recompute"
    handles = [
        patches.Patch(facecolor=colors[d], edgecolor="black", label=n) for d, n in names.items()
    ]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
