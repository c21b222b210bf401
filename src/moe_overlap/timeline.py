"""Record which schedule node ran when, on which stream; write Chrome traces and PNGs.

Uses the public API only: pass a :class:`Timeline` as ``combined_1f1b(..., on_plan=...)``
and it wraps each plan's nodes (``forward``, ``backward``, ``backward_dw``) with timing
events, per instance. On CUDA the times come from CUDA events on the node's own stream
(taken after the node's dependencies are met), on CPU from the host clock. matplotlib is
imported only by :meth:`Timeline.to_png`.
"""

from __future__ import annotations

import json
import os
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, cast

import torch

from moe_overlap import (
    CpuEvent,
    CpuStream,
    Direction,
    ModelChunkSchedulePlan,
    NoopScheduleNode,
    ScheduleNode,
    Slot,
    StreamError,
    StreamKind,
    TransformerLayerNode,
    weak_method,
)

__all__ = ["Span", "Timeline"]

_Method = Callable[..., object]
_Stream = torch.cuda.Stream | CpuStream


@dataclass(frozen=True, slots=True, kw_only=True)
class Span:
    """One node run: what ran, on which stream, and when (milliseconds from the origin).

    ``start_ms``/``end_ms`` are device times (the host clock on CPU); ``host_*`` are the
    host times spent issuing the work.
    """

    microbatch: int | None
    layer: int | None
    slot: Slot
    direction: Direction
    stream: StreamKind
    start_ms: float
    end_ms: float
    host_start_ms: float
    host_end_ms: float

    @property
    def duration_ms(self) -> float:
        return self.end_ms - self.start_ms

    @property
    def label(self) -> str:
        """E.g. ``mb1.L2.dispatch.F``."""
        layer = "" if self.layer is None else f"L{self.layer}."
        return f"mb{self.microbatch}.{layer}{self.slot.value}.{self.direction.value}"


@dataclass(slots=True)
class _Pending:
    microbatch: int | None
    layer: int | None
    slot: Slot
    direction: Direction
    stream: StreamKind
    start: torch.cuda.Event | float
    end: torch.cuda.Event | float
    host_start: float
    host_end: float


