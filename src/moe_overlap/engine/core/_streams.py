"""Streams and events for CUDA and CPU.

On CUDA the compute stream is the current stream and the communication stream is a
dedicated one. On CPU every stream and event is a :class:`~moe_overlap.streams.CpuStream` / :class:`~moe_overlap.streams.CpuEvent`:
objects with the methods the schedule calls that do nothing (CPU work is already ordered),
so the whole schedule runs, exactly, on a laptop.

Streams can be passed explicitly (a :class:`~moe_overlap.StreamPair`) or, for code ported from
Megatron-Core, taken from each device's defaults (:data:`default_pairs`). Making streams and
events for a device a caller names, and setting its defaults, checks that device first:
``engine/_stream_setup.py`` (:func:`~moe_overlap.make_streams`,
:func:`~moe_overlap.set_streams`, ...); the core takes devices already checked.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from types import TracebackType
from typing import Union, cast

import torch

from moe_overlap.args import BOOL, Instance, check_arg
from moe_overlap.errors import StreamError

from ._arguments import on_arguments
from ._stream_observer import delays as _SHAKING
from ._stream_observer import observers as _CHECKING

# torch's own calls under torch.cuda.current_stream / set_stream (None in CPU-only builds,
# where no CUDA stream can exist), module globals here so the per-node switch reads them
# as before (and a test can fake them).
from ._torch_private import cuda_current_device as _cuda_current_device
from ._torch_private import cuda_current_stream as _cuda_current_stream
from ._torch_private import cuda_set_stream as _cuda_set_stream

__all__ = [
    "AnyEvent",
    "AnyStream",
    "CpuEvent",
    "CpuStream",
    "StreamPair",
    "abandon_stream",
    "cpu_default_stream",
    "current_stream",
    "default_pairs",
    "device_key",
    "device_streams",
    "enter_stream",
    "leave_stream",
    "leave_stream_unrecorded",
    "leave_switch",
    "new_event",
    "pair_error",
    "record_event",
    "record_tensor_on",
    "release_storage",
    "stream_context",
    "stream_device",
    "synchronize",
    "wait_event",
]


class CpuStream:
    """A no-op stream for CPU runs, with the methods of ``torch.cuda.Stream`` the schedule uses.

    Under the stream-order checker (:func:`~moe_overlap.streams.stream_order_check`) its
    waits and synchronizations order work as a CUDA stream's do.
    """

    __slots__ = ("name",)

    def __init__(self, name: str = "cpu") -> None:
        self.name = check_arg("CpuStream", "name", name, _NAME)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def wait_event(self, event: CpuEvent) -> None:
        """CPU work is ordered already: nothing to wait for (the checker records it)."""
        event.wait(self)

    def wait_stream(self, stream: CpuStream) -> None:
        """CPU work is ordered already: nothing to wait for (the checker records it)."""
        if _CHECKING:
            _CHECKING[-1].join_stream(self, stream)

    def record_event(self, event: CpuEvent | None = None) -> CpuEvent:
        """Record ``event`` (a new one when ``None``) and return it."""
        event = CpuEvent() if event is None else event
        event.record(self)
        return event

    def synchronize(self) -> None:
        """Nothing is in flight on the CPU (the checker records the host wait)."""
        if _CHECKING:
            _CHECKING[-1].host_sync(_CHECKING[-1].snapshot(self))

    def query(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"CpuStream({self.name!r})"


class CpuEvent:
    """A no-op event for CPU runs; ``record`` keeps a host timestamp so CPU timelines work."""

    __slots__ = ("_clock", "_time")

    def __init__(self, enable_timing: bool = False) -> None:
        if enable_timing.__class__ is not bool:  # inline: made for every no-op node
            check_arg("CpuEvent", "enable_timing", enable_timing, BOOL)  # always timed anyway
        self._time: float | None = None
        self._clock: dict[int, int] | None = None  # the checker's, when it runs

    def record(self, stream: CpuStream | None = None) -> None:
        self._time = time.perf_counter()
        if _CHECKING:
            checker = _CHECKING[-1]
            self._clock = checker.snapshot(stream if stream is not None else checker.current())

    def wait(self, stream: CpuStream | None = None) -> None:
        if _CHECKING:
            checker = _CHECKING[-1]
            checker.join(stream if stream is not None else checker.current(), self._clock)

    def synchronize(self) -> None:
        """Nothing is in flight on the CPU (the checker records the host wait)."""
        if _CHECKING:
            _CHECKING[-1].host_sync(self._clock or {})

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event: CpuEvent) -> float:
        """Milliseconds from this event's record to ``end_event``'s, like ``torch.cuda.Event``."""
        if self._time is None or end_event._time is None:
            raise StreamError(
                "CpuEvent.elapsed_time: both events must be recorded first "
                f"(start recorded: {self._time is not None}, "
                f"end recorded: {end_event._time is not None}); call record() on both, "
                "the start before the end, then elapsed_time"
            )
        return (end_event._time - self._time) * 1e3


AnyStream = Union[torch.cuda.Stream, CpuStream]  # noqa: UP007 - evaluated at run time on 3.10
AnyEvent = Union[torch.cuda.Event, CpuEvent]  # noqa: UP007


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamPair:
    """The compute and communication streams of one schedule."""

    comp: AnyStream
    comm: AnyStream

    def __post_init__(self) -> None:
        for guard in on_arguments:  # two streams of one device type (moe_overlap.engine._guards)
            guard.arguments("StreamPair", self)

    def comp_provider(self) -> AnyStream:
        """Return the compute stream (a :class:`~moe_overlap.StreamProvider`)."""
        return self.comp

    def comm_provider(self) -> AnyStream:
        """Return the communication stream (a :class:`~moe_overlap.StreamProvider`)."""
        return self.comm

    @property
    def device(self) -> torch.device:
        return stream_device(self.comp)


_NAME = Instance(str, "a str")


def stream_device(stream: AnyStream) -> torch.device:
    """The device type a stream belongs to (``cuda`` or ``cpu``)."""
    if isinstance(stream, CpuStream):
        return torch.device("cpu")
    return torch.device("cuda")


_CPU_DEFAULT = CpuStream("comp")


def cpu_default_stream() -> CpuStream:
    """The CPU's stand-in for CUDA's default stream: the compute stream of every pair
    :func:`make_streams` makes for the CPU, and the current stream outside ``use_stream``."""
    return _CPU_DEFAULT


# torch leaves these constructors unannotated; give them types once, here.
_new_cuda_stream: Callable[..., torch.cuda.Stream] = torch.cuda.Stream
_new_cuda_event: Callable[[], torch.cuda.Event] = torch.cuda.Event


def record_event(event: AnyEvent, stream: AnyStream) -> None:
    """``event.record(stream)``, checking both are of one device kind."""
    if isinstance(event, CpuEvent):
        if isinstance(stream, CpuStream):
            event.record(stream)
            return
    elif not isinstance(stream, CpuStream):
        event.record(stream)
        return
    raise StreamError(
        f"record_event: {event!r} cannot be recorded on {stream!r}: expected an event and a "
        "stream of one device kind (both CPU or both CUDA); make both for the model's device "
        "(make_event(device), make_streams(device))"
    )


def wait_event(event: AnyEvent, stream: AnyStream) -> None:
    """Make ``stream`` wait for ``event``, checking both are of one device kind."""
    if isinstance(event, CpuEvent):
        if isinstance(stream, CpuStream):
            event.wait(stream)
            return
    elif not isinstance(stream, CpuStream):
        event.wait(stream)
        return
    raise StreamError(
        f"wait_event: {stream!r} cannot wait for {event!r}: expected a stream and an event "
        "of one device kind (both CPU or both CUDA); make both for the model's device "
        "(make_streams(device), make_event(device))"
    )


def pair_error(stream: object, event: object) -> StreamError:
    """The error for a stream and an event of two device kinds (``use_stream`` too)."""
    kinds = ("CPU", "CUDA") if isinstance(stream, CpuStream) else ("CUDA", "CPU")
    return StreamError(
        f"use_stream: a {kinds[0]} stream {stream!r} was paired with a {kinds[1]} "
        "event; make events with make_event(device) on the model's device"
    )


def enter_stream(
    stream: AnyStream, event: AnyEvent
) -> contextlib.AbstractContextManager[object] | None:
    """``use_stream``'s entry as one call (a node's hot path): check that ``stream``
    and ``event`` are of one device kind, make ``stream`` wait for ``event``, switch to
    ``stream``. Returns the CUDA stream switch (``None`` on CPU) for :func:`leave_stream`
    or :func:`abandon_stream`, one of which must follow."""
    if isinstance(stream, CpuStream):
        if not isinstance(event, CpuEvent):
            raise pair_error(stream, event)
        event.wait(stream)
        if _CHECKING:
            _CHECKING[-1].enter(stream)
        return None
    if isinstance(event, CpuEvent):
        raise pair_error(stream, event)
    switch = _cuda_switch(stream)
    event.wait(stream)
    switch.__enter__()
    if _SHAKING:
        _SHAKING[-1].delay()
    return switch


def leave_stream(
    stream: AnyStream, event: AnyEvent, switch: contextlib.AbstractContextManager[object] | None
) -> None:
    """``use_stream``'s exit after its body returned: switch back, record ``event``
    on ``stream``."""
    if switch is not None:
        switch.__exit__(None, None, None)
    elif _CHECKING:
        _CHECKING[-1].exit()
    event.record(stream)  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]  # one device kind: enter_stream checked


def leave_stream_unrecorded(switch: contextlib.AbstractContextManager[object] | None) -> None:
    """:func:`leave_stream` without the event: switch back, record nothing. For work that
    only later work on the same stream reads (a recompute, read by its own backward), so
    the event's other waiters need not wait for it."""
    leave_switch(switch, None, None, None)


