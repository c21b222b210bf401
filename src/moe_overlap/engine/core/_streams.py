"""Streams and events for CUDA and CPU.

On CUDA the compute stream is the current stream and the communication stream is a
dedicated one. On CPU every stream and event is a :class:`~moe_overlap.streams.CpuStream` / :class:`~moe_overlap.streams.CpuEvent`:
objects with the methods the schedule calls that do nothing (CPU work is already ordered),
so the whole schedule runs, exactly, on a laptop.

Streams can be passed explicitly (a :class:`~moe_overlap.StreamPair`) or, for code ported from
Megatron-Core, taken from each device's defaults through :func:`~moe_overlap.set_streams` /
:func:`~moe_overlap.get_comp_stream` / :func:`~moe_overlap.get_comm_stream`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from types import TracebackType
from typing import Union, cast

import torch

from moe_overlap.args import (
    BOOL,
    Instance,
    Opt,
    Spec,
    check_arg,
    check_fields,
    refuse,
)
from moe_overlap.errors import StreamError

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
    "default_device",
    "enter_stream",
    "get_comm_stream",
    "get_comp_stream",
    "leave_stream",
    "leave_stream_unrecorded",
    "make_event",
    "make_streams",
    "record_event",
    "record_tensor_on",
    "release_storage",
    "reset_streams",
    "set_streams",
    "stream_context",
    "stream_device",
    "synchronize",
    "use_stream",
    "wait_event",
    "wait_stream",
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
        check_fields(self, _PAIR)
        if isinstance(self.comp, CpuStream) != isinstance(self.comm, CpuStream):
            raise StreamError(
                "StreamPair: expected compute and communication streams of one device type, "
                f"received comp={self.comp!r}, comm={self.comm!r}; make both for one device "
                "(make_streams(device))"
            )

    def comp_provider(self) -> AnyStream:
        """Return the compute stream (a :class:`~moe_overlap.StreamProvider`)."""
        return self.comp

    def comm_provider(self) -> AnyStream:
        """Return the communication stream (a :class:`~moe_overlap.StreamProvider`)."""
        return self.comm

    @property
    def device(self) -> torch.device:
        return stream_device(self.comp)


_STREAM = Instance((torch.cuda.Stream, CpuStream), "a torch.cuda.Stream or CpuStream")
_OPT_STREAM = Opt(_STREAM)
_PAIR: dict[str, Spec[object]] = {"comp": _STREAM, "comm": _STREAM}
_NAME = Instance(str, "a str")


def default_device() -> torch.device:
    """``cuda`` when a GPU is present, else ``cpu``."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def stream_device(stream: AnyStream) -> torch.device:
    """The device type a stream belongs to (``cuda`` or ``cpu``)."""
    if isinstance(stream, CpuStream):
        return torch.device("cpu")
    return torch.device("cuda")


def make_streams(
    device: torch.device | str | None = None, *, high_priority_comm: bool = False
) -> StreamPair:
    """Make a compute/communication stream pair for ``device``.

    On CUDA the compute stream is the current stream and the communication stream is a
    new stream, of the highest priority when ``high_priority_comm`` is set.
    """
    check_arg("make_streams", "high_priority_comm", high_priority_comm, BOOL)
    dev = _stream_device(device, "make_streams")
    if dev.type == "cpu":
        return StreamPair(comp=_CPU_DEFAULT, comm=CpuStream("comm"))
    comp = torch.cuda.current_stream(dev)
    # priority_range() gives (lowest, highest); lower numbers are higher priorities.
    priority = comp.priority_range()[1] if high_priority_comm else 0
    return StreamPair(comp=comp, comm=_new_cuda_stream(device=dev, priority=priority))


_CPU_DEFAULT = CpuStream("comp")


def cpu_default_stream() -> CpuStream:
    """The CPU's stand-in for CUDA's default stream: the compute stream of every pair
    :func:`make_streams` makes for the CPU, and the current stream outside ``use_stream``."""
    return _CPU_DEFAULT


