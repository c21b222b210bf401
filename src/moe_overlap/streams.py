"""Streams and events: CUDA ones on a GPU, no-op stand-ins with the same methods on CPU.

The default pair belongs to a device (:func:`set_streams`); :func:`make_streams` makes a
new one.
"""

from moe_overlap.engine import AnyEvent as AnyEvent
from moe_overlap.engine import AnyStream as AnyStream
from moe_overlap.engine import CpuEvent as CpuEvent
from moe_overlap.engine import CpuStream as CpuStream
from moe_overlap.engine import StreamPair as StreamPair
from moe_overlap.engine import get_comm_stream as get_comm_stream
from moe_overlap.engine import get_comp_stream as get_comp_stream
from moe_overlap.engine import make_event as make_event
from moe_overlap.engine import make_streams as make_streams
from moe_overlap.engine import reset_streams as reset_streams
from moe_overlap.engine import set_streams as set_streams

__all__ = [
    "AnyEvent",
    "AnyStream",
    "CpuEvent",
    "CpuStream",
    "StreamPair",
    "get_comm_stream",
    "get_comp_stream",
    "make_event",
    "make_streams",
    "reset_streams",
    "set_streams",
]
