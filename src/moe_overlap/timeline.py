"""Record which schedule step ran when, on which stream; write Chrome traces and PNGs.

A :class:`Timeline` is a :class:`~moe_overlap.steps.StepObserver`: pass it as
``combined_1f1b(..., observer=timeline)`` (or ``ModelChunkSchedulePlan.run(...,
observer=timeline)``) and each node step gets a timer that marks the start and the end of
the node's body on the node's own stream, after the node's wait on its microbatch's event.
On CUDA the marks are timing events, on CPU the host clock. Each span is keyed by its
:class:`~moe_overlap.steps.Step` (role, layer, slot, direction, stream): the same step lists the
runner walks. matplotlib is imported only by :meth:`Timeline.to_png`.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar, cast

import torch

from moe_overlap.args import NON_NEGATIVE, check_arg
from moe_overlap.errors import ConfigError
from moe_overlap.steps import Direction, NodeTimer, Role, Slot, SlotKey, Step, StreamKind
from moe_overlap.streams import CpuStream

__all__ = ["Span", "Timeline"]

_Stream = torch.cuda.Stream | CpuStream
_Mark = torch.cuda.Event | float
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True, kw_only=True)
class Span:
    """One step run: which step, of which microbatch, and when (milliseconds from the origin).

    ``start_ms``/``end_ms`` are device times (the host clock on CPU); ``host_*`` are the
    host times spent issuing the work. The origin is the start of the first timed step.
    """

    step: Step
    microbatch: int | None
    start_ms: float
    end_ms: float
    host_start_ms: float
    host_end_ms: float

    @property
    def role(self) -> Role | None:
        """The step's role in a paired run; ``None`` for a node schedule's steps, which
        name their microbatch instead (:class:`~moe_overlap.steps.NodeSchedule`)."""
        return self.step.role

    @property
    def layer(self) -> int | None:
        return self.step.layer

    @property
    def slot(self) -> Slot:
        return _given(self.step.slot, self.step)

    @property
    def direction(self) -> Direction:
        return self.step.direction

    @property
    def stream(self) -> StreamKind:
        return _given(self.step.stream, self.step)

    @property
    def duration_ms(self) -> float:
        return self.end_ms - self.start_ms

    @property
    def label(self) -> str:
        """E.g. ``mb1.L2.dispatch.F``."""
        layer = "" if self.layer is None else f"L{self.layer}."
        return f"mb{self.microbatch}.{layer}{self.slot.value}.{self.direction.value}"


def _given(value: _T | None, step: Step) -> _T:
    """A node step's slot or stream (a span's step always has them)."""
    if value is None:
        raise ConfigError(
            f"Span: expected a node step with a slot and a stream (e.g. "
            f"'f.L0.mlp.F@comp'), received {step}"
        )
    return value


@dataclass(frozen=True, slots=True)
class _Record:
    step: Step
    microbatch: int | None
    start: _Mark
    end: _Mark
    host_start: float
    host_end: float


@dataclass(slots=True)
class _Clock:
    """The origin of a timeline's times; started by the first timed step."""

    host: float
    device: torch.cuda.Event | None = None
    started: bool = False

    def begin(self, stream: _Stream) -> None:
        if self.started:
            return
        self.started = True
        self.host = time.perf_counter()
        if not isinstance(stream, CpuStream):
            origin = _cuda_event()
            origin.record(stream)
            self.device = origin


class _StepTimer:
    """The :class:`~moe_overlap.steps.NodeTimer` of one step: marks it and keeps the record.

    It holds the timeline's clock and record list, never the timeline nor itself through
    them, so it creates no reference cycle.
    """

    __slots__ = ("_clock", "_host_start", "_microbatch", "_records", "_start", "_step")

    def __init__(
        self, clock: _Clock, records: list[_Record], step: Step, microbatch: int | None
    ) -> None:
        self._clock = clock
        self._records = records
        self._step = step
        self._microbatch = microbatch
        self._start: _Mark | None = None
        self._host_start = 0.0

    def start(self, stream: _Stream) -> None:
        self._clock.begin(stream)
        self._host_start = time.perf_counter()
        self._start = _mark(stream)

    def stop(self, stream: _Stream) -> None:
        start = self._start
        assert start is not None, f"timer of step {self._step}: stop without start"
        end = _mark(stream)
        host_end = time.perf_counter()
        self._records.append(
            _Record(self._step, self._microbatch, start, end, self._host_start, host_end)
        )
        self._start = None