def abandon_stream(
    switch: contextlib.AbstractContextManager[object] | None, exc: BaseException
) -> None:
    """``use_stream``'s exit after its body raised ``exc``: switch back, record
    nothing."""
    leave_switch(switch, type(exc), exc, exc.__traceback__)


def leave_switch(
    switch: contextlib.AbstractContextManager[object] | None,
    exc_type: type[BaseException] | None,
    exc: BaseException | None,
    tb: TracebackType | None,
) -> None:
    if switch is not None:
        switch.__exit__(exc_type, exc, tb)
    elif _CHECKING:
        _CHECKING[-1].exit()


def stream_context(stream: AnyStream) -> contextlib.AbstractContextManager[object]:
    """Run the body on ``stream`` without touching any event (CPU: does nothing but tell
    the stream-order checker)."""
    if isinstance(stream, CpuStream):
        return _CpuSwitch(stream) if _CHECKING else contextlib.nullcontext()
    if _SHAKING:
        return _shaken(stream)
    return _cuda_switch(stream)


def _cuda_switch(stream: torch.cuda.Stream) -> contextlib.AbstractContextManager[object]:
    """``torch.cuda.stream(stream)``, or, when ``stream`` is already the current stream of
    the current device (a compute node's usual case), the same in effect without its
    Python work (:class:`_AlreadyCurrent`)."""
    if _cuda_current_stream is not None and _cuda_current_device is not None:
        current = _cuda_current_stream(_cuda_current_device())
        if (
            current[0] == stream.stream_id
            and current[1] == stream.device_index
            and current[2] == stream.device_type
        ):
            return _AlreadyCurrent(stream)
    return torch.cuda.stream(stream)


