"""The engine: schedule nodes, plans, the driver, streams, Protocols and errors.

The floor every other subpackage stands on; it imports none of them. Its modules are
private (``_*.py``), one concept each, except the two shared with the other subpackages:
:mod:`moe_overlap.engine.core.args` (argument specs, ``check_arg``) and
:mod:`moe_overlap.engine.contracts` (each Protocol's rule table). Everything else the rest
of the library uses is re-exported here; users import from :mod:`moe_overlap` and its
public modules (:mod:`~moe_overlap.steps`, :mod:`~moe_overlap.streams`,
:mod:`~moe_overlap.protocols`, :mod:`~moe_overlap.inputs`, :mod:`~moe_overlap.wgrad`,
:mod:`~moe_overlap.errors`, :mod:`~moe_overlap.megatron`).

Debug mode (``MOE_OVERLAP_DEBUG=1``) installs beartype here, before any other module of
the package is imported.
"""

from moe_overlap.engine._debug import debug_enabled as _debug_enabled

if _debug_enabled():  # before any other module of the package is imported
    from moe_overlap.engine._debug import install_beartype as _install_beartype

    _install_beartype()

from moe_overlap.engine import _attached_checks  # noqa: F401  # pyright: ignore[reportUnusedImport]  # attaches the checks as guards
from moe_overlap.engine._bypass_check import Bypass as Bypass
from moe_overlap.engine._bypass_check import BypassedModule as BypassedModule
from moe_overlap.engine._bypass_check import check_bypassed as check_bypassed
from moe_overlap.engine._bypass_check import check_module as check_module
from moe_overlap.engine._conformance import check_model as check_model
from moe_overlap.engine._consensus import Phase as Phase
from moe_overlap.engine._consensus import StepConsensus as StepConsensus
from moe_overlap.engine._consensus import Verdict as Verdict
from moe_overlap.engine._consensus import verdict_error as verdict_error
from moe_overlap.engine._debug import DEBUG as DEBUG
from moe_overlap.engine._driver import combined_1f1b as combined_1f1b
from moe_overlap.engine._guards import without_guards as without_guards
from moe_overlap.engine._inputs import DEFAULT_INPUTS as DEFAULT_INPUTS
from moe_overlap.engine._inputs import OPTIONAL_INPUTS as OPTIONAL_INPUTS
from moe_overlap.engine._inputs import check_inputs as check_inputs
from moe_overlap.engine._inputs import read_inputs as read_inputs
from moe_overlap.engine._order_search import OrderSearch as OrderSearch
from moe_overlap.engine._order_search import ReplayedStep as ReplayedStep
from moe_overlap.engine._order_search import SlotKey as SlotKey
from moe_overlap.engine._order_search import macro_run_steps as macro_run_steps
from moe_overlap.engine._order_search import makespan as makespan
from moe_overlap.engine._order_search import predict_ms as predict_ms
from moe_overlap.engine._order_search import replay as replay
from moe_overlap.engine._order_search import search_order as search_order
from moe_overlap.engine._owed_wgrad import check_wgrad_done as check_wgrad_done
from moe_overlap.engine._owed_wgrad import owed_wgrad as owed_wgrad
from moe_overlap.engine._owed_wgrad import pending_count as pending_count
from moe_overlap.engine._stream_check import StreamOrderChecker as StreamOrderChecker
from moe_overlap.engine._stream_check import StreamOrderError as StreamOrderError
from moe_overlap.engine._stream_check import active_checker as active_checker
from moe_overlap.engine._stream_check import start_from_env as _start_from_env
from moe_overlap.engine._stream_check import stream_order_check as stream_order_check
from moe_overlap.engine.core._backward_dw import BackwardDWWrapper as BackwardDWWrapper
from moe_overlap.engine.core._chunk_plan import ModelChunkSchedulePlan as ModelChunkSchedulePlan
from moe_overlap.engine.core._chunk_plan import run_pair as run_pair
from moe_overlap.engine.core._errors import ConfigError as ConfigError
from moe_overlap.engine.core._errors import IntegrationError as IntegrationError
from moe_overlap.engine.core._errors import LayerStateAttributeError as LayerStateAttributeError
from moe_overlap.engine.core._errors import MoeOverlapError as MoeOverlapError
from moe_overlap.engine.core._errors import NodeStateError as NodeStateError
from moe_overlap.engine.core._errors import PlanReleasedError as PlanReleasedError
from moe_overlap.engine.core._errors import ScheduleError as ScheduleError
from moe_overlap.engine.core._errors import StreamError as StreamError
from moe_overlap.engine.core._errors import TypeHintError as TypeHintError
from moe_overlap.engine.core._errors import WgradError as WgradError
from moe_overlap.engine.core._free_input import should_free_input as should_free_input
from moe_overlap.engine.core._layer_args import LayerArgs as LayerArgs
from moe_overlap.engine.core._layer_node import TransformerLayerNode as TransformerLayerNode
from moe_overlap.engine.core._layer_plan import (
    TransformerLayerSchedulePlan as TransformerLayerSchedulePlan,
)
from moe_overlap.engine.core._macro import MacroStep as MacroStep
from moe_overlap.engine.core._macro import ScheduleMode as ScheduleMode
from moe_overlap.engine.core._macro import format_macro as format_macro
from moe_overlap.engine.core._macro import macro_steps as macro_steps
from moe_overlap.engine.core._macro import parse_macro as parse_macro
from moe_overlap.engine.core._megatron import layer_args as layer_args
from moe_overlap.engine.core._microbatch import Microbatch as Microbatch
from moe_overlap.engine.core._node import NoopScheduleNode as NoopScheduleNode
from moe_overlap.engine.core._node import ScheduleNode as ScheduleNode
from moe_overlap.engine.core._node import weak_method as weak_method
from moe_overlap.engine.core._node_errors import check_marked as check_marked
from moe_overlap.engine.core._options import ChunkHooks as ChunkHooks
from moe_overlap.engine.core._options import Hook as Hook
from moe_overlap.engine.core._options import ScheduleOptions as ScheduleOptions
from moe_overlap.engine.core._order import PairKind as PairKind
from moe_overlap.engine.core._order import PairOrder as PairOrder
from moe_overlap.engine.core._order import ScheduleOrder as ScheduleOrder
from moe_overlap.engine.core._order import SlotStep as SlotStep
from moe_overlap.engine.core._process_nodes import PostProcessNode as PostProcessNode
from moe_overlap.engine.core._process_nodes import PreProcessNode as PreProcessNode
from moe_overlap.engine.core._protocols import CudaGraphModule as CudaGraphModule
from moe_overlap.engine.core._protocols import DeclaresInputs as DeclaresInputs
from moe_overlap.engine.core._protocols import DecoderLike as DecoderLike
from moe_overlap.engine.core._protocols import FreeInputConfig as FreeInputConfig
from moe_overlap.engine.core._protocols import GraphedWgradLayer as GraphedWgradLayer
from moe_overlap.engine.core._protocols import HoldsDelayedModules as HoldsDelayedModules
from moe_overlap.engine.core._protocols import LayerListLike as LayerListLike
from moe_overlap.engine.core._protocols import ModelConfigLike as ModelConfigLike
from moe_overlap.engine.core._protocols import MtpSchedulableLayer as MtpSchedulableLayer
from moe_overlap.engine.core._protocols import NodeTimer as NodeTimer
from moe_overlap.engine.core._protocols import PendingWgrad as PendingWgrad
from moe_overlap.engine.core._protocols import PreprocessableModel as PreprocessableModel
from moe_overlap.engine.core._protocols import SchedulableLayer as SchedulableLayer
from moe_overlap.engine.core._protocols import SlotContext as SlotContext
from moe_overlap.engine.core._protocols import SlotFn as SlotFn
from moe_overlap.engine.core._protocols import StepObserver as StepObserver
from moe_overlap.engine.core._protocols import StreamProvider as StreamProvider
from moe_overlap.engine.core._protocols import ValidatesInputs as ValidatesInputs
from moe_overlap.engine.core._protocols import WgradLayer as WgradLayer
from moe_overlap.engine.core._protocols import WgradScope as WgradScope
from moe_overlap.engine.core._recompute_hold import hold_for_recompute as hold_for_recompute
from moe_overlap.engine.core._state import ChunkState as ChunkState
from moe_overlap.engine.core._state import LayerState as LayerState
from moe_overlap.engine.core._state import PreprocessOutput as PreprocessOutput
from moe_overlap.engine.core._steps import ChunkShape as ChunkShape
from moe_overlap.engine.core._steps import Direction as Direction
from moe_overlap.engine.core._steps import LayerShape as LayerShape
from moe_overlap.engine.core._steps import Role as Role
from moe_overlap.engine.core._steps import Slot as Slot
from moe_overlap.engine.core._steps import Step as Step
from moe_overlap.engine.core._steps import StreamKind as StreamKind
from moe_overlap.engine.core._steps import backward_pair_steps as backward_pair_steps
from moe_overlap.engine.core._steps import chunk_steps as chunk_steps
from moe_overlap.engine.core._steps import format_steps as format_steps
from moe_overlap.engine.core._steps import forward_pair_steps as forward_pair_steps
from moe_overlap.engine.core._steps import layer_pair_steps as layer_pair_steps
from moe_overlap.engine.core._steps import macro_node_steps as macro_node_steps
from moe_overlap.engine.core._streams import AnyEvent as AnyEvent
from moe_overlap.engine.core._streams import AnyStream as AnyStream
from moe_overlap.engine.core._streams import CpuEvent as CpuEvent
from moe_overlap.engine.core._streams import CpuStream as CpuStream
from moe_overlap.engine.core._streams import StreamPair as StreamPair
from moe_overlap.engine.core._streams import cpu_default_stream as cpu_default_stream
from moe_overlap.engine.core._streams import current_stream as current_stream
from moe_overlap.engine.core._streams import get_comm_stream as get_comm_stream
from moe_overlap.engine.core._streams import get_comp_stream as get_comp_stream
from moe_overlap.engine.core._streams import make_event as make_event
from moe_overlap.engine.core._streams import make_streams as make_streams
from moe_overlap.engine.core._streams import record_event as record_event
from moe_overlap.engine.core._streams import record_tensor_on as record_tensor_on
from moe_overlap.engine.core._streams import release_storage as release_storage
from moe_overlap.engine.core._streams import reset_streams as reset_streams
from moe_overlap.engine.core._streams import set_streams as set_streams
from moe_overlap.engine.core._streams import shake as shake
from moe_overlap.engine.core._streams import stream_context as stream_context
from moe_overlap.engine.core._streams import wait_event as wait_event
from moe_overlap.engine.core._streams import wait_stream as wait_stream
from moe_overlap.engine.core._wgrad_claims import WgradClaim as WgradClaim
from moe_overlap.engine.core._wgrad_claims import claim_wgrad as claim_wgrad
from moe_overlap.engine.core._wgrad_claims import wgrad_claimed as wgrad_claimed

