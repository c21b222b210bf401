"""Streams and events: CUDA ones on a GPU, stand-ins with the same methods on CPU.

The default pair belongs to a device (:func:`set_streams`); :func:`make_streams` makes a
new one. Two tools check that the streams are ordered where they share tensors:
:func:`stream_order_check` (CPU: every tensor access checked against the happens-before of
the streams' events) and :func:`shake` (CUDA: seeded random delays at node boundaries, for
repeated runs that must stay bit-identical). ``docs/correctness.md`` says what each covers.
"""

from moe_overlap import StreamPair as StreamPair
from moe_overlap import get_comm_stream as get_comm_stream
from moe_overlap import get_comp_stream as get_comp_stream
from moe_overlap import make_event as make_event
from moe_overlap import make_streams as make_streams
from moe_overlap import set_streams as set_streams
from moe_overlap.engine._stream_check import StreamOrderChecker as StreamOrderChecker
from moe_overlap.engine._stream_check import StreamOrderError as StreamOrderError
from moe_overlap.engine._stream_check import stream_order_check as stream_order_check
from moe_overlap.engine._stream_setup import reset_streams as reset_streams
from moe_overlap.engine._stream_shake import shake as shake
from moe_overlap.engine.core._streams import AnyEvent as AnyEvent
from moe_overlap.engine.core._streams import AnyStream as AnyStream
from moe_overlap.engine.core._streams import CpuEvent as CpuEvent
from moe_overlap.engine.core._streams import CpuStream as CpuStream
from moe_overlap.engine.core._streams import cpu_default_stream as cpu_default_stream

__all__ = [
    "AnyEvent",
    "AnyStream",
    "CpuEvent",
    "CpuStream",
    "StreamOrderChecker",
    "StreamOrderError",
    "StreamPair",
    "cpu_default_stream",
    "get_comm_stream",
    "get_comp_stream",
    "make_event",
    "make_streams",
    "reset_streams",
    "set_streams",
    "shake",
    "stream_order_check",
]