class _AlreadyCurrent:
    """``torch.cuda.stream(stream)`` for a ``stream`` that is current on the current device.

    Entering would set the current stream to itself: nothing to do. Leaving sets ``stream``
    current again exactly as ``torch.cuda.stream``'s exit does (one ``_cuda_setStream``
    with the stream it found current, which is ``stream``), so a body that switched the
    stream or the device without switching back is undone the same way.
    """

    __slots__ = ("_stream",)

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self._stream = stream

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        stream = self._stream
        _cuda_set_stream(stream.stream_id, stream.device_index, stream.device_type)


@contextlib.contextmanager
def _shaken(stream: torch.cuda.Stream) -> Generator[None]:
    with torch.cuda.stream(stream):
        if _SHAKING:
            _SHAKING[-1].delay()
        yield


class _CpuSwitch:
    """The checker's current stream is ``stream`` inside the body."""

    __slots__ = ("_stream",)

    def __init__(self, stream: CpuStream) -> None:
        self._stream = stream

    def __enter__(self) -> None:
        if _CHECKING:
            _CHECKING[-1].enter(self._stream)

    def __exit__(self, *exc: object) -> None:
        if _CHECKING:
            _CHECKING[-1].exit()


def current_stream(like: AnyStream) -> AnyStream:
    """The stream current on the device ``like`` belongs to (on CPU ``like`` itself, or
    the checker's current stream when it runs)."""
    if isinstance(like, CpuStream):
        if _CHECKING:
            return cast(CpuStream, _CHECKING[-1].current())
        return like
    return torch.cuda.current_stream(like.device)


def synchronize(like: AnyStream) -> None:
    """Wait for all work on the device ``like`` belongs to (no-op on CPU)."""
    if not isinstance(like, CpuStream):
        torch.cuda.synchronize(like.device)
    elif _CHECKING:
        _CHECKING[-1].host_sync()


def release_storage(tensor: torch.Tensor) -> None:
    """Release ``tensor``'s memory now (``resize_(0)``), telling the checker."""
    if _CHECKING:
        _CHECKING[-1].release(tensor)
    tensor.untyped_storage().resize_(0)


def record_tensor_on(tensor: torch.Tensor, stream: AnyStream) -> None:
    """Tell the caching allocator ``tensor`` is in use on ``stream`` (no-op on CPU but for
    the stream-order checker)."""
    if isinstance(stream, CpuStream):
        if _CHECKING:
            _CHECKING[-1].record_stream(tensor, stream)
        return
    if tensor.device.type == "cuda":
        tensor.record_stream(stream)


default_pairs: dict[torch.device, StreamPair] = {}
"""The default streams of each device (``cuda:i`` with its index, or ``cpu``): what
:func:`~moe_overlap.set_streams` sets and :func:`device_streams` reads."""


def device_key(dev: torch.device) -> torch.device:
    """``dev`` with its index (a bare ``cuda`` is the current CUDA device)."""
    if dev.type == "cuda" and cast("int | None", dev.index) is None:  # torch types it int
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def device_streams(device: torch.device) -> StreamPair:
    """The default streams of the CUDA ``device`` of a tensor, made on first use as
    :func:`~moe_overlap.set_streams` makes them (its current stream and a new one)."""
    key = device_key(device)
    known = default_pairs.get(key)
    if known is None:
        comp = torch.cuda.current_stream(key)
        comm = _new_cuda_stream(device=key, priority=0)
        known = default_pairs[key] = StreamPair(comp=comp, comm=comm)
    return known


def new_event(device: torch.device) -> AnyEvent:
    """A new event for the ``cpu`` or ``cuda`` device of a :class:`StreamPair`."""
    if device.type == "cpu":
        return CpuEvent()
    return _new_cuda_event()