class Timeline:
    """Timing recorder for schedule nodes; an ``on_plan`` callback.

    Call it on every plan of the step to record (``combined_1f1b(..., on_plan=timeline)``);
    read :meth:`spans` after the step. ``rank`` becomes the trace's process id.
    """

    def __init__(self, *, rank: int = 0) -> None:
        self.rank = rank
        self._pending: list[_Pending] = []
        self._origin_host = time.perf_counter()
        self._origin_device: torch.cuda.Event | None = None
        self._started = False

    def __call__(self, plan: ModelChunkSchedulePlan) -> None:
        self.attach(plan)

    def attach(self, plan: ModelChunkSchedulePlan) -> None:
        """Instrument every node of ``plan`` (no-op nodes of dense layers excepted)."""
        comm = plan.streams.comm
        if not self._started:  # the clock starts with the first plan
            self._started = True
            self._origin_host = time.perf_counter()
            if not isinstance(comm, CpuStream):
                origin = _cuda_event()
                origin.record(torch.cuda.current_stream(comm.device))
                self._origin_device = origin
        mb = plan.microbatch
        if plan.pre_process is not None:
            self._wrap(plan.pre_process, mb, None, Slot.PRE_PROCESS, StreamKind.COMP)
        if plan.post_process is not None:
            self._wrap(plan.post_process, mb, None, Slot.POST_PROCESS, StreamKind.COMP)
        for lp in plan.layers:
            for slot, node in lp.nodes.items():
                if isinstance(node, NoopScheduleNode):
                    continue
                kind = StreamKind.COMM if node.stream() is comm else StreamKind.COMP
                self._wrap(node, mb, lp.index, slot, kind)

    def _wrap(
        self,
        node: ScheduleNode,
        mb: int | None,
        layer: int | None,
        slot: Slot,
        kind: StreamKind,
    ) -> None:
        # The wrapper is stored on the node, so it may hold the node only weakly (and its
        # bound method through weak_method): a strong reference would be a cycle that keeps
        # every instrumented node alive until the cyclic collector runs.
        node_ref = weakref.ref(node)

        def timed(name: str, direction: Direction, wait: bool) -> None:
            original: _Method = weak_method(getattr(node, name))

            def run(*args: object) -> object:
                owner = node_ref()
                assert owner is not None, "a node's wrapper outlived its node"
                stream = owner.stream()
                if wait:
                    _wait(owner, stream)
                host_start = time.perf_counter()
                start = _mark(stream)
                out = original(*args)
                end = _mark(stream)
                host_end = time.perf_counter()
                self._pending.append(
                    _Pending(mb, layer, slot, direction, kind, start, end, host_start, host_end)
                )
                return out

            _override(node, name, run)

        timed("forward", Direction.FORWARD, True)
        timed("backward", Direction.BACKWARD, True)
        if isinstance(node, TransformerLayerNode) and node.delay_wgrad_compute:
            timed("backward_dw", Direction.WGRAD, False)

    def spans(self) -> list[Span]:
        """The recorded spans, in issue order (synchronizes the GPU first)."""
        origin = self._origin_device
        if origin is not None:
            torch.cuda.synchronize()
        out: list[Span] = []
        for p in self._pending:
            out.append(
                Span(
                    microbatch=p.microbatch,
                    layer=p.layer,
                    slot=p.slot,
                    direction=p.direction,
                    stream=p.stream,
                    start_ms=self._device_ms(p.start),
                    end_ms=self._device_ms(p.end),
                    host_start_ms=(p.host_start - self._origin_host) * 1e3,
                    host_end_ms=(p.host_end - self._origin_host) * 1e3,
                )
            )
        return out

    def _device_ms(self, mark: torch.cuda.Event | float) -> float:
        if isinstance(mark, torch.cuda.Event):
            origin = self._origin_device
            assert origin is not None, "a CUDA mark without a CUDA origin"
            return float(origin.elapsed_time(mark))
        return (mark - self._origin_host) * 1e3

    def clear(self) -> None:
        """Forget the recorded spans and restart the clock."""
        self._pending.clear()
        self._origin_host = time.perf_counter()
        self._origin_device = None
        self._started = False

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

    def to_png(self, path: str | os.PathLike[str], *, title: str = "combined 1F1B") -> None:
        """Draw the spans as a Gantt chart, one row per stream (needs matplotlib)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        colors = {Direction.FORWARD: "#4c78a8", Direction.BACKWARD: "#f58518"}
        colors[Direction.WGRAD] = "#54a24b"
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
        ax.set_yticks([0, 1], ["comm", "comp"])
        ax.set_xlabel("ms")
        ax.set_title(f"{title}: forward (blue), backward (orange), wgrad (green)")
        fig.tight_layout()
        fig.savefig(path, dpi=150)
        plt.close(fig_any)


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


class _Figure(Protocol):
    """The part of matplotlib's ``Figure`` we use."""

    def tight_layout(self) -> None: ...
    def savefig(self, fname: str | os.PathLike[str], *, dpi: float) -> None: ...


def _cuda_event() -> torch.cuda.Event:
    return _new_timing_event(enable_timing=True)


# torch leaves the constructor unannotated; give it a type once, here.
_new_timing_event: Callable[..., torch.cuda.Event] = torch.cuda.Event


def _mark(stream: _Stream) -> torch.cuda.Event | float:
    if isinstance(stream, CpuStream):
        return time.perf_counter()
    event = _cuda_event()
    event.record(stream)
    return event


def _wait(node: ScheduleNode, stream: _Stream) -> None:
    """Wait for the node's dependencies now, so the start mark excludes the wait.

    The node waits on the same event itself right after; waiting twice changes nothing.
    """
    event = node.event
    if isinstance(stream, CpuStream):
        return
    if isinstance(event, CpuEvent):
        raise StreamError(f"Timeline: node {node.name!r} has a CPU event on {stream!r}")
    event.wait(stream)


def _override(obj: object, name: str, fn: _Method) -> None:
    """Shadow method ``name`` on this one instance (instrumentation, not a new behaviour)."""
    setattr(obj, name, fn)
