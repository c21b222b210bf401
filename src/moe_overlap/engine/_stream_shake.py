"""Race shaking: seeded random delays queued on the CUDA streams at node boundaries.

A tool for stress runs (``benchmarks/stress_exact.py``), not part of the schedule: while
:func:`shake` is active its :class:`Shaker` is attached to the core's stream-delay hook
(``core/_stream_observer.py``), which the core's stream switches call on CUDA.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator

from moe_overlap.args import NON_NEGATIVE, Real, check_arg, refuse

from ._torch_private import cuda_sleep
from .contracts import Contract, method
from .core._stream_observer import StreamDelay, delays

__all__ = ["STREAM_DELAY", "Shaker", "shake"]

_NON_NEG = Real(min=0)


class Shaker:
    """Seeded random delays queued on CUDA streams at node boundaries (see :func:`shake`)."""

    def __init__(self, seed: int, max_us: float, probability: float) -> None:
        import random

        self._rng = random.Random(seed)
        self.max_us = max_us
        self.probability = probability
        self.delays = 0
        """How many delays were queued (a test can tell it ran)."""
        # cuda_sleep spins for a number of GPU cycles; ~2 per ns on Hopper and Ampere.
        self._cycles_per_us = 2000.0
        self._sleep = cuda_sleep

    def delay(self) -> None:
        """Queue a random spin (0 to ``max_us``) on the current stream, with the set probability."""
        if self._rng.random() >= self.probability:
            return
        self._sleep(int(self._rng.uniform(0.0, self.max_us) * self._cycles_per_us))
        self.delays += 1


def shake(
    seed: int = 0, *, max_us: float = 2000.0, probability: float = 0.5
) -> contextlib.AbstractContextManager[Shaker]:
    """Race-shaking mode: on CUDA, every node (``use_stream``) and every stream switch
    (``stream_context``) first queues, with ``probability``, a spin of up to ``max_us``
    microseconds on its stream (seeded: a failing run can be replayed).

    A missing wait between streams is a window in time; these delays move the streams
    against each other so a run finds windows the steady schedule never opens. Values are
    unchanged: a run that differs under shaking has a race. No effect on CPU streams (use
    the stream-order checker there).
    """
    check_arg("shake", "seed", seed, NON_NEGATIVE)
    check_arg("shake", "max_us", max_us, _NON_NEG)
    check_arg("shake", "probability", probability, _NON_NEG)
    if probability > 1:
        raise refuse("shake: probability", "a probability (0 to 1)", probability)
    return _shaking(Shaker(seed, float(max_us), float(probability)))


STREAM_DELAY: Contract[StreamDelay] = Contract(
    StreamDelay, "a StreamDelay (race shaking's Shaker)", method("delay")
)
"""Its rule table (the Shaker is the one delay the library attaches)."""


@contextlib.contextmanager
def _shaking(shaker: Shaker) -> Generator[Shaker]:
    delays.append(shaker)
    try:
        yield shaker
    finally:
        delays.remove(shaker)
