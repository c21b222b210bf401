"""After every step, the ranks agree whether it failed anywhere.

A step that fails on one rank leaves its peers blocked in a receive or an all-to-all (they
fail at their process group's timeout) or, when every rank fails, with receives posted
that the next step's messages would fill. :class:`StepConsensus` is one tiny all-reduce
over a group of its own: each rank reports how far its step got (:class:`Phase`), and every
rank learns every rank's report, so no rank returns normally from a step that failed
elsewhere. Only public ``torch.distributed`` API is used.

Two users: the pipelining runtime (``integrations/pipelining``, through
``integrations/_consensus``) and :func:`~moe_overlap.combined_1f1b` given a
``consensus_group`` (:class:`VotedStep`: expert parallelism without pipelining).
"""

from __future__ import annotations

import contextlib
import enum
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar, cast

import torch
import torch.distributed as dist

from moe_overlap.args import GROUP, check_arg
from moe_overlap.errors import ConfigError, ScheduleError

__all__ = ["Phase", "StepConsensus", "Verdict", "VotedStep", "verdict_error"]

T = TypeVar("T")

# torch.distributed leaves these unannotated; give them types once, here.
_all_reduce = cast(
    "Callable[..., object]",
    dist.all_reduce,  # pyright: ignore[reportUnknownMemberType]
)
_new_group = cast(
    "Callable[..., object]",
    dist.new_group,  # pyright: ignore[reportUnknownMemberType]
)
_group_ranks = cast("Callable[[object], list[int]]", dist.get_process_group_ranks)


class Phase(enum.IntEnum):
    """How far a rank's step got (the value each rank reports; 0 is "no report")."""

    OK = 1
    """Completed."""
    BEFORE = 2
    """Failed before the step communicated (torch's input checks, the library's checks)."""
    AFTER = 3
    """Failed after the step's communication completed (every receive waited)."""
    DURING = 4
    """Failed while the step communicated: messages may be in flight."""


_WORDS = {
    Phase.BEFORE: "before the step communicated",
    Phase.AFTER: "after the step's communication completed",
    Phase.DURING: "while the step communicated",
}


@dataclass(frozen=True, slots=True)
class Verdict:
    """Every rank's :class:`Phase` for one step, by global rank."""

    phases: dict[int, Phase]
    single_process: bool = False

    @property
    def failed(self) -> list[int]:
        """The global ranks whose step failed."""
        return [r for r, p in sorted(self.phases.items()) if p != Phase.OK]

    @property
    def consistent(self) -> bool:
        """Nothing of the step can be in flight: one process, or every rank completed the
        step's communication, or none started it."""
        kinds = set(self.phases.values())
        return self.single_process or kinds <= {Phase.OK, Phase.AFTER} or kinds == {Phase.BEFORE}

    def describe(self) -> str:
        """``global rank 1 (while the step communicated), global rank 3 (...)``."""
        return ", ".join(f"global rank {r} ({_WORDS[self.phases[r]]})" for r in self.failed)


class StepConsensus:
    """One all-reduce of every rank's :class:`Phase` over ``group``.

    ``group`` is used for nothing else (its collectives stay aligned: one per step on every
    rank); a flag tensor on the CPU when the group has a gloo backend, else on the current
    CUDA device.
    """

    def __init__(self, group: object, *, timeout: timedelta | None) -> None:
        self.group = group
        self.timeout = timeout
        self.ranks: list[int] = _group_ranks(group)
        backend = str(dist.get_backend(cast("dist.ProcessGroup", group)))
        gloo = "gloo" in backend
        self.device = torch.device("cpu") if gloo else torch.device("cuda")

    @classmethod
    def create(cls, timeout: timedelta) -> StepConsensus:
        """A new gloo group over every rank of the default group (a collective: every rank
        calls it, in the same order as its other group creations)."""
        return cls(_new_group(backend="gloo", timeout=timeout), timeout=timeout)

    def agree(self, phase: Phase) -> Verdict:
        """Every rank's phase (a collective; raises torch's error when a rank does not
        report within the group's timeout)."""
        me = self.ranks.index(dist.get_rank())
        flags = torch.zeros(len(self.ranks), dtype=torch.int32, device=self.device)
        flags[me] = int(phase)
        _all_reduce(flags, group=self.group)
        values = cast("Sequence[int]", flags.cpu().tolist())  # pyright: ignore[reportUnknownMemberType]
        return Verdict({r: _phase(v) for r, v in zip(self.ranks, values, strict=True)})


