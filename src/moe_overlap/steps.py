"""The schedule as data: the steps a plan runs, their shapes, the microbatch order, and who watches them.

A schedule here is an ordered list of typed steps that the runner walks; the same list
drives timelines, the critical-path bound and error messages (``docs/concepts.md``).
"""

from moe_overlap.engine._macro_steps import MacroStep as MacroStep
from moe_overlap.engine._macro_steps import backward_microbatches as backward_microbatches
from moe_overlap.engine._macro_steps import format_macro as format_macro
from moe_overlap.engine._macro_steps import forward_microbatches as forward_microbatches
from moe_overlap.engine._macro_steps import parse_macro as parse_macro
from moe_overlap.engine._microbatch_order import ScheduleMode as ScheduleMode
from moe_overlap.engine._microbatch_order import macro_steps as macro_steps
from moe_overlap.engine._node_order_check import check_node_order as check_node_order
from moe_overlap.engine._node_order_check import microbatch_node_steps as microbatch_node_steps
from moe_overlap.engine._order_search import OrderSearch as OrderSearch
from moe_overlap.engine._order_search import ReplayedStep as ReplayedStep
from moe_overlap.engine._order_search import SlotKey as SlotKey
from moe_overlap.engine._order_search import macro_run_steps as macro_run_steps
from moe_overlap.engine._order_search import makespan as makespan
from moe_overlap.engine._order_search import predict_ms as predict_ms
from moe_overlap.engine._order_search import replay as replay
from moe_overlap.engine._order_search import search_order as search_order
from moe_overlap.engine._run_pair import run_pair as run_pair
from moe_overlap.engine.core._node_schedule import NodeSchedule as NodeSchedule
from moe_overlap.engine.core._options import ChunkHooks as ChunkHooks
from moe_overlap.engine.core._order import PairKind as PairKind
from moe_overlap.engine.core._order import PairOrder as PairOrder
from moe_overlap.engine.core._order import ScheduleOrder as ScheduleOrder
from moe_overlap.engine.core._step import Step as Step
from moe_overlap.engine.core._steps import ChunkShape as ChunkShape
from moe_overlap.engine.core._steps import Direction as Direction
from moe_overlap.engine.core._steps import LayerShape as LayerShape
from moe_overlap.engine.core._steps import Role as Role
from moe_overlap.engine.core._steps import Slot as Slot
from moe_overlap.engine.core._steps import StreamKind as StreamKind
from moe_overlap.engine.core._steps import backward_pair_steps as backward_pair_steps
from moe_overlap.engine.core._steps import chunk_steps as chunk_steps
from moe_overlap.engine.core._steps import format_steps as format_steps
from moe_overlap.engine.core._steps import forward_pair_steps as forward_pair_steps
from moe_overlap.engine.core._steps import layer_pair_steps as layer_pair_steps
from moe_overlap.engine.core._steps import macro_node_steps as macro_node_steps
from moe_overlap.protocols import NodeTimer as NodeTimer
from moe_overlap.protocols import StepObserver as StepObserver

__all__ = [
    "ChunkHooks",
    "ChunkShape",
    "Direction",
    "LayerShape",
    "MacroStep",
    "NodeSchedule",
    "NodeTimer",
    "OrderSearch",
    "PairKind",
    "PairOrder",
    "ReplayedStep",
    "Role",
    "ScheduleMode",
    "ScheduleOrder",
    "Slot",
    "SlotKey",
    "Step",
    "StepObserver",
    "StreamKind",
    "backward_microbatches",
    "backward_pair_steps",
    "check_node_order",
    "chunk_steps",
    "format_macro",
    "format_steps",
    "forward_microbatches",
    "forward_pair_steps",
    "layer_pair_steps",
    "macro_node_steps",
    "macro_run_steps",
    "macro_steps",
    "makespan",
    "microbatch_node_steps",
    "parse_macro",
    "predict_ms",
    "replay",
    "run_pair",
    "search_order",
]
