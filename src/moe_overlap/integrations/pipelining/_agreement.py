"""The ranks' agreement on each step's outcome, and what a failed step leaves unusable.

:class:`StepAgreement` runs one step, then the consensus (``integrations/_consensus.py``):
a step that failed on any rank raises on every rank, and one whose messages may still be
in flight poisons the schedule and taints its process groups, which a later
``prepare_schedule`` refuses. Also ``prepare_schedule``'s consensus argument checks.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any, cast

import torch.distributed as dist

from moe_overlap import ConfigError, ScheduleError
from moe_overlap.integrations._consensus import Phase, StepConsensus, Verdict, verdict_error
from moe_overlap.integrations.pipelining import _torch
from moe_overlap.integrations.pipelining._torch import Stage

__all__ = ["StepAgreement", "check_consensus", "check_untainted"]

_TAINTED: weakref.WeakSet[object] = weakref.WeakSet()
"""Process groups of a schedule whose step failed mid-communication: messages of that step
may still be in flight on them, so no new schedule may use them."""

_RECOVER = (
    "To go on: restore the last checkpoint, create new process groups for the pipeline and "
    "for expert parallelism (dist.new_group, or destroy_process_group and "
    "init_process_group), build new stages and a new schedule, and prepare_schedule it"
)


class StepAgreement:
    """The consensus after every step of one prepared schedule, and its poisoning.

    ``stepping`` (inside the outermost agreed step) and ``phase`` (how far the current step
    got) are set by the wrapped step; the consensus is made here (a collective over every
    rank, so made last, after every local check of ``prepare_schedule`` passed).
    """

    def __init__(
        self,
        schedule: Any,
        stages: Iterable[Stage],
        group: dist.ProcessGroup | None,
        timeout: timedelta | None,
    ) -> None:
        self._schedule = schedule
        self._stages = list(stages)
        self._group = group
        self.poisoned: str | None = None  # why every later step is refused
        self.stepping = False
        self.phase = Phase.BEFORE
        self._consensus = _make_consensus(self._stages, group, timeout)

    def agreed(self, run: Callable[[], object]) -> object:
        """``run()`` (one step), then the consensus: return only when it succeeded on every
        rank; otherwise raise on every rank, and poison the schedule when messages of the
        step may be in flight."""
        self._refuse_if_poisoned()
        self.stepping, self.phase = True, Phase.BEFORE
        failure: Exception | None = None
        result: object = None
        try:
            result = run()
        except Exception as e:
            failure = e
        except BaseException as e:  # KeyboardInterrupt, SystemExit: leave at once
            if self._consensus is not None:
                self._poison(f"global rank {_global_rank()} was interrupted: {type(e).__name__}")
            raise
        finally:
            self.stepping = False
        verdict = self._agree(Phase.OK if failure is None else self.phase, failure)
        if not verdict.failed:
            return result
        me = self._me()
        if not verdict.consistent:
            self._poison(f"it failed on {verdict.describe()}")
        consequence = (
            f"The step failed on {verdict.describe()}; messages of the failed step may "
            "still be in flight between the ranks, so every rank refuses this schedule's "
            f"later steps. {_RECOVER}"
        )
        raise verdict_error(
            verdict,
            failure,
            me,
            consequence=consequence,
            incomplete=f"{me}: this rank's step completed, but not the pipeline's. {consequence}",
        )

    def _agree(self, phase: Phase, failure: Exception | None) -> Verdict:
        if self._consensus is None:
            return Verdict({_global_rank(): phase}, single_process=True)
        try:
            return self._consensus.agree(phase)
        except Exception as e:  # torch's timeout or a lost peer
            within = self._consensus.timeout
            reason = (
                "the ranks did not all report this step's outcome"
                + (f" within {within}" if within is not None else "")
                + f" ({type(e).__name__}: {e})"
            )
            self._poison(reason)
            mine = "" if failure is None else f"; on this rank it failed: {failure}"
            raise ScheduleError(
                f"{self._me()}: {reason}{mine}. Messages of the step may still be in flight, "
                f"so every rank refuses this schedule's later steps. {_RECOVER}",
                position=self._me(),
            ) from e

    def _poison(self, reason: str) -> None:
        self.poisoned = reason
        for group in _groups(self._stages):
            _TAINTED.add(group)
        if self._group is not None:
            _TAINTED.add(self._group)

    def _refuse_if_poisoned(self) -> None:
        if self.poisoned is None:
            return
        raise ScheduleError(
            f"{self._me()}: this {type(self._schedule).__name__} refuses to step: an earlier "
            f"step did not complete on every rank ({self.poisoned}), and its messages may "
            f"still be in flight. {_RECOVER}",
            position=f"{self._me()}, refused",
        )

    def _me(self) -> str:
        rank: int = self._schedule.rank
        return f"pipeline rank {rank} (global rank {_global_rank()})"


def _global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> object:
    """The default process group (``None`` before ``init_process_group``: only stand-ins
    for stages are built then, never stepped)."""
    world: object = dist.group.WORLD if dist.is_initialized() else None
    return world


def _groups(stages: Iterable[Stage]) -> list[object]:
    """The process groups the stages communicate on (``None``: the default group)."""
    default = _world()
    found: list[object] = []
    for stage in stages:
        own: object = getattr(stage, "group", None)
        group = own if own is not None else default
        if group is not None and not any(group is g for g in found):
            found.append(group)
    return found


def check_untainted(stages: Iterable[Stage], consensus_group: dist.ProcessGroup | None) -> None:
    """No group of a schedule whose step failed mid-communication is used again."""
    named = [
        (f"pipeline stage {stage.stage_index}'s group", group)
        for stage in stages
        for group in _groups([stage])
    ]
    if consensus_group is not None:
        named.append(("consensus_group", consensus_group))
    for where, group in named:
        if group in _TAINTED:
            raise ConfigError(
                f"prepare_schedule: {where} was used by a schedule whose step failed while "
                "it communicated; messages of that step may still be in flight on it and "
                "would be read by this schedule. Expected new process groups, received that "
                f"one. {_RECOVER}"
            )


def check_consensus(
    stages: Iterable[Stage],
    group: dist.ProcessGroup | None,
    timeout: timedelta | None,
) -> None:
    """``prepare_schedule``'s consensus arguments (before anything is changed)."""
    given = cast(object, timeout)
    if given is not None and (not isinstance(given, timedelta) or given <= timedelta(0)):
        raise ConfigError(
            "prepare_schedule: consensus_timeout must be a positive datetime.timedelta or "
            f"None, received {given!r}"
        )
    if group is not None:
        if timeout is not None:
            raise ConfigError(
                "prepare_schedule: consensus_timeout sets the timeout of the group "
                "prepare_schedule makes; received it with a consensus_group of yours, whose "
                "own timeout applies: create it with the timeout you want"
            )
        if not isinstance(cast(object, group), dist.ProcessGroup):
            raise ConfigError(
                "prepare_schedule: consensus_group must be a torch.distributed ProcessGroup "
                f"or None, received {type(group).__name__}"
            )
        ranks = set(dist.get_process_group_ranks(group))
        needed = set[int]()
        for g in _groups(stages):
            needed |= set(dist.get_process_group_ranks(cast("dist.ProcessGroup", g)))
        if dist.get_rank() not in ranks or not needed <= ranks:
            raise ConfigError(
                "prepare_schedule: expected a consensus_group holding every rank of the "
                f"stages' groups {sorted(needed)}, received one of ranks {sorted(ranks)}"
            )


def _make_consensus(
    stages: Iterable[Stage],
    group: dist.ProcessGroup | None,
    timeout: timedelta | None,
) -> StepConsensus | None:
    """The step consensus (arguments checked): ``group``'s, else a new gloo group over the
    world; none for one process."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    if group is not None:
        return StepConsensus(group, timeout=None)
    if timeout is None:
        timeout = 2 * _longest_timeout(stages) + timedelta(seconds=30)
    return StepConsensus.create(timeout)


def _longest_timeout(stages: Iterable[Stage]) -> timedelta:
    """The longest timeout of the default group and the stages' groups (torch's default
    where a group does not say)."""
    groups = [_world(), *_groups(stages)]
    found = [_torch.group_timeout(g) for g in groups if g is not None]
    known = [t for t in found if t is not None]
    return max(known) if known else dist.default_pg_timeout
