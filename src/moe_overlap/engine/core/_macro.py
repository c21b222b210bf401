"""The microbatch-level schedule as data: which microbatches run forward and backward together.

:func:`macro_steps` lists, for ``n`` microbatches and a :class:`ScheduleMode`, the steps
:func:`~moe_overlap.combined_1f1b` runs, each a :class:`MacroStep` (a tuple of forward
microbatches and a tuple of backward ones)::

    serial      F0 | B0 | F1 | B1 | ... | B(N-1)
    overlapped  F0 | F1+B0 | F2+B1 | ... | F(N-1)+B(N-2) | B(N-1)
    fill-drain  F0+F1 | F2+B0 | ... | F(N-1)+B(N-3) | B(N-2)+B(N-1)

A step prints as ``F1+B0`` (forwards first, each ``F<i>`` or ``B<i>``) and
:meth:`MacroStep.parse` reads that back; :func:`format_macro` / :func:`parse_macro` do the
same for a whole list, ``" | "``-separated. Pure functions, tested without a tensor.
"""

import enum
import re
from collections.abc import Sequence
from typing import NamedTuple, cast

from ._errors import ConfigError
from .args import NON_NEGATIVE, OneOf, check_arg, refuse

__all__ = ["MacroStep", "ScheduleMode", "format_macro", "macro_steps", "parse_macro"]


class ScheduleMode(str, enum.Enum):
    """How :func:`~moe_overlap.combined_1f1b` orders its microbatches."""

    SERIAL = "serial"
    """Each microbatch's forward then its backward, nothing overlapped (``overlap=False``)."""
    OVERLAPPED = "overlapped"
    """Combined 1F1B: forward ``i+1`` overlapped with backward ``i``."""
    FILL_DRAIN = "fill-drain"
    """Combined 1F1B whose first two forwards and last two backwards are overlapped too."""

    @classmethod
    def of(cls, *, overlap: bool, fill_drain: bool) -> "ScheduleMode":
        """The mode ``combined_1f1b(overlap=..., fill_drain=...)`` runs (checked there)."""
        if not overlap:
            return cls.SERIAL
        return cls.FILL_DRAIN if fill_drain else cls.OVERLAPPED


class MacroStep(NamedTuple):
    """One run of the schedule: these microbatches' forwards with those's backwards.

    At most two microbatches in all: one forward, one backward, a forward and a backward
    (one :meth:`~moe_overlap.ModelChunkSchedulePlan.run`), or two forwards or two
    backwards (:func:`~moe_overlap.steps.run_pair`).
    """

    forward: tuple[int, ...] = ()
    backward: tuple[int, ...] = ()

    def __str__(self) -> str:
        return "+".join([*(f"F{i}" for i in self.forward), *(f"B{i}" for i in self.backward)])

    @classmethod
    def parse(cls, text: str) -> "MacroStep":
        """Read a step back from its string form, e.g. ``F1+B0`` or ``B2+B3``."""
        if not isinstance(cast(object, text), str):
            raise refuse("MacroStep.parse: text", "a macro step's string form 'F1+B0'", text)
        parts = text.strip().split("+")
        if not all(_PART.fullmatch(p) for p in parts):
            raise ConfigError(
                f"MacroStep.parse: expected '+'-joined F<i> and B<i> (forwards first), e.g. "
                f"'F1+B0', received {text!r}"
            )
        forward = tuple(int(p[1:]) for p in parts if p[0] == "F")
        backward = tuple(int(p[1:]) for p in parts if p[0] == "B")
        step = cls(forward, backward)
        if str(step) != text.strip() or len(parts) > 2:
            raise ConfigError(
                f"MacroStep.parse: expected at most two parts, forwards before backwards "
                f"(e.g. 'F1+B0'), received {text!r}"
            )
        return step


_PART = re.compile(r"[FB]\d+")
_MODE = OneOf(tuple(ScheduleMode))


def macro_steps(n: int, mode: ScheduleMode) -> tuple[MacroStep, ...]:
    """The steps of ``n`` microbatches in ``mode`` (fill-drain needs two: with one
    microbatch it is the overlapped order)."""
    n = check_arg("macro_steps", "n", n, NON_NEGATIVE)
    mode = check_arg("macro_steps", "mode", mode, _MODE)
    if mode is ScheduleMode.SERIAL:
        return tuple(s for i in range(n) for s in (MacroStep((i,)), MacroStep((), (i,))))
    if n == 0:
        return ()
    if mode is ScheduleMode.FILL_DRAIN and n >= 2:
        first = MacroStep((0, 1))
        middle = tuple(MacroStep((i,), (i - 2,)) for i in range(2, n))
        return (first, *middle, MacroStep((), (n - 2, n - 1)))
    middle = tuple(MacroStep((i,), (i - 1,)) for i in range(1, n))
    return (MacroStep((0,)), *middle, MacroStep((), (n - 1,)))


def format_macro(steps: Sequence[MacroStep]) -> str:
    """``F0 | F1+B0 | B1``: the steps on one line."""
    return " | ".join(str(s) for s in steps)


def parse_macro(text: str) -> tuple[MacroStep, ...]:
    """Read back what :func:`format_macro` wrote."""
    if not isinstance(cast(object, text), str):
        raise refuse("parse_macro: text", "a schedule's string form 'F0 | F1+B0 | B1'", text)
    if not text.strip():
        return ()
    return tuple(MacroStep.parse(part) for part in text.split("|"))
