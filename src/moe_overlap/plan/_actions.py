"""A schedule as per-rank actions, lowered by the code that runs it.

Pipeline schedules come from torch's own constructors
(:func:`~moe_overlap.integrations.pipelining.schedule_order`) and, for combined 1F1B,
the library's own pairing (:func:`~moe_overlap.integrations.pipelining.pair_overlap_f_b`);
one-rank schedules from the engine's macro steps (:func:`moe_overlap.steps.macro_steps`).
Nothing here describes a schedule a second time: it only renames torch's actions.
"""

import enum
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol, cast

from moe_overlap.engine import (
    ConfigError,
    MacroStep,
    ScheduleMode,
    backward_microbatches,
    forward_microbatches,
    macro_steps,
)
from moe_overlap.integrations.pipelining import pair_overlap_f_b, schedule_order, stage_rank
from moe_overlap.plan._layout import Layout, Schedule

__all__ = ["Act", "Action", "Lowered", "lower", "num_stages"]


class Act(str, enum.Enum):
    """What an action computes."""

    F = "F"
    """A stage's forward of one microbatch."""
    B = "B"
    """A stage's full backward (input and weight gradients)."""
    I = "I"  # noqa: E741 (torch's own letter)
    """The input-gradient part of a split backward."""
    W = "W"
    """The weight-gradient part of a split backward."""
    FB = "FB"
    """A forward and a full backward of two microbatches, overlapped (``OVERLAP_F_B``)."""
    RUN = "RUN"
    """One engine macro step of the whole model (one pipeline rank)."""


class Action(NamedTuple):
    """One action of a rank: ``stage``/``mb`` the forward's (or the only) part,
    ``b_stage``/``b_mb`` the backward's part of an ``FB``; ``macro`` a ``RUN``'s step."""

    act: Act
    stage: int
    mb: int
    b_stage: int = -1
    b_mb: int = -1
    macro: MacroStep | None = None

    def __str__(self) -> str:
        if self.act is Act.FB:
            return f"{self.stage}F{self.mb}+{self.b_stage}B{self.b_mb}"
        if self.act is Act.RUN:
            assert self.macro is not None
            f = ",".join(map(str, forward_microbatches(self.macro)))
            b = ",".join(map(str, backward_microbatches(self.macro)))
            return f"run(f:{f} b:{b})"
        return f"{self.stage}{self.act.value}{self.mb}"


class Lowered(NamedTuple):
    """A schedule lowered to actions."""

    ranks: dict[int, list[Action]]
    """Each pipeline rank's actions, in the order it runs them."""
    num_stages: int
    stage_to_rank: dict[int, int]
    torch_class: str | None
    """The torch schedule class it came from (``None``: the engine's macro steps)."""


_TORCH = {
    Schedule.GPIPE: "ScheduleGPipe",
    # torch's Schedule1F1B runs without an action list (its pipeline_order is for show, and
    # 2.13's shifts the last rank's microbatches); its interleaved runtime with one stage per
    # rank runs the same 1F1B order.
    Schedule.ONE_F_ONE_B: "ScheduleInterleaved1F1B",
    Schedule.INTERLEAVED_1F1B: "ScheduleInterleaved1F1B",
    Schedule.SERIAL: "ScheduleInterleaved1F1B",
    Schedule.COMBINED_1F1B: "ScheduleInterleaved1F1B",
    Schedule.ZERO_BUBBLE: "ScheduleInterleavedZeroBubble",
    Schedule.ZBV: "ScheduleZBVZeroBubble",
    Schedule.DUALPIPEV: "ScheduleDualPipeV",
}
_MODES = {
    Schedule.SERIAL: ScheduleMode.SERIAL,
    Schedule.COMBINED_1F1B: ScheduleMode.OVERLAPPED,
    Schedule.FILL_DRAIN: ScheduleMode.FILL_DRAIN,
}
_V = (Schedule.ZBV, Schedule.DUALPIPEV)
_SINGLE = (Schedule.GPIPE, Schedule.ONE_F_ONE_B)


