"""The context-manager form of a node's stream steps (:class:`use_stream`): run a body
between a wait on and a record of a microbatch's event (the tests drive single nodes' stream
steps with it). The schedule core's nodes call the steps themselves, with no context
manager object on their hot path (``core/_streams.py``). And :func:`wait_stream`, which only
callers outside the core use."""

from __future__ import annotations

import contextlib
from types import TracebackType

from moe_overlap.errors import StreamError

from .core._streams import (
    AnyEvent,
    AnyStream,
    CpuEvent,
    CpuStream,
    enter_stream,
    leave_stream,
    leave_switch,
    pair_error,
)

__all__ = ["use_stream", "wait_stream"]


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
            raise pair_error(stream, event)
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
            leave_switch(self._switch, exc_type, exc, tb)


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