_start_from_env()  # MOE_OVERLAP_STREAM_CHECK=1: the stream-order checker for the whole process

__all__ = [
    "DEBUG",
    "DEFAULT_INPUTS",
    "OPTIONAL_INPUTS",
    "AnyEvent",
    "AnyStream",
    "BackwardDWWrapper",
    "Bypass",
    "BypassedModule",
    "ChunkHooks",
    "ChunkShape",
    "ChunkState",
    "ConfigError",
    "CpuEvent",
    "CpuStream",
    "CudaGraphModule",
    "DeclaresInputs",
    "DecoderLike",
    "Direction",
    "FreeInputConfig",
    "GraphedWgradLayer",
    "HoldsDelayedModules",
    "Hook",
    "IntegrationError",
    "LayerArgs",
    "LayerListLike",
    "LayerShape",
    "LayerState",
    "LayerStateAttributeError",
    "MacroStep",
    "Microbatch",
    "ModelChunkSchedulePlan",
    "ModelConfigLike",
    "MoeOverlapError",
    "MtpSchedulableLayer",
    "NodeStateError",
    "NodeTimer",
    "NoopScheduleNode",
    "OrderSearch",
    "PairKind",
    "PairOrder",
    "PendingWgrad",
    "Phase",
    "PlanReleasedError",
    "PostProcessNode",
    "PreProcessNode",
    "PreprocessOutput",
    "PreprocessableModel",
    "ReplayedStep",
    "Role",
    "SchedulableLayer",
    "ScheduleError",
    "ScheduleMode",
    "ScheduleNode",
    "ScheduleOptions",
    "ScheduleOrder",
    "Slot",
    "SlotContext",
    "SlotFn",
    "SlotKey",
    "SlotStep",
    "Step",
    "StepConsensus",
    "StepObserver",
    "StreamError",
    "StreamKind",
    "StreamOrderChecker",
    "StreamOrderError",
    "StreamPair",
    "StreamProvider",
    "TransformerLayerNode",
    "TransformerLayerSchedulePlan",
    "TypeHintError",
    "ValidatesInputs",
    "Verdict",
    "WgradClaim",
    "WgradError",
    "WgradLayer",
    "WgradScope",
    "active_checker",
    "backward_pair_steps",
    "check_bypassed",
    "check_inputs",
    "check_marked",
    "check_model",
    "check_module",
    "check_wgrad_done",
    "chunk_steps",
    "claim_wgrad",
    "combined_1f1b",
    "cpu_default_stream",
    "current_stream",
    "format_macro",
    "format_steps",
    "forward_pair_steps",
    "get_comm_stream",
    "get_comp_stream",
    "hold_for_recompute",
    "layer_args",
    "layer_pair_steps",
    "macro_node_steps",
    "macro_run_steps",
    "macro_steps",
    "make_event",
    "make_streams",
    "makespan",
    "owed_wgrad",
    "parse_macro",
    "pending_count",
    "predict_ms",
    "read_inputs",
    "record_event",
    "record_tensor_on",
    "release_storage",
    "replay",
    "reset_streams",
    "run_pair",
    "search_order",
    "set_streams",
    "shake",
    "should_free_input",
    "stream_context",
    "stream_order_check",
    "verdict_error",
    "wait_event",
    "wait_stream",
    "weak_method",
    "wgrad_claimed",
    "without_guards",
]