def _phase(value: int) -> Phase:
    try:
        return Phase(value)
    except ValueError:  # an internal invariant: each rank writes only its own slot
        raise RuntimeError(f"step consensus: received the report {value}, not a Phase") from None


# -- combined_1f1b's vote (expert parallelism without pipelining) --------------------------

_RECOVER = (
    "To go on: restore the last checkpoint, on every rank, into a new model built on new "
    "expert-parallel process groups (dist.new_group, or destroy_process_group and "
    "init_process_group), and pass a new consensus_group"
)


@dataclass(slots=True)
class _Votes:
    """A consensus group's :class:`StepConsensus` and how many steps voted on it."""

    consensus: StepConsensus
    steps: int = 0


_VOTES: weakref.WeakKeyDictionary[object, _Votes] = weakref.WeakKeyDictionary()
"""Per ``consensus_group``: its consensus, made at first use."""

_POISONED: weakref.WeakKeyDictionary[object, str] = weakref.WeakKeyDictionary()
"""Models and consensus groups of a step that failed while it communicated (messages of it
may still be in flight on the model's expert-parallel groups), with why; refused."""


class VotedStep:
    """One ``where`` step of ``model`` (:func:`~moe_overlap.combined_1f1b`), voted on over
    ``group`` when one is given.

    Made before anything else of the step: checks ``group`` (:class:`ConfigError`) and
    refuses a model or group whose earlier step failed while it communicated
    (:class:`ScheduleError`), before any communication. The step sets :attr:`phase` as it
    goes (:attr:`Phase.DURING` before its first collective, :attr:`Phase.AFTER` once its
    last one completed); :meth:`run` runs it and, with a group, the vote after it. Without a
    group, :meth:`run` only runs the step (failures are raised as they are).
    """

    def __init__(self, where: str, model: object, group: object) -> None:
        self.where = where
        self.phase = Phase.BEFORE
        self._model = model
        self._group = group
        self._votes: _Votes | None = None
        if group is not None:
            check_arg(where, "consensus_group", group, GROUP)
            pg = cast("dist.ProcessGroup", group)
            if dist.get_rank() not in _group_ranks(pg):
                raise ConfigError(
                    f"{where}: consensus_group must hold this rank (global rank "
                    f"{dist.get_rank()}) and every rank of the model's expert-parallel "
                    f"groups, received one of ranks {_group_ranks(pg)}"
                )
        self._refuse_if_poisoned()
        if group is not None:
            votes = _VOTES.get(group)
            if votes is None:
                votes = _VOTES[group] = _Votes(StepConsensus(group, timeout=None))
            self._votes = votes
        self.step = self._votes.steps if self._votes is not None else None
        """This step's index among the steps voted on ``group`` (from 0; the same on every
        rank), or None without a group."""

    def run(self, body: Callable[[], T]) -> T:
        """``body()`` (the step), then the vote: return only when the step succeeded on
        every rank; otherwise raise on every rank, and poison the model and the group when
        messages of the step may be in flight."""
        votes = self._votes
        if votes is None:
            return body()
        votes.steps += 1
        failure: Exception | None = None
        done: list[T] = []  # the step's result, once it returned
        try:
            done.append(body())
        except Exception as e:
            failure = e
        except BaseException as e:  # KeyboardInterrupt, SystemExit: leave at once, no vote
            self._poison(f"global rank {dist.get_rank()} was interrupted: {type(e).__name__}")
            raise
        verdict = self._agree(votes.consensus, Phase.OK if failure is None else self.phase, failure)
        if not verdict.failed:
            return done[0]
        me = self._me()
        if not verdict.consistent:
            self._poison(f"step {self.step} failed on {verdict.describe()}")
        consequence = (
            f"{me}: the step failed on {verdict.describe()}; all-to-all messages of the "
            "failed step may still be in flight between the expert-parallel ranks, so every "
            "rank refuses later steps of this model and of this consensus_group. "
            f"{_RECOVER}"
        )
        raise verdict_error(
            verdict,
            failure,
            me,
            consequence=consequence,
            incomplete=f"{me}: this rank's step completed, but not every rank's.\n{consequence}",
        )

    def _agree(self, consensus: StepConsensus, phase: Phase, failure: Exception | None) -> Verdict:
        if len(consensus.ranks) == 1:  # nothing to agree on; no peer to leave messages
            return Verdict({dist.get_rank(): phase}, single_process=True)
        try:
            return consensus.agree(phase)
        except Exception as e:  # torch's timeout or a lost peer
            reason = (
                "the ranks did not all report this step's outcome on the consensus_group "
                f"({type(e).__name__}: {e})"
            )
            self._poison(f"step {self.step}: {reason}")
            mine = "" if failure is None else f"; on this rank it failed: {failure}"
            raise ScheduleError(
                f"{self._me()}: {reason}{mine}. All-to-all messages of the step may still be "
                "in flight, so this rank refuses later steps of this model and of this "
                f"consensus_group. {_RECOVER}",
                position=self._me(),
            ) from e

    def _me(self) -> str:
        return f"global rank {dist.get_rank()}, {self.where} step {self.step}"

    def _poison(self, reason: str) -> None:
        for key in (self._model, self._group):
            if key is None:
                continue
            with contextlib.suppress(TypeError):  # a model not weakly referenceable: the
                _POISONED[key] = reason  # group still refuses

    def _refuse_if_poisoned(self) -> None:
        for key, what in ((self._model, "this model"), (self._group, "this consensus_group")):
            try:
                reason = None if key is None else _POISONED.get(key)
            except TypeError:  # not weakly referenceable (never poisoned)
                reason = None
            if reason is None:
                continue
            rank = dist.get_rank() if dist.is_initialized() else 0
            raise ScheduleError(
                f"global rank {rank}: {self.where} refuses to step {what}: an earlier "
                f"step did not complete on every rank ({reason}), and its all-to-all "
                f"messages may still be in flight on the model's expert-parallel groups. "
                f"{_RECOVER}",
                position=f"global rank {rank}, {self.where}, refused",
            )


def verdict_error(
    verdict: Verdict, failure: Exception | None, me: str, *, consequence: str, incomplete: str
) -> Exception:
    """What a rank raises after a failed ``verdict`` (its own ``failure`` or ``None``; ``me``
    names the rank): consistent, the failure itself, or a :class:`~moe_overlap.ScheduleError`
    saying nothing is in flight; inconsistent (the caller poisons first), the failure
    completed with ``consequence``, or ``incomplete`` where this rank did not fail."""
    if verdict.consistent:
        if failure is not None:
            return failure
        return ScheduleError(
            f"{me}: this rank's step completed, but the step failed on "
            f"{verdict.describe()}; nothing of it is in flight. Zero the gradients and "
            "drop pending delayed weight gradients (discard_wgrad) on every rank; the "
            "next step is exact",
            position=f"{me}, after the step",
        )
    if isinstance(failure, ScheduleError):
        error = ScheduleError(f"{failure}\n{consequence}", position=failure.position)
    elif failure is not None:
        error = ScheduleError(
            f"{me}: the step failed here: {type(failure).__name__}: {failure}\n{consequence}",
            position=me,
        )
    else:
        return ScheduleError(incomplete, position=f"{me}, after the step")
    error.__cause__ = failure
    return error
