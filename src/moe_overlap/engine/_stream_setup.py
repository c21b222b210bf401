"""Making streams and events, and each device's default pair (Megatron-Core style).

What a caller asks for by device (:func:`make_streams`, :func:`make_event`,
:func:`set_streams` and its getters) is checked here, the device first (a ``cpu`` or usable
``cuda`` device, else a :class:`~moe_overlap.StreamError`); the schedule core's streams,
events and default pairs (``core/_streams.py``) take devices already checked: a tensor's,
a :class:`~moe_overlap.StreamPair`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch

from moe_overlap.args import BOOL, Instance, Opt, check_arg, refuse
from moe_overlap.errors import StreamError

from ._core_args import STREAM_SPEC
from .core._streams import (
    AnyEvent,
    AnyStream,
    CpuEvent,
    CpuStream,
    StreamPair,
    cpu_default_stream,
    default_pairs,
    device_key,
)

__all__ = [
    "default_device",
    "get_comm_stream",
    "get_comp_stream",
    "make_event",
    "make_streams",
    "reset_streams",
    "set_streams",
]

_OPT_STREAM = Opt(STREAM_SPEC)

# torch leaves these constructors unannotated; give them types once, here.
_new_cuda_stream: Callable[..., torch.cuda.Stream] = torch.cuda.Stream
_new_cuda_event: Callable[[], torch.cuda.Event] = torch.cuda.Event


def default_device() -> torch.device:
    """``cuda`` when a GPU is present, else ``cpu``."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


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
        return StreamPair(comp=cpu_default_stream(), comm=CpuStream("comm"))
    comp = torch.cuda.current_stream(dev)
    # priority_range() gives (lowest, highest); lower numbers are higher priorities.
    priority = comp.priority_range()[1] if high_priority_comm else 0
    return StreamPair(comp=comp, comm=_new_cuda_stream(device=dev, priority=priority))


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


def _pair_device(comp: AnyStream | None, comm: AnyStream | None) -> torch.device | None:
    """The device of the given streams (``None`` without any)."""
    given = comp if comp is not None else comm
    if given is None:
        return None
    return torch.device("cpu") if isinstance(given, CpuStream) else device_key(given.device)


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
        key = device_key(_stream_device(device, "set_streams"))
    else:
        key = given
    if given is not None and given != key:
        raise StreamError(
            f"set_streams: expected streams of {key}, received "
            f"comp={comp_stream!r}, comm={comm_stream!r} (on {given}); pass streams of the "
            "device, or leave device unset"
        )
    known = default_pairs.get(key)
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
    default_pairs[key] = pair
    return pair


def reset_streams() -> None:
    """Forget every device's default streams (tests and device switches)."""
    default_pairs.clear()


def get_comp_stream(*, device: torch.device | str | None = None) -> AnyStream:
    """The default compute stream of ``device`` (the current one without it); set on first
    use (:func:`~moe_overlap.set_streams`)."""
    return set_streams(device=device).comp


def get_comm_stream(*, device: torch.device | str | None = None) -> AnyStream:
    """The default communication stream of ``device`` (the current one without it); set on
    first use (:func:`~moe_overlap.set_streams`)."""
    return set_streams(device=device).comm
