"""The stream model's hooks: what watches the CPU streams order work, and what delays the
CUDA streams.

On CPU the schedule's streams run one after another, and the model (:mod:`._streams`) does
nothing but tell an observer what a GPU would order: each wait, record, host
synchronization, stream switch and release. The stream-order checker
(:func:`~moe_overlap.streams.stream_order_check`) attaches itself here while it is active;
the last one attached is told. On CUDA, each node's stream entry and each stream switch
calls the last attached delay (race shaking, :func:`~moe_overlap.streams.shake`). With none
attached, each call site costs one empty-list test.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import Tensor

__all__ = ["CpuStreamObserver", "StreamDelay", "delays", "observers"]


@runtime_checkable
class CpuStreamObserver(Protocol):
    """What the CPU stream model tells; ``stream`` is a :class:`~moe_overlap.streams.CpuStream`
    and a clock maps a stream's id to its position."""

    def current(self) -> object: ...
    def enter(self, stream: object) -> None: ...
    def exit(self) -> None: ...
    def snapshot(self, stream: object) -> dict[int, int]: ...
    def join(self, stream: object, clock: dict[int, int] | None) -> None: ...
    def join_stream(self, stream: object, other: object) -> None: ...
    def host_sync(self, clock: dict[int, int] | None = None) -> None: ...
    def record_stream(self, tensor: Tensor, stream: object) -> None: ...
    def release(self, tensor: Tensor) -> None: ...


observers: list[CpuStreamObserver] = []
"""The attached observers, the one told last (mutated in place, never rebound)."""


@runtime_checkable
class StreamDelay(Protocol):
    """What delays a CUDA stream at a node boundary (queues work on the current stream)."""

    def delay(self) -> None: ...


delays: list[StreamDelay] = []
"""The attached delays, the one called last (mutated in place, never rebound)."""