class Timeline:
    """Timing recorder for schedule steps; a :class:`~moe_overlap.steps.StepObserver`.

    Pass it as ``combined_1f1b(..., observer=timeline)`` for the steps to record; read
    :meth:`spans` after the step. ``rank`` (an int >= 0) becomes the trace's process id.
    """

    def __init__(self, *, rank: int = 0) -> None:
        # Written into the trace as it is: a bool, str or float made a trace with a bogus pid.
        self.rank = check_arg("Timeline", "rank", rank, NON_NEGATIVE)
        self._records: list[_Record] = []
        self._clock = _Clock(time.perf_counter())

    def timer(self, step: Step, microbatch: int | None) -> NodeTimer:
        """A timer for one run of ``step`` (the :class:`~moe_overlap.steps.StepObserver` method)."""
        return _StepTimer(self._clock, self._records, step, microbatch)

    def spans(self) -> list[Span]:
        """The recorded spans, in the order their steps ran (synchronizes the GPU first)."""
        if self._clock.device is not None:
            torch.cuda.synchronize()
        return [
            Span(
                step=r.step,
                microbatch=r.microbatch,
                start_ms=self._device_ms(r.start),
                end_ms=self._device_ms(r.end),
                host_start_ms=(r.host_start - self._clock.host) * 1e3,
                host_end_ms=(r.host_end - self._clock.host) * 1e3,
            )
            for r in self._records
        ]

    def slot_durations(self) -> dict[SlotKey, float]:
        """Mean milliseconds of each ``(layer, slot, direction)`` over the recorded
        microbatches: what :func:`~moe_overlap.steps.search_order` and
        :func:`~moe_overlap.steps.predict_ms` take (record a serial step for durations
        without overlap)."""
        sums: dict[SlotKey, list[float]] = {}
        for s in self.spans():
            if s.direction is Direction.HOOK:
                continue
            sums.setdefault((s.layer, s.slot, s.direction), []).append(s.duration_ms)
        return {key: sum(v) / len(v) for key, v in sums.items()}

    def _device_ms(self, mark: _Mark) -> float:
        if isinstance(mark, torch.cuda.Event):
            origin = self._clock.device
            assert origin is not None, "a CUDA mark without a CUDA origin"
            return float(origin.elapsed_time(mark))
        return (mark - self._clock.host) * 1e3

    def clear(self) -> None:
        """Forget the recorded spans; the next timed step restarts the clock."""
        self._records.clear()
        clock = self._clock
        clock.host = time.perf_counter()
        clock.device = None
        clock.started = False

    def to_chrome_trace(self, path: str | os.PathLike[str]) -> None:
        """Write the spans as Chrome-trace JSON (chrome://tracing, Perfetto)."""
        events: list[dict[str, object]] = []
        pid = self.rank
        for tid, kind in enumerate((StreamKind.COMP, StreamKind.COMM)):
            events.append(
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": pid,
                    "tid": tid,
                    "args": {"name": f"{kind.value} stream"},
                }
            )
        tids = {StreamKind.COMP: 0, StreamKind.COMM: 1, StreamKind.HOST: 2}
        for s in self.spans():
            events.append(
                {
                    "name": s.label,
                    "cat": s.direction.name.lower(),
                    "ph": "X",
                    "ts": s.start_ms * 1e3,
                    "dur": max(s.duration_ms * 1e3, 0.001),
                    "pid": pid,
                    "tid": tids[s.stream],
                    "args": {
                        "step": str(s.step),
                        "microbatch": s.microbatch,
                        "layer": s.layer,
                        "slot": s.slot.value,
                        "direction": s.direction.name.lower(),
                        "host_start_ms": s.host_start_ms,
                        "host_end_ms": s.host_end_ms,
                    },
                }
            )
        Path(path).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))

    def overlap_ms(self) -> float:
        """Milliseconds during which both streams ran a step: the time the comm stream's
        steps were hidden under the compute stream's. 0 on CPU, where the stand-in
        streams run one step after another."""
        spans = self.spans()
        comp = _union([(s.start_ms, s.end_ms) for s in spans if s.stream is StreamKind.COMP])
        comm = _union([(s.start_ms, s.end_ms) for s in spans if s.stream is StreamKind.COMM])
        total, i, j = 0.0, 0, 0
        while i < len(comp) and j < len(comm):
            total += max(0.0, min(comp[i][1], comm[j][1]) - max(comp[i][0], comm[j][0]))
            if comp[i][1] < comm[j][1]:
                i += 1
            else:
                j += 1
        return total

    def to_png(self, path: str | os.PathLike[str], *, title: str = "combined 1F1B") -> None:
        """Draw the spans as a Gantt chart, one row per stream, with ``title`` above it and
        a legend of the directions (needs matplotlib: ``pip install 'moe-overlap[demo]'``;
        without it :class:`~moe_overlap.ConfigError`, before anything is written)."""
        try:
            import matplotlib
            from matplotlib.patches import Patch
        except ImportError:
            raise ConfigError(
                f"Timeline.to_png({str(path)!r}): needs matplotlib, which is not installed; "
                "pip install 'moe-overlap[demo]', or write Timeline.to_chrome_trace and open "
                "it in Perfetto"
            ) from None

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = {
            Direction.FORWARD: "forward",
            Direction.BACKWARD: "backward",
            Direction.WGRAD: "weight gradient",
            Direction.RECOMPUTE: "recompute",
        }
        colors = {Direction.FORWARD: "#4c78a8", Direction.BACKWARD: "#f58518"}
        colors[Direction.WGRAD] = "#54a24b"
        colors[Direction.RECOMPUTE] = "#b279a2"
        rows = {StreamKind.COMP: 1, StreamKind.COMM: 0}
        spans = self.spans()
        fig_any, ax_any = plt.subplots(figsize=(16, 3.2))
        fig, ax = cast(_Figure, fig_any), cast(_Axes, ax_any)
        end = max((s.end_ms for s in spans), default=1.0)
        start = min((s.start_ms for s in spans), default=0.0)
        min_width = (end - start) * 1e-3
        for s in spans:
            y = rows.get(s.stream, 0)
            ax.broken_barh(
                [(s.start_ms, max(s.duration_ms, min_width))],
                (y - 0.4, 0.8),
                facecolors=colors.get(s.direction, "grey"),
                edgecolors="black",
                linewidth=0.3,
            )
            if s.duration_ms > (end - start) / 60:
                ax.text(
                    s.start_ms + s.duration_ms / 2,
                    y,
                    s.label.removeprefix("mb"),
                    ha="center",
                    va="center",
                    fontsize=5,
                    rotation=90,
                )
        ax.set_yticks([0, 1], ["comm stream", "compute stream"])
        ax.set_xlabel("time from the first step's start (ms); bars: microbatch.layer.slot.F/B/W")
        ax.set_title(title)
        handles = [Patch(facecolor=colors[d], edgecolor="black", label=n) for d, n in names.items()]
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=150)
        plt.close(fig_any)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """``intervals`` merged where they touch or overlap, in order."""
    merged: list[tuple[float, float]] = []
    for lo, hi in sorted(intervals):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