def make_event(device: torch.device | str | None = None) -> AnyEvent:
    """A new event: a ``torch.cuda.Event`` on CUDA, a :class:`~moe_overlap.streams.CpuEvent` on CPU."""
    dev = _stream_device(device, "make_event")
    if dev.type == "cpu":
        return CpuEvent()
    return _new_cuda_event()


_DEVICE_LIKE = Opt(Instance((str, torch.device), "a torch.device or device string"))


def _stream_device(device: object, where: str) -> torch.device:
    """``device`` (default: :func:`default_device`) as a ``cpu`` or usable ``cuda`` device."""
    check_arg(where, "device", device, _DEVICE_LIKE)
    if device is None:
        return default_device()
    try:
        dev = torch.device(cast("str | torch.device", device))
    except (RuntimeError, ValueError) as bad:
        raise refuse(f"{where}: device", "a device string torch knows", device) from bad
    if dev.type not in ("cpu", "cuda"):
        raise StreamError(
            f"{where}: expected a 'cpu' or 'cuda' device, received {dev}; pass the device "
            "the model and its inputs are on (a model built on 'meta' runs nowhere: "
            "materialize it first with model.to_empty(device=...) and load or initialize "
            "its weights)"
        )
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise StreamError(
            f"{where}: expected a 'cpu' or 'cuda' device, received {dev}, but CUDA is not "
            "available in this process; pass 'cpu', or run where torch.cuda.is_available()"
        )
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        raise StreamError(
            f"{where}: expected a CUDA device this process sees (0 .. "
            f"{torch.cuda.device_count() - 1}), received {dev}; pass one of those "
            "(CUDA_VISIBLE_DEVICES sets which devices the process sees)"
        )
    return dev


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


def wait_stream(stream: AnyStream, other: AnyStream) -> None:
    """Make ``stream`` wait for everything queued on ``other`` so far (one device kind)."""
    if isinstance(stream, CpuStream):
        if isinstance(other, CpuStream):
            stream.wait_stream(other)
            return
    elif not isinstance(other, CpuStream):
        stream.wait_stream(other)
        return
    raise StreamError(
        f"wait_stream: {stream!r} cannot wait for {other!r}: expected two streams of one "
        "device kind (both CPU or both CUDA); make them for the model's device "
        "(make_streams(device))"
    )


class use_stream:  # lower case: used like a function, as torch.cuda.stream
    """Wait for ``event`` on ``stream``, run the body on ``stream``, then record ``event``.

    This is how one microbatch's nodes on different streams stay ordered: they all share
    one event, so each node starts after the previous one, whichever stream it ran on.
    The event is not recorded when the body raises. Nodes call its three steps directly
    (:func:`enter_stream`, :func:`leave_stream`, :func:`abandon_stream`): no context
    manager object on their hot path.
    """

    __slots__ = ("_event", "_stream", "_switch")

    def __init__(self, stream: AnyStream, event: AnyEvent) -> None:
        if isinstance(stream, CpuStream) != isinstance(event, CpuEvent):
            raise _pair_error(stream, event)
        self._stream = stream
        self._event = event
        self._switch: contextlib.AbstractContextManager[object] | None = None

    def __enter__(self) -> None:
        self._switch = enter_stream(self._stream, self._event)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            leave_stream(self._stream, self._event, self._switch)
        else:
            _leave_switch(self._switch, exc_type, exc, tb)


def _pair_error(stream: object, event: object) -> StreamError:
    kinds = ("CPU", "CUDA") if isinstance(stream, CpuStream) else ("CUDA", "CPU")
    return StreamError(
        f"use_stream: a {kinds[0]} stream {stream!r} was paired with a {kinds[1]} "
        "event; make events with make_event(device) on the model's device"
    )


def enter_stream(
    stream: AnyStream, event: AnyEvent
) -> contextlib.AbstractContextManager[object] | None:
    """:class:`use_stream`'s entry as one call (a node's hot path): check that ``stream``
    and ``event`` are of one device kind, make ``stream`` wait for ``event``, switch to
    ``stream``. Returns the CUDA stream switch (``None`` on CPU) for :func:`leave_stream`
    or :func:`abandon_stream`, one of which must follow."""
    if isinstance(stream, CpuStream):
        if not isinstance(event, CpuEvent):
            raise _pair_error(stream, event)
        event.wait(stream)
        if _CHECKING:
            _CHECKING[-1].enter(stream)
        return None
    if isinstance(event, CpuEvent):
        raise _pair_error(stream, event)
    switch = _cuda_switch(stream)
    event.wait(stream)
    switch.__enter__()
    if _SHAKING:
        _SHAKING[-1].delay()
    return switch


