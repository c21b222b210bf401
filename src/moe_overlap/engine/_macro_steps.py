"""The microbatch-level steps as data: which microbatches run forward and backward together.

A :data:`MacroStep` is one run of the runner: a tuple of microbatch steps
(:class:`~moe_overlap.steps.Step` s of a direction and a microbatch, ``F1``), forwards first,
at most two microbatches in all. Which macro steps :func:`~moe_overlap.combined_1f1b` runs,
and in what order, is the driver's (``_microbatch_order.py``: serial, overlapped,
fill-drain).

A macro step prints as its steps ``+``-joined (``F1+B0``) and a list of them ``" | "``-joined:
:func:`format_macro` writes that and :func:`parse_macro` reads it back (each step through
:meth:`Step.parse <moe_overlap.steps.Step.parse>`). Pure functions, tested without a tensor.
"""

from collections.abc import Sequence
from typing import cast

from moe_overlap.args import refuse
from moe_overlap.errors import ConfigError

from .core._kinds import Direction
from .core._step import Step

__all__ = [
    "MacroStep",
    "backward_microbatches",
    "format_macro",
    "forward_microbatches",
    "parse_macro",
]


MacroStep = tuple[Step, ...]
"""One run of the schedule: microbatch steps (``Step(Direction.FORWARD, 1)``, ``F1``) run together.

Forwards first, at most two microbatches in all: one forward, one backward, a forward and a
backward (one :meth:`~moe_overlap.ModelChunkSchedulePlan.run`), or two forwards or two
backwards (:func:`~moe_overlap.steps.run_pair`). Prints ``+``-joined (``F1+B0``).
"""

_F, _B = Direction.FORWARD, Direction.BACKWARD


def _macro_step(forward: Sequence[int] = (), backward: Sequence[int] = ()) -> MacroStep:
    return (*(Step(_F, i) for i in forward), *(Step(_B, i) for i in backward))


def forward_microbatches(step: Sequence[Step]) -> tuple[int, ...]:
    """The microbatches ``step`` runs forward, in order (``F1+B0``: ``(1,)``)."""
    return tuple([s.microbatch for s in step if s.direction is _F and s.microbatch is not None])


def backward_microbatches(step: Sequence[Step]) -> tuple[int, ...]:
    """The microbatches ``step`` runs backward, in order (``F1+B0``: ``(0,)``)."""
    return tuple([s.microbatch for s in step if s.direction is _B and s.microbatch is not None])


def format_macro(steps: Sequence[MacroStep]) -> str:
    """``F0 | F1+B0 | B1``: the macro steps on one line."""
    return " | ".join("+".join(map(str, s)) for s in steps)


def parse_macro(text: str) -> tuple[MacroStep, ...]:
    """Read back what :func:`format_macro` wrote."""
    if not isinstance(cast(object, text), str):
        raise refuse("parse_macro: text", "a schedule's string form 'F0 | F1+B0 | B1'", text)
    if not text.strip():
        return ()
    return tuple(_parse_macro_step(part) for part in text.split("|"))


def _parse_macro_step(text: str) -> MacroStep:
    """One macro step (``F1+B0``): microbatch steps, forwards first, two at most."""
    parts = text.strip().split("+")
    steps: list[Step] = []
    for part in parts:
        try:
            step = Step.parse(part)
        except ConfigError:
            step = None
        if (
            step is None
            or step.microbatch is None
            or step.direction not in (_F, _B)
            or step != Step(step.direction, step.microbatch)
        ):
            raise ConfigError(
                f"parse_macro: expected '+'-joined F<i> and B<i> (forwards first), e.g. "
                f"'F1+B0', received {text!r}"
            )
        steps.append(step)
    macro = _macro_step(forward_microbatches(steps), backward_microbatches(steps))
    if "+".join(map(str, macro)) != text.strip() or len(parts) > 2:
        raise ConfigError(
            f"parse_macro: expected at most two parts, forwards before backwards "
            f"(e.g. 'F1+B0'), received {text!r}"
        )
    return macro
