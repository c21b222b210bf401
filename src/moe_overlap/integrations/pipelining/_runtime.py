"""The pipelining runtime: :func:`prepare_schedule` and :class:`PipelineOverlap`.

:class:`PipelineOverlap` composes the runtime's parts: the stage checks
(``_stage_checks``), the custom functions of the compute actions (``_actions``) over the
plans between actions (``_plan_runner``), the wrapped step (``_wrapped_step``) and the
consensus after it (``_agreement``). torch's internals only through ``_torch``.
"""

from __future__ import annotations

import weakref
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from moe_overlap import ConfigError, ScheduleOptions
from moe_overlap.args import BOOL, Instance, Opt, check_arg
from moe_overlap.engine.contracts import OPT_STEP_OBSERVER
from moe_overlap.integrations.pipelining import _torch
from moe_overlap.integrations.pipelining._actions import ActionHandlers
from moe_overlap.integrations.pipelining._agreement import (
    StepAgreement,
    check_consensus,
    check_untainted,
)
from moe_overlap.integrations.pipelining._lowering import check_actions, pair_overlap_f_b
from moe_overlap.integrations.pipelining._plan_runner import PlanRunner
from moe_overlap.integrations.pipelining._stage_checks import check_stage, stage_options
from moe_overlap.integrations.pipelining._torch import Stage, check_torch
from moe_overlap.integrations.pipelining._wrapped_step import wrap_step
from moe_overlap.steps import StepObserver

__all__ = ["PipelineOverlap", "prepare_schedule"]

_PREPARED: weakref.WeakSet[object] = weakref.WeakSet()
"""The schedules :func:`prepare_schedule` has prepared (each only once)."""

_OPTIONS = Opt(Instance(ScheduleOptions, "a ScheduleOptions"))
_OBSERVER = OPT_STEP_OBSERVER


def prepare_schedule(
    schedule: object,
    *,
    pair: bool = False,
    overlap: bool = True,
    options: ScheduleOptions | None = None,
    observer: StepObserver | None = None,
    consensus_group: dist.ProcessGroup | None = None,
    consensus_timeout: timedelta | None = None,
) -> PipelineOverlap:
    """Make ``schedule`` run its compute actions through ``moe_overlap`` chunk plans.

    ``schedule`` is a multi-stage ``torch.distributed.pipelining`` schedule run by torch's
    action runtime (``ScheduleDualPipeV``, ``ScheduleInterleaved1F1B``,
    ``ScheduleLoopedBFS``, ``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``)
    built from ``PipelineStage`` s whose modules are :class:`~moe_overlap.PreprocessableModel`
    chunks: ``pre_process`` on the first stage only (it takes the token ids), ``post_process``
    on the last only (its output goes to the schedule's ``loss_fn``), every other stage
    taking one hidden-states tensor; ``forward`` of each is its plain path, which torch's
    shape inference and an unprepared schedule run. The user then calls
    ``schedule.step(...)`` as before.

    - ``FORWARD`` runs a plan's forward, ``FULL_BACKWARD`` its backward (from the received
      output gradient, or from the loss on the last stage); ``OVERLAP_F_B`` runs the two
      plans as one :meth:`~moe_overlap.ModelChunkSchedulePlan.run` (``overlap=False``: one
      after the other, for comparison).
    - ``BACKWARD_INPUT`` runs the whole backward and keeps the weight gradients aside;
      ``BACKWARD_WEIGHT`` adds them to ``.grad`` as torch's split does (values as torch's
      zero-bubble split, without its compute saving).
    - ``pair=True`` first lowers the schedule's compute actions with
      :func:`pair_overlap_f_b` (for schedules that emit no ``OVERLAP_F_B`` of their own).
    - ``options``: the plans' :class:`~moe_overlap.ScheduleOptions`; by default each stage
      module's ``schedule_options()`` when it has one, else the defaults.
    - ``observer`` (e.g. a :class:`~moe_overlap.timeline.Timeline`) times every plan step.

    Refused with :class:`~moe_overlap.ConfigError` / :class:`~moe_overlap.IntegrationError`:
    a torch release not in :data:`TESTED_TORCH`, a single-stage schedule (``Schedule1F1B``,
    ``ScheduleGPipe``: no action runtime), a schedule prepared twice, a stage module that is
    not a ``PreprocessableModel`` or whose ``pre_process`` / ``post_process`` disagree with
    the stage's place, one wrapped by DDP or FSDP, a stage with a ``dw_builder``, and an
    ``OVERLAP_F_B`` whose parts are not one ``FORWARD`` and one ``FULL_BACKWARD``. Each
    ``step`` checks every microbatch's inputs of this rank's stages before anything runs
    (torch's shape inference included): the first stage's one tensor of token ids (int64 or
    int32), and only the stage keywords a plan takes (``position_ids``, ``attention_mask``,
    ``padding_mask``), each a tensor or ``None`` that the stage module's ``forward`` takes
    and the model reads.

    Frozen parameters run as in torch's own schedule: a stage whose output needs no grad
    runs no backward, a loss that needs no grad backs nothing. A parameter two nodes of
    one stage use (a module shared by two layers of the stage) would be added to ``.grad``
    in another order than torch's one backward of the stage: counted at the first step and
    whenever the parameters change, it is an :class:`~moe_overlap.IntegrationError` when the
    step returns (one tied across two stages of the rank is added once per stage, as by
    torch's run).

    A failure inside a plan raises :class:`~moe_overlap.ScheduleError` naming the pipeline
    rank, the action (stage, microbatch) and the plan step. After every step, failed or
    not, the ranks agree on its outcome (one all-reduce of a per-rank flag over
    ``consensus_group``), so a step that failed on any rank raises on every rank:

    - failed on some rank while the step communicated: every rank raises a
      :class:`~moe_overlap.ScheduleError` (the failing rank its own, the others one naming
      the failed ranks), and the schedule refuses every later step, on every rank, before
      any communication; its process groups are refused by a later ``prepare_schedule``.
      Recover by restoring a checkpoint on new process groups, stages and schedule.
    - failed before the step communicated on every rank (the checks ``step`` runs before
      the microbatches, the library's check for pending delayed weight gradients), or
      after its communication completed: the errors are raised as they are
      (ranks that did not fail raise a ``ScheduleError``); zero the gradients and drop
      pending delayed weight gradients (:func:`~moe_overlap.blocks.discard_wgrad`), and the
      next step is exact. With one process (world size 1) this holds for every failure.

    ``consensus_group``: by default a new gloo group over every rank of the default group,
    made here (a collective: every rank prepares its schedule, in the same order as its
    other group creations), whose timeout is ``consensus_timeout`` (default: twice the
    longest timeout of the default group and the stages' groups, plus 30 seconds: a rank
    blocked in a receive from a failed peer reports after its group's timeout). Or a group
    of yours holding every rank of the stages' groups, on which every rank runs the same
    collectives between steps (gloo: a CPU flag; else a CUDA flag, a device sync per step).
    A ``KeyboardInterrupt`` (any ``BaseException`` not an ``Exception``) propagates at once,
    without the consensus; the peers' consensus then times out and raises.
    """
    check_torch()
    return PipelineOverlap(
        schedule,
        pair=pair,
        overlap=overlap,
        options=options,
        observer=observer,
        consensus_group=consensus_group,
        consensus_timeout=consensus_timeout,
    )