def _per_rank(schedule: Schedule, layout: Layout) -> int:
    """Model stages per pipeline rank of a schedule lowered through torch's classes."""
    return 2 if schedule in _V else 1 if schedule in _SINGLE else layout.vpp


def num_stages(schedule: Schedule, layout: Layout) -> int:
    """How many model stages ``schedule`` cuts the model into on ``layout`` (before lowering
    it, which takes time in the number of stages)."""
    if schedule in _MODES and layout.pp == 1 and layout.vpp == 1:
        return 1
    return layout.pp * _per_rank(schedule, layout)


def lower(schedule: Schedule, layout: Layout) -> Lowered:
    """``schedule``'s actions on each pipeline rank of ``layout``."""
    pp, n = layout.pp, layout.microbatches
    if schedule in _MODES and pp == 1 and layout.vpp == 1:
        steps = macro_steps(n, _MODES[schedule])
        return Lowered({0: [Action(Act.RUN, 0, -1, macro=s) for s in steps]}, 1, {0: 0}, None)
    if schedule is Schedule.FILL_DRAIN:
        raise ConfigError(
            f"plan: fill_drain runs on one pipeline rank with one stage, received pp={pp}, "
            f"vpp={layout.vpp}; for a pipeline pass 'combined_1f1b' (paired interleaved 1F1B) "
            "or 'dualpipev'"
        )
    per = _per_rank(schedule, layout)
    if schedule in _V + _SINGLE and layout.vpp not in (1, per):
        raise ConfigError(
            f"plan: {schedule.value} has {per} stage(s) per pipeline rank, received "
            f"vpp={layout.vpp}; pass vpp={per}" + (" (or 1)" if per != 1 else "")
        )
    cls = _TORCH[schedule]
    order = schedule_order(cls, pp=pp, stages_per_rank=per, n_microbatches=n)
    rank_of = stage_rank(cls, pp)
    stages = pp * per
    if schedule is Schedule.COMBINED_1F1B:
        order = pair_overlap_f_b(order, num_stages=stages, stage_to_rank=rank_of)
    ranks = {
        r: [_renamed(cast(_TorchAction, a)) for a in acts if a is not None]
        for r, acts in order.items()
    }
    return Lowered(ranks, stages, {s: rank_of(s) for s in range(stages)}, cls)


if TYPE_CHECKING:

    class _TorchAction(Protocol):
        """The public fields of torch's ``_Action`` that the plan reads."""

        @property
        def computation_type(self) -> object: ...
        @property
        def stage_index(self) -> int: ...
        @property
        def microbatch_index(self) -> int | None: ...
        @property
        def sub_actions(self) -> "Sequence[_TorchAction] | None": ...

else:
    # Opaque at run time: debug mode's beartype cannot check a Protocol that is not
    # runtime-checkable (and one that is needs a rule table); torch makes the actions.
    _TorchAction = object


def _renamed(action: _TorchAction) -> Action:
    """torch's action as an :class:`Action`."""
    kind = str(action.computation_type)
    parts = action.sub_actions
    if parts is not None:
        f, b = (_renamed(p) for p in parts)
        if f.act is not Act.F or b.act is not Act.B:
            raise ConfigError(f"plan: expected an overlapped (forward, full backward), got {kind}")
        return Action(Act.FB, f.stage, f.mb, b.stage, b.mb)
    letter = _LETTERS.get(kind.rsplit(".", 1)[-1])
    if letter is None:
        raise ConfigError(f"plan: torch action {action} of kind {kind} is not one the plan runs")
    return Action(letter, action.stage_index, action.microbatch_index or 0)


_LETTERS: Mapping[str, Act] = {
    "F": Act.F,
    "FORWARD": Act.F,
    "B": Act.B,
    "FULL_BACKWARD": Act.B,
    "I": Act.I,
    "BACKWARD_INPUT": Act.I,
    "W": Act.W,
    "BACKWARD_WEIGHT": Act.W,
}
