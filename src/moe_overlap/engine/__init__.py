"""The engine: the schedule core (:mod:`.core`) and the checks attached to it.

The floor every other subpackage stands on; it imports none of them, only the shared
top-level modules: :mod:`moe_overlap.args` (the argument specs every subpackage checks its
arguments with), the errors, the Protocols and :mod:`moe_overlap.microbatch`. Its modules
are private (``_*.py``), except :mod:`moe_overlap.engine.contracts` (each Protocol's rule
table), which the other subpackages share. ``__all__`` below is what else they use of it,
each name with who uses it and why; nothing more. Users import from :mod:`moe_overlap` and
its public modules (:mod:`~moe_overlap.steps`, :mod:`~moe_overlap.streams`,
:mod:`~moe_overlap.protocols`, :mod:`~moe_overlap.microbatch`, :mod:`~moe_overlap.inputs`,
:mod:`~moe_overlap.wgrad`, :mod:`~moe_overlap.errors`, :mod:`~moe_overlap.megatron`), which
re-export the engine's private modules directly (``docs/concepts.md`` lists where each name
lives).

Importing the engine attaches the library's checks to the core as guards and, in debug
mode (``MOE_OVERLAP_DEBUG=1``), installs beartype first, before any other module of the
package is imported.
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
from moe_overlap.engine._guards import without_guards as without_guards
from moe_overlap.engine._macro_steps import MacroStep as MacroStep
from moe_overlap.engine._macro_steps import backward_microbatches as backward_microbatches
from moe_overlap.engine._macro_steps import forward_microbatches as forward_microbatches
from moe_overlap.engine._microbatch_order import ScheduleMode as ScheduleMode
from moe_overlap.engine._microbatch_order import macro_steps as macro_steps
from moe_overlap.engine._order_search import SlotKey as SlotKey
from moe_overlap.engine._order_search import macro_run_steps as macro_run_steps
from moe_overlap.engine._order_search import replay as replay
from moe_overlap.engine._owed_wgrad import check_wgrad_done as check_wgrad_done
from moe_overlap.engine._owed_wgrad import owed_wgrad as owed_wgrad
from moe_overlap.engine._owed_wgrad import pending_count as pending_count
from moe_overlap.engine._recompute_hold import hold_for_recompute as hold_for_recompute
from moe_overlap.engine._registrations import registrations as registrations
from moe_overlap.engine._shared_params import StageAccumulations as StageAccumulations
from moe_overlap.engine._stream_check import start_from_env as _start_from_env
from moe_overlap.engine._stream_setup import make_event as make_event
from moe_overlap.engine._use_stream import wait_stream as wait_stream
from moe_overlap.engine.core._node_errors import check_marked as check_marked
from moe_overlap.engine.core._options import Hook as Hook
from moe_overlap.engine.core._state import ChunkState as ChunkState
from moe_overlap.engine.core._step import Step as Step
from moe_overlap.engine.core._steps import ChunkShape as ChunkShape
from moe_overlap.engine.core._steps import Direction as Direction
from moe_overlap.engine.core._steps import LayerShape as LayerShape
from moe_overlap.engine.core._steps import Role as Role
from moe_overlap.engine.core._steps import Slot as Slot
from moe_overlap.engine.core._steps import StreamKind as StreamKind
from moe_overlap.engine.core._steps import chunk_steps as chunk_steps
from moe_overlap.engine.core._streams import AnyEvent as AnyEvent
from moe_overlap.engine.core._streams import AnyStream as AnyStream
from moe_overlap.engine.core._streams import CpuStream as CpuStream
from moe_overlap.engine.core._streams import cpu_default_stream as cpu_default_stream
from moe_overlap.engine.core._streams import current_stream as current_stream
from moe_overlap.engine.core._streams import record_event as record_event
from moe_overlap.engine.core._streams import record_tensor_on as record_tensor_on
from moe_overlap.engine.core._streams import release_storage as release_storage
from moe_overlap.engine.core._streams import stream_context as stream_context
from moe_overlap.engine.core._streams import wait_event as wait_event
from moe_overlap.engine.core._wgrad_claims import WgradClaim as WgradClaim
from moe_overlap.engine.core._wgrad_claims import claim_wgrad as claim_wgrad
from moe_overlap.engine.core._wgrad_claims import wgrad_claimed as wgrad_claimed
from moe_overlap.errors import ConfigError as ConfigError
from moe_overlap.errors import MoeOverlapError as MoeOverlapError

_start_from_env()  # MOE_OVERLAP_STREAM_CHECK=1: the stream-order checker for the whole process

__all__ = [
    "DEBUG",  # blocks: the dispatcher's and CUDA graphs' costly checks run in debug mode
    "AnyEvent",  # blocks: the all-to-all chunks record and wait on the schedule's events
    "AnyStream",  # blocks: the all-to-all chunks and the loopback run on a given stream
    "Bypass",  # adapters: name the wrappers (checkpoint, FSDP, compile) a model may carry
    "BypassedModule",  # adapters: the findings they report and refuse
    "ChunkShape",  # plan: simulates the engine's own chunk step lists
    "ChunkState",  # adapters: a wrapped model's layers read the microbatch's chunk state
    "ConfigError",  # plan: refuses a layout with the library's error
    "CpuStream",  # blocks: the all-to-all chunks and the loopback model CPU streams
    "Direction",  # plan: a step's direction in its cost tables
    "Hook",  # models: the type of a graphed wgrad replay
    "LayerShape",  # plan: simulates the engine's own layer step lists
    "MacroStep",  # plan: the macro steps it schedules are the driver's
    "MoeOverlapError",  # plan: catches the library's errors when searching layouts
    "Phase",  # integrations: the step consensus votes per phase
    "Role",  # plan: a step's role (forward, backward) in its simulation
    "ScheduleMode",  # plan: the driver's microbatch orders
    "Slot",  # plan: a step's slot in its cost tables
    "SlotKey",  # plan: keys the measured slot times the order search reads
    "StageAccumulations",  # integrations: a prepared schedule counts shared parameters
    "Step",  # plan: simulates the engine's steps
    "StepConsensus",  # integrations: the vote after a step under expert parallelism
    "StreamKind",  # plan: a step's stream in its simulation
    "Verdict",  # integrations: what the vote concluded
    "WgradClaim",  # blocks: CUDA graphs claim the delayed modules they replay
    "backward_microbatches",  # plan: which microbatches a macro step runs backward
    "check_bypassed",  # integrations: a pipeline stage refuses the wrappers a plan would skip
    "check_marked",  # blocks: PlainContext.mark_non_differentiable checks as a node does
    "check_model",  # integrations: a pipeline stage's model is checked as a plan's
    "check_module",  # adapters: the wrappers found on a wrapped model
    "check_wgrad_done",  # models, adapters, integrations: nothing owed before optimizer.step
    "chunk_steps",  # plan: the step list of a chunk it simulates
    "claim_wgrad",  # adapters: the plain path claims the delayed modules it runs
    "cpu_default_stream",  # blocks: the CPU stand-in for CUDA's default stream
    "current_stream",  # blocks: the stream current on a tensor's device
    "forward_microbatches",  # plan: which microbatches a macro step runs forward
    "hold_for_recompute",  # blocks, adapters: recomputed regions hold their inputs
    "macro_run_steps",  # plan: the step lists of a whole run
    "macro_steps",  # plan: the driver's microbatch order
    "make_event",  # blocks: the all-to-all chunks' events
    "owed_wgrad",  # integrations: what a pipeline stage still owes after a failed step
    "pending_count",  # integrations: ... per module
    "record_event",  # blocks: the all-to-all chunks order their streams as nodes do
    "record_tensor_on",  # blocks: ... and tell the caching allocator
    "registrations",  # blocks: a graphed block walks its parameters again only after one
    "release_storage",  # blocks: ... and free as the free-input policy does
    "replay",  # plan: replays a step list against measured times
    "stream_context",  # blocks: the all-to-all chunks and the loopback switch streams
    "verdict_error",  # integrations: the vote's error
    "wait_event",  # blocks: see record_event
    "wait_stream",  # blocks: see record_event
    "wgrad_claimed",  # blocks: a delayed linear queues its wgrad only while claimed
    "without_guards",  # benchmarks: bench_host_megatron --without-guards times the checks
]