def leave_stream(
    stream: AnyStream, event: AnyEvent, switch: contextlib.AbstractContextManager[object] | None
) -> None:
    """:class:`use_stream`'s exit after its body returned: switch back, record ``event``
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
    _leave_switch(switch, None, None, None)


def abandon_stream(
    switch: contextlib.AbstractContextManager[object] | None, exc: BaseException
) -> None:
    """:class:`use_stream`'s exit after its body raised ``exc``: switch back, record
    nothing."""
    _leave_switch(switch, type(exc), exc, exc.__traceback__)


def _leave_switch(
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


_DEFAULTS: dict[torch.device, StreamPair] = {}
"""The default streams of each device (``cuda:i`` with its index, or ``cpu``)."""


def _device_key(dev: torch.device) -> torch.device:
    """``dev`` with its index (a bare ``cuda`` is the current CUDA device)."""
    if dev.type == "cuda" and cast("int | None", dev.index) is None:  # torch types it int
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def _pair_device(comp: AnyStream | None, comm: AnyStream | None) -> torch.device | None:
    """The device of the given streams (``None`` without any)."""
    given = comp if comp is not None else comm
    if given is None:
        return None
    return torch.device("cpu") if isinstance(given, CpuStream) else _device_key(given.device)


def set_streams(
    comp_stream: AnyStream | None = None,
    comm_stream: AnyStream | None = None,
    *,
    device: torch.device | str | None = None,
    high_priority_comm: bool = False,
) -> StreamPair:
    """Set the default streams of a device (Megatron-Core style) and return them.

    Each device has its own pair: ``device`` (default: :func:`~moe_overlap.default_device`,
    the current CUDA device or the CPU), or the device of the streams passed. The first
    call for a device wins, as in Megatron-Core, unless streams are passed explicitly,
    which replace that device's. Unset streams default to :func:`~moe_overlap.make_streams`
    for the device. A stream of another device than ``device`` is a
    :class:`~moe_overlap.StreamError`.
    """
    check_arg("set_streams", "comp_stream", comp_stream, _OPT_STREAM)
    check_arg("set_streams", "comm_stream", comm_stream, _OPT_STREAM)
    given = _pair_device(comp_stream, comm_stream)
    if device is not None or given is None:
        key = _device_key(_stream_device(device, "set_streams"))
    else:
        key = given
    if given is not None and given != key:
        raise StreamError(
            f"set_streams: expected streams of {key}, received "
            f"comp={comp_stream!r}, comm={comm_stream!r} (on {given}); pass streams of the "
            "device, or leave device unset"
        )
    known = _DEFAULTS.get(key)
    if known is not None and comp_stream is None and comm_stream is None:
        return known
    made = (
        make_streams(key, high_priority_comm=high_priority_comm)
        if comp_stream is None or comm_stream is None
        else None
    )
    pair = StreamPair(
        comp=comp_stream if comp_stream is not None else cast(StreamPair, made).comp,
        comm=comm_stream if comm_stream is not None else cast(StreamPair, made).comm,
    )
    _DEFAULTS[key] = pair
    return pair


def reset_streams() -> None:
    """Forget every device's default streams (tests and device switches)."""
    _DEFAULTS.clear()


def get_comp_stream(*, device: torch.device | str | None = None) -> AnyStream:
    """The default compute stream of ``device`` (the current one without it); set on first
    use (:func:`~moe_overlap.set_streams`)."""
    return set_streams(device=device).comp


def get_comm_stream(*, device: torch.device | str | None = None) -> AnyStream:
    """The default communication stream of ``device`` (the current one without it); set on
    first use (:func:`~moe_overlap.set_streams`)."""
    return set_streams(device=device).comm
