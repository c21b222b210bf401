"""The one-device stand-in for an all-to-all: a round trip through pinned host memory.

One GPU has no peer, so an expert-parallel all-to-all can only be emulated: the rows that
would leave the rank go device -> pinned host -> device on the stream the call runs on
(the copy engines, no SMs), the bytes a rank of the all-to-all sends and receives. Values
are unchanged, so a model using it computes exactly what it computes without it.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor

from moe_overlap.args import (
    NON_NEGATIVE,
    POSITIVE,
    TENSOR,
    Instance,
    OneOf,
    Opt,
    check_arg,
)
from moe_overlap.engine import (
    AnyStream,
    CpuStream,
    cpu_default_stream,
    current_stream,
    stream_context,
    wait_stream,
)

__all__ = ["HostLoopback", "LoopbackMode", "loopback"]


class LoopbackMode(str, enum.Enum):
    """What a :class:`HostLoopback` does with the rows."""

    HOST = "host"
    """Round trip of the remote rows through pinned host memory (the emulated all-to-all)."""
    DEVICE = "device"
    """One device-side copy of the whole buffer (compute-only runs)."""


_MODE: OneOf[LoopbackMode] = OneOf(tuple(LoopbackMode), hint="pass LoopbackMode.HOST or .DEVICE")


class HostLoopback:
    """Returns a copy of its input whose first ``remote_rows`` rows travelled through the host.

    ``remote_rows`` ``None`` sends every row (a whole all-to-all's bytes); a count stands for
    the rows a real EP rank sends off-rank (``(P-1)/P`` of them), the rest are copied on the
    device. The transfer is cut into ``chunks``: each chunk's host-to-device copy runs on a
    side stream while the next chunk goes device-to-host, as the send and receive of an
    all-to-all overlap; the calling stream waits for the side stream (one per calling
    stream, so callers on different streams do not wait for each other) before the call
    returns. Staging blocks come from PyTorch's caching host allocator, which keeps each
    alive until the copies queued on it finish, so calls on any streams are safe. On CPU,
    the same copies on :class:`~moe_overlap.streams.CpuStream` s (ordered as on a GPU under
    the stream-order checker). ``calls`` and ``bytes_moved`` count what it did.
    """

    def __init__(
        self,
        *,
        remote_rows: int | None = None,
        chunks: int = 1,
        mode: LoopbackMode = LoopbackMode.HOST,
    ) -> None:
        w = "HostLoopback"
        self.remote_rows = check_arg(w, "remote_rows", remote_rows, Opt(NON_NEGATIVE))
        self.chunks = check_arg(w, "chunks", chunks, POSITIVE)
        self.mode = check_arg(w, "mode", mode, _MODE)
        self.calls = 0
        self.bytes_moved = 0
        # One side stream per calling stream: callers on different streams (a chunked
        # dispatcher's send and return lanes) do not wait for each other's copies.
        self._side: dict[tuple[object, int], AnyStream] = {}

    def __call__(self, x: Tensor) -> Tensor:
        x = x.contiguous()
        self.calls += 1
        if self.mode is LoopbackMode.DEVICE:
            return x.clone()
        out = torch.empty_like(x)
        rows = x.shape[0] if x.dim() else 1
        cols = math.prod(x.shape[1:]) if x.dim() else 1  # not -1: rows may be 0
        flat, flat_out = x.view(rows, cols), out.view(rows, cols)
        remote = rows if self.remote_rows is None else min(self.remote_rows, rows)
        if remote < rows:
            flat_out[remote:].copy_(flat[remote:])
        self.bytes_moved += 2 * remote * flat.shape[1] * x.element_size()
        if x.is_cuda:
            host = _staging((remote, flat.shape[1]), x.dtype)
            cur: AnyStream = torch.cuda.current_stream(x.device)
        else:  # the same steps on CPU streams: the stream-order checker follows them
            host = torch.empty((remote, flat.shape[1]), dtype=x.dtype)
            cur = current_stream(cpu_default_stream())
        side = self._side_stream(x.device, cur)
        step = max(1, math.ceil(remote / self.chunks))
        for lo in range(0, remote, step):
            hi = min(remote, lo + step)
            host[lo:hi].copy_(flat[lo:hi], non_blocking=True)
            wait_stream(side, cur)
            with stream_context(side):
                flat_out[lo:hi].copy_(host[lo:hi], non_blocking=True)
        # The calling stream (which owns out's memory) waits for the side stream's writes, so
        # anything it runs later, a reuse of out's block included, comes after them. The
        # staging block needs nothing: the caching host allocator keeps it until the copies
        # queued on it are done (and on CPU the side stream's read is ordered by this wait).
        wait_stream(cur, side)
        return out

    def _side_stream(self, device: torch.device, caller: AnyStream) -> AnyStream:
        if isinstance(caller, CpuStream):
            key: tuple[object, int] = ("cpu", id(caller))
        else:
            key = (device, int(caller.stream_id))
        side = self._side.get(key)
        if side is None:
            side = CpuStream("loopback side") if isinstance(caller, CpuStream) else None
            side = side if side is not None else _new_stream(device)
            self._side[key] = side
        return side


_new_stream: Callable[[torch.device], torch.cuda.Stream] = torch.cuda.Stream


def _staging(shape: tuple[int, int], dtype: torch.dtype) -> Tensor:
    """A pinned host block, left unfilled also under deterministic algorithms.

    ``torch.use_deterministic_algorithms`` makes ``torch.empty`` fill new memory with NaN,
    on the host a single-threaded memset of the whole transfer on every call, slower than
    the copies it stages. Every row of this block is written by the device-to-host copy
    before the host-to-device copy reads it, so the fill guards nothing here.
    """
    # A module whose class defines the flag as a property: no static attribute to type.
    det = cast("Any", torch.utils.deterministic)
    if not det.fill_uninitialized_memory:
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    det.fill_uninitialized_memory = False
    try:
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    finally:
        det.fill_uninitialized_memory = True


class _LoopbackFn(torch.autograd.Function):
    """Forward: the loopback of the rows; backward: the loopback of their grads."""

    @staticmethod
    def forward(
        ctx: Any,  # torch's FunctionCtx declares no fields; we add our own
        x: Tensor,
        mover: HostLoopback,
    ) -> Tensor:
        ctx.mover = mover
        return mover(x)

    @staticmethod
    def backward(
        ctx: Any,  # see forward
        *grad_outputs: Tensor,
    ) -> tuple[Tensor, None]:
        (grad,) = grad_outputs
        mover: HostLoopback = ctx.mover
        return mover(grad), None


# Function.apply is untyped; give it its signature once, here.
_loopback_apply = cast(
    "Callable[[Tensor, HostLoopback], Tensor]",
    _LoopbackFn.apply,  # pyright: ignore[reportUnknownMemberType]
)


_MOVER = Instance(HostLoopback, "a HostLoopback")


def loopback(x: Tensor, mover: HostLoopback) -> Tensor:
    """``mover(x)`` as an autograd op: its backward sends the gradient the same way."""
    if not (isinstance(cast(object, x), Tensor) and isinstance(cast(object, mover), HostLoopback)):
        check_arg("loopback", "x", x, TENSOR)  # per dispatch: the fast path is the test above
        check_arg("loopback", "mover", mover, _MOVER)
    return _loopback_apply(x, mover)