class _Axes(Protocol):
    """The part of matplotlib's ``Axes`` we draw with (its stubs leave ``**kwargs`` untyped)."""

    def broken_barh(
        self,
        xranges: Sequence[tuple[float, float]],
        yrange: tuple[float, float],
        *,
        facecolors: str,
        edgecolors: str,
        linewidth: float,
    ) -> object: ...
    def text(
        self, x: float, y: float, s: str, *, ha: str, va: str, fontsize: float, rotation: float
    ) -> object: ...
    def set_yticks(self, ticks: Sequence[float], labels: Sequence[str]) -> object: ...
    def set_xlabel(self, xlabel: str) -> object: ...
    def set_title(self, label: str) -> object: ...
    def legend(
        self,
        *,
        handles: Sequence[object],
        loc: str,
        bbox_to_anchor: tuple[float, float],
        fontsize: float,
    ) -> object: ...


class _Figure(Protocol):
    """The part of matplotlib's ``Figure`` we use."""

    def tight_layout(self) -> None: ...
    def savefig(self, fname: str | os.PathLike[str], *, dpi: float) -> None: ...


def _cuda_event() -> torch.cuda.Event:
    return _new_timing_event(enable_timing=True)


# torch leaves the constructor unannotated; give it a type once, here.
_new_timing_event: Callable[..., torch.cuda.Event] = torch.cuda.Event


def _mark(stream: _Stream) -> _Mark:
    if isinstance(stream, CpuStream):
        return time.perf_counter()
    event = _cuda_event()
    event.record(stream)
    return event
