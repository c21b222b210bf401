"""What autograd keeps for backward while a schedule runs: the peak bytes, and the bytes a
recomputed slot's forward still holds once the slot has run (its graph should be gone).

The pack hook holds a detached alias of each saved tensor, never the tensor itself: holding
a saved output would make a reference cycle through autograd's C++ graph that ``gc`` cannot
break, and fake a leak.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from moe_overlap.steps import Direction, NodeTimer, Step, StepObserver

__all__ = ["RECOMPUTED", "Recomputed", "SavedBytes", "peak_saved_bytes", "saved_bytes"]

Recomputed = tuple[Literal["pre_dispatch", "mlp"], ...]
"""A ``ScheduleOptions.recompute`` value."""
RECOMPUTED: tuple[Recomputed, ...] = (("pre_dispatch",), ("mlp",), ("pre_dispatch", "mlp"))
"""The ``ScheduleOptions.recompute`` choices: each slot alone, and both."""


@dataclass(frozen=True)
class SavedBytes:
    """Bytes of saved tensors' storages (a storage saved twice counts twice)."""

    peak: int
    """The most alive at once."""
    held: int
    """The most saved by forward steps of the recomputed slots still alive when a later
    step starts: 0 when each such step dropped its graph as it ended."""


class _Counter:
    """The saved-tensors hooks and a :class:`~moe_overlap.steps.StepObserver` tagging each
    saved tensor with the step running."""

    def __init__(self, recomputed: Collection[str]) -> None:
        self.recomputed = frozenset(recomputed)
        self.live = self.peak = self.held_live = self.held = 0
        self.tagging = False  # the running step is a forward of a recomputed slot

    def timer(self, step: Step, microbatch: int | None) -> NodeTimer:
        del microbatch
        counter = self
        slot = step.slot
        tags = step.direction is Direction.FORWARD and slot is not None and slot in self.recomputed

        class Tagging:
            def start(self, stream: object) -> None:
                del stream
                counter.held = max(counter.held, counter.held_live)
                counter.tagging = tags

            def stop(self, stream: object) -> None:
                del stream
                counter.tagging = False

        return Tagging()

    def pack(self, t: Tensor) -> object:
        counter = self

        class Held:
            def __init__(self, t: Tensor) -> None:
                self.t, self.n, self.tagged = t, t.untyped_storage().nbytes(), counter.tagging
                counter.live += self.n
                counter.peak = max(counter.peak, counter.live)
                if self.tagged:
                    counter.held_live += self.n

            def __del__(self) -> None:
                counter.live -= self.n
                if self.tagged:
                    counter.held_live -= self.n

        return Held(t.detach())

    @staticmethod
    def unpack(held: object) -> Tensor:
        t: Tensor = getattr(held, "t")  # noqa: B009 - Held is local to pack
        return t


def saved_bytes(
    run: Callable[[StepObserver], object], recomputed: Collection[str] = ()
) -> SavedBytes:
    """Call ``run`` with an observer to hand ``combined_1f1b`` (``observer=``); what autograd
    saved meanwhile. Fails if any saved tensor is still alive after ``run`` (a graph kept)."""
    counter = _Counter(recomputed)
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        run(counter)
    assert counter.live == 0, f"{counter.live} bytes autograd saved are still alive after the step"
    return SavedBytes(peak=counter.peak, held=counter.held)


def peak_saved_bytes(fn: Callable[[], object]) -> int:
    """The peak of :func:`saved_bytes` while ``fn`` runs."""
    return saved_bytes(lambda observer: fn()).peak
