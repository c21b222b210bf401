"""A random draw in a forward step that runs ahead of an earlier microbatch's: refused.

Plain training runs each microbatch's forward whole, in order, so what a model draws from
torch's random generator in its forward (dropout, router jitter, sampled routing) comes out
microbatch by microbatch. A step order that interleaves two microbatches' forwards
(``combined_1f1b(..., fill_drain=True)``'s first two, ``run_pair`` of two forwards, a
``NodeSchedule`` with several microbatches' forwards in flight) runs some forward steps of
a later microbatch before steps of an earlier one; a draw there would come out of plain's
order, and masks would land on other microbatches: losses and gradients would not be plain
``backward()``'s. The walker calls this guard around exactly those steps
(:func:`~moe_overlap.engine.core._executor.ahead_forward_steps`); one that moves the
default generator of the CPU, or of the current CUDA device, is a
:class:`~moe_overlap.ConfigError` (raised as the step's :class:`~moe_overlap.ScheduleError`,
before the next step runs). A model drawing nothing there pays two reads of the generators'
states per such step; the steps of orders that never interleave forwards (combined 1F1B's
default, ``overlap=False``) are not watched, and their draws are plain's (a recomputed
slot draws again on its forward's random state, put back after). A generator of the
model's own (``torch.Generator`` passed to an op) is not watched.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import cast

import torch
from torch import Tensor

from moe_overlap.errors import ConfigError

from ._guards import BaseGuard
from .core._node import ScheduleNode

__all__ = ["RandomDraws"]


def _states() -> tuple[Tensor, Tensor | None]:
    """The CPU generator's state and, once CUDA is initialized, the current device's."""
    cuda = torch.cuda.get_rng_state() if _cuda_initialized() else None
    return torch.get_rng_state(), cuda


_cuda_initialized = cast("Callable[[], bool]", torch.cuda.is_initialized)  # torch's is untyped


class RandomDraws(BaseGuard):
    """Refuse a forward step that runs ahead and moves torch's random generator."""

    def __init__(self) -> None:
        self.entered = _Entered()

    def ahead_entered(self, node: ScheduleNode) -> None:
        del node
        self.entered.states = _states()  # per thread: steps that run ahead never nest

    def ahead_left(self, node: ScheduleNode) -> None:
        states, self.entered.states = self.entered.states, None
        if states is None:
            return
        (cpu, cuda), (now_cpu, now_cuda) = states, _states()
        moved = [] if torch.equal(cpu, now_cpu) else ["the CPU's"]
        if cuda is not None and now_cuda is not None and not torch.equal(cuda, now_cuda):
            moved.append("the CUDA device's")
        if moved:
            raise ConfigError(
                f"node {node.name!r}: expected no random draw in a forward step that runs "
                "ahead of an earlier microbatch's forward (fill_drain's first two forwards, "
                "run_pair of two forwards, a NodeSchedule with several microbatches' "
                "forwards in flight), received a forward that moved "
                f"{' and '.join(moved)} random generator (dropout, router jitter, sampled "
                "routing): plain training draws each microbatch's forward whole, in order, "
                "so the draws would land on other microbatches and the results would not be "
                "plain backward()'s. Use an order whose forwards do not interleave "
                "(combined_1f1b's default, fill_drain=False), or turn the draws off in "
                "training (eval mode, or a probability of 0)"
            )


class _Entered(threading.local):
    """The generators' states when this thread's step that runs ahead started."""

    def __init__(self) -> None:
        self.states: tuple[Tensor, Tensor | None] | None = None
