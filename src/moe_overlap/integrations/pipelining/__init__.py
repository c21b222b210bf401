"""Run ``torch.distributed.pipelining`` schedules through ``moe_overlap`` plans.

:func:`prepare_schedule` makes a schedule's compute actions run as chunk plans: ``F`` a
plan's forward, ``B`` its backward, and ``OVERLAP_F_B`` (a forward of one (stage,
microbatch) with a full backward of another on the same rank) one
:meth:`~moe_overlap.ModelChunkSchedulePlan.run` that overlaps the all-to-all of one under
the compute of the other. ``ScheduleDualPipeV`` emits such actions itself;
:func:`pair_overlap_f_b` (``prepare_schedule(..., pair=True)``) lowers any other
compute-only schedule, e.g. ``ScheduleInterleaved1F1B``, by pairing neighbouring forwards
and backwards, as Megatron-Core's combined 1F1B does with virtual pipeline stages.
Communication actions (``SEND_*`` / ``RECV_*``), ``REDUCE_GRAD`` (gradient scaling) and
the loss function stay torch's own.

Its private modules: ``_torch`` holds every private torch name it uses (listed there), the
torch 2.11 / 2.13 shims and :data:`TESTED_TORCH`; ``_lowering`` the pure functions over
schedule data (:func:`pair_overlap_f_b`, tested without a process group), with ``_waits``
(what each action waits for: a pairing checked without re-running torch's placement); ``_runtime``
:func:`prepare_schedule` and :class:`PipelineOverlap`, which composes the others:
``_stage_checks`` (what a stage and its inputs must be), ``_actions`` (the custom functions
of the compute actions) over ``_plan_runner`` (the plans between actions),
``_wrapped_step`` (the schedule's ``step``) and ``_agreement`` (the consensus after it).
Tested with torch 2.11 and 2.13; on another release every function raises
:class:`~moe_overlap.ConfigError` before touching torch's internals (:func:`check_torch`).
"""

from moe_overlap.integrations.pipelining._lowering import (
    SCHEDULE_CLASSES,
    pair_overlap_f_b,
    schedule_order,
    stage_rank,
)
from moe_overlap.integrations.pipelining._runtime import PipelineOverlap, prepare_schedule
from moe_overlap.integrations.pipelining._torch import TESTED_TORCH, check_torch

__all__ = [
    "SCHEDULE_CLASSES",
    "TESTED_TORCH",
    "PipelineOverlap",
    "check_torch",
    "pair_overlap_f_b",
    "prepare_schedule",
    "schedule_order",
    "stage_rank",
]