class PipelineOverlap:
    """A schedule prepared by :func:`prepare_schedule` (keeps the plans between actions).

    Attributes:
        schedule: the torch schedule.
        paired: how many ``OVERLAP_F_B`` actions this rank runs per step.
    """

    def __init__(
        self,
        schedule: object,
        *,
        pair: bool,
        overlap: bool,
        options: ScheduleOptions | None,
        observer: StepObserver | None,
        consensus_group: dist.ProcessGroup | None = None,
        consensus_timeout: timedelta | None = None,
    ) -> None:
        check_torch()
        if not _torch.is_action_runtime(schedule):
            raise ConfigError(
                "prepare_schedule: expected a multi-stage torch.distributed.pipelining "
                "schedule run by torch's action runtime (ScheduleDualPipeV, "
                "ScheduleInterleaved1F1B, ScheduleLoopedBFS, ...), received "
                f"{type(schedule).__name__}; a single-stage schedule (Schedule1F1B, "
                "ScheduleGPipe) has no actions to overlap: use ScheduleInterleaved1F1B"
            )
        if schedule in _PREPARED:
            raise ConfigError(
                f"prepare_schedule: this {type(schedule).__name__} is already prepared; "
                "prepare a schedule once"
            )
        w = "prepare_schedule"
        check_arg(w, "pair", pair, BOOL)
        check_arg(w, "overlap", overlap, BOOL)
        check_arg(w, "options", options, _OPTIONS)
        check_arg(w, "observer", observer, _OBSERVER)
        self.schedule: Any = schedule  # torch's schedules are untyped
        stages: dict[int, Stage] = {s.stage_index: s for s in _torch.schedule_stages(schedule)}
        for stage in stages.values():
            check_stage(stage)
        check_untainted(stages.values(), consensus_group)
        check_consensus(stages.values(), consensus_group, consensus_timeout)
        options_of = {i: stage_options(st, options) for i, st in stages.items()}
        if pair:
            _pair(schedule)
        self.paired = check_actions(_torch.rank_actions(schedule))
        self._runner = PlanRunner(schedule, stages, options_of, observer)
        # Last: a collective over every rank, after every local check passed.
        agreement = StepAgreement(schedule, stages.values(), consensus_group, consensus_timeout)
        self._handlers = ActionHandlers(self._runner, overlap=overlap)
        self._handlers.register(schedule)
        wrap_step(schedule, self._runner, agreement)
        _PREPARED.add(schedule)

    @property
    def rank(self) -> int:
        rank: int = self.schedule.rank
        return rank

    @property
    def overlap(self) -> bool:
        """Whether an ``OVERLAP_F_B`` runs its two plans as one overlapped run."""
        return self._handlers.overlap

    @overlap.setter
    def overlap(self, value: bool) -> None:
        self._handlers.overlap = check_arg("PipelineOverlap", "overlap", value, BOOL)

    @property
    def observer(self) -> StepObserver | None:
        """What times every plan step (``None``: nothing)."""
        return self._runner.observer

    @observer.setter
    def observer(self, value: StepObserver | None) -> None:
        check_arg("PipelineOverlap", "observer", value, _OBSERVER)
        self._runner.observer = value

    def release(self) -> None:
        """Release every plan kept between actions and the weight gradients held aside."""
        self._runner.release()


def _pair(schedule: Any) -> None:
    """Lower ``schedule``'s compute actions with :func:`pair_overlap_f_b`."""
    to_rank = _torch.stage_to_rank(schedule)
    lowered = pair_overlap_f_b(
        _torch.pipeline_order(schedule),
        num_stages=_torch.num_stages(schedule),
        stage_to_rank=to_rank.__getitem__,
    )
    _torch.set_pipeline_order(schedule, lowered)
