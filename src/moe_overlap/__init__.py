"""moe_overlap: overlap the expert-parallel all-to-all of one microbatch with the compute
of another (combined 1F1B), for any PyTorch mixture-of-experts model.

The top level holds what a user calls and implements: the driver
(:func:`combined_1f1b`), its inputs and options, the nodes and plans, the layer
Protocols, streams and the errors. The rest lives in named modules:

- :mod:`moe_overlap.steps`: the schedule as data (steps, shapes, the microbatch order,
  observers);
- :mod:`moe_overlap.streams`: CPU stand-ins and stream helpers;
- :mod:`moe_overlap.protocols`: every Protocol and its rule table;
- :mod:`moe_overlap.microbatch`: the :class:`Microbatch` a plan is built from;
- :mod:`moe_overlap.inputs`: which microbatch inputs a model reads;
- :mod:`moe_overlap.wgrad`: what a model still owes of its delayed weight gradients;
- :mod:`moe_overlap.errors`: the error hierarchy;
- :mod:`moe_overlap.megatron`: Megatron-Core's call forms;
- subpackages :mod:`~moe_overlap.blocks`, :mod:`~moe_overlap.models`,
  :mod:`~moe_overlap.adapters`, :mod:`~moe_overlap.integrations`, and the
  :mod:`~moe_overlap.engine` they stand on.

Set ``MOE_OVERLAP_DEBUG=1`` before the first import to check every public call at run
time with beartype; otherwise beartype is not imported and nothing is wrapped.
"""

from moe_overlap.engine._driver import combined_1f1b as combined_1f1b
from moe_overlap.engine._stream_setup import get_comm_stream as get_comm_stream
from moe_overlap.engine._stream_setup import get_comp_stream as get_comp_stream
from moe_overlap.engine._stream_setup import make_event as make_event
from moe_overlap.engine._stream_setup import make_streams as make_streams
from moe_overlap.engine._stream_setup import set_streams as set_streams
from moe_overlap.engine._weak_method import weak_method as weak_method
from moe_overlap.engine.core._backward_dw import BackwardDWWrapper as BackwardDWWrapper
from moe_overlap.engine.core._chunk_plan import ModelChunkSchedulePlan as ModelChunkSchedulePlan
from moe_overlap.engine.core._free_input import should_free_input as should_free_input
from moe_overlap.engine.core._layer_args import LayerArgs as LayerArgs
from moe_overlap.engine.core._layer_node import TransformerLayerNode as TransformerLayerNode
from moe_overlap.engine.core._layer_plan import (
    TransformerLayerSchedulePlan as TransformerLayerSchedulePlan,
)
from moe_overlap.engine.core._node import NoopScheduleNode as NoopScheduleNode
from moe_overlap.engine.core._node import ScheduleNode as ScheduleNode
from moe_overlap.engine.core._options import ScheduleOptions as ScheduleOptions
from moe_overlap.engine.core._process_nodes import PostProcessNode as PostProcessNode
from moe_overlap.engine.core._process_nodes import PreProcessNode as PreProcessNode
from moe_overlap.engine.core._state import ChunkState as ChunkState
from moe_overlap.engine.core._state import LayerState as LayerState
from moe_overlap.engine.core._state import PreprocessOutput as PreprocessOutput
from moe_overlap.engine.core._streams import StreamPair as StreamPair
from moe_overlap.errors import ConfigError as ConfigError
from moe_overlap.errors import IntegrationError as IntegrationError
from moe_overlap.errors import LayerStateAttributeError as LayerStateAttributeError
from moe_overlap.errors import MoeOverlapError as MoeOverlapError
from moe_overlap.errors import NodeStateError as NodeStateError
from moe_overlap.errors import PlanReleasedError as PlanReleasedError
from moe_overlap.errors import ScheduleError as ScheduleError
from moe_overlap.errors import StreamError as StreamError
from moe_overlap.errors import TypeHintError as TypeHintError
from moe_overlap.errors import WgradError as WgradError
from moe_overlap.microbatch import Microbatch as Microbatch
from moe_overlap.protocols import CudaGraphModule as CudaGraphModule
from moe_overlap.protocols import MtpSchedulableLayer as MtpSchedulableLayer
from moe_overlap.protocols import PendingWgrad as PendingWgrad
from moe_overlap.protocols import PreprocessableModel as PreprocessableModel
from moe_overlap.protocols import SchedulableLayer as SchedulableLayer
from moe_overlap.protocols import SlotContext as SlotContext
from moe_overlap.protocols import StreamProvider as StreamProvider
from moe_overlap.protocols import WgradLayer as WgradLayer
from moe_overlap.protocols import WgradScope as WgradScope

__version__ = "0.1.0"  # the one place: pyproject.toml reads it (hatch dynamic version)

__all__ = [
    "BackwardDWWrapper",
    "ChunkState",
    "ConfigError",
    "CudaGraphModule",
    "IntegrationError",
    "LayerArgs",
    "LayerState",
    "LayerStateAttributeError",
    "Microbatch",
    "ModelChunkSchedulePlan",
    "MoeOverlapError",
    "MtpSchedulableLayer",
    "NodeStateError",
    "NoopScheduleNode",
    "PendingWgrad",
    "PlanReleasedError",
    "PostProcessNode",
    "PreProcessNode",
    "PreprocessOutput",
    "PreprocessableModel",
    "SchedulableLayer",
    "ScheduleError",
    "ScheduleNode",
    "ScheduleOptions",
    "SlotContext",
    "StreamError",
    "StreamPair",
    "StreamProvider",
    "TransformerLayerNode",
    "TransformerLayerSchedulePlan",
    "TypeHintError",
    "WgradError",
    "WgradLayer",
    "WgradScope",
    "combined_1f1b",
    "get_comm_stream",
    "get_comp_stream",
    "make_event",
    "make_streams",
    "set_streams",
    "should_free_input",
    "weak_method",
]
