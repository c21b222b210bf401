"""The driver's microbatch orders: which macro steps :func:`~moe_overlap.combined_1f1b` runs.

:func:`macro_steps` lists, for ``n`` microbatches and a :class:`ScheduleMode`, the
:data:`~moe_overlap.steps.MacroStep` s the driver walks, forwards first in each::

    serial      F0 | B0 | F1 | B1 | ... | B(N-1)
    overlapped  F0 | F1+B0 | F2+B1 | ... | F(N-1)+B(N-2) | B(N-1)
    fill-drain  F0+F1 | F2+B0 | ... | F(N-1)+B(N-3) | B(N-2)+B(N-1)

The macro step itself, its microbatches and its text form live beside these orders
(``_macro_steps.py``); the core's runner runs any one of them, whichever order lists it.
Pure functions, tested without a tensor.
"""

import enum

from moe_overlap.args import NON_NEGATIVE, OneOf, check_arg

from ._macro_steps import MacroStep
from .core._kinds import Direction
from .core._step import Step

__all__ = ["ScheduleMode", "macro_steps"]


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


_MODE = OneOf(tuple(ScheduleMode))


def macro_steps(n: int, mode: ScheduleMode) -> tuple[MacroStep, ...]:
    """The steps of ``n`` microbatches in ``mode`` (fill-drain needs two: with one
    microbatch it is the overlapped order)."""
    n = check_arg("macro_steps", "n", n, NON_NEGATIVE)
    mode = check_arg("macro_steps", "mode", mode, _MODE)
    F, B = Direction.FORWARD, Direction.BACKWARD
    if mode is ScheduleMode.SERIAL:
        return tuple(s for i in range(n) for s in ((Step(F, i),), (Step(B, i),)))
    if n == 0:
        return ()
    if mode is ScheduleMode.FILL_DRAIN and n >= 2:
        first = (Step(F, 0), Step(F, 1))
        middle = tuple((Step(F, i), Step(B, i - 2)) for i in range(2, n))
        return (first, *middle, (Step(B, n - 2), Step(B, n - 1)))
    middle = tuple((Step(F, i), Step(B, i - 1)) for i in range(1, n))
    return ((Step(F, 0),), *middle, (Step(B, n - 1),))
