"""The schedule as data: the steps a plan runs, their shapes, the microbatch order, and who watches them.

A schedule here is an ordered list of typed steps that the runner walks; the same list
drives timelines, the critical-path bound and error messages (``docs/concepts.md``).
"""

from moe_overlap.engine import ChunkHooks as ChunkHooks
from moe_overlap.engine import ChunkShape as ChunkShape
from moe_overlap.engine import Direction as Direction
from moe_overlap.engine import LayerShape as LayerShape
from moe_overlap.engine import MacroStep as MacroStep
from moe_overlap.engine import NodeTimer as NodeTimer
from moe_overlap.engine import OrderSearch as OrderSearch
from moe_overlap.engine import PairKind as PairKind
from moe_overlap.engine import PairOrder as PairOrder
from moe_overlap.engine import ReplayedStep as ReplayedStep
from moe_overlap.engine import Role as Role
from moe_overlap.engine import ScheduleMode as ScheduleMode
from moe_overlap.engine import ScheduleOrder as ScheduleOrder
from moe_overlap.engine import Slot as Slot
from moe_overlap.engine import SlotKey as SlotKey
from moe_overlap.engine import Step as Step
from moe_overlap.engine import StepObserver as StepObserver
from moe_overlap.engine import StreamKind as StreamKind
from moe_overlap.engine import backward_microbatches as backward_microbatches
from moe_overlap.engine import backward_pair_steps as backward_pair_steps
from moe_overlap.engine import chunk_steps as chunk_steps
from moe_overlap.engine import format_macro as format_macro
from moe_overlap.engine import format_steps as format_steps
from moe_overlap.engine import forward_microbatches as forward_microbatches
from moe_overlap.engine import forward_pair_steps as forward_pair_steps
from moe_overlap.engine import layer_pair_steps as layer_pair_steps
from moe_overlap.engine import macro_node_steps as macro_node_steps
from moe_overlap.engine import macro_run_steps as macro_run_steps
from moe_overlap.engine import macro_steps as macro_steps
from moe_overlap.engine import makespan as makespan
from moe_overlap.engine import parse_macro as parse_macro
from moe_overlap.engine import predict_ms as predict_ms
from moe_overlap.engine import replay as replay
from moe_overlap.engine import run_pair as run_pair
from moe_overlap.engine import search_order as search_order

__all__ = [
    "ChunkHooks",
    "ChunkShape",
    "Direction",
    "LayerShape",
    "MacroStep",
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
    "parse_macro",
    "predict_ms",
    "replay",
    "run_pair",
    "search_order",
]
