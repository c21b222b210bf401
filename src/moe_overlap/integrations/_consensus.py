"""After every pipeline step, the ranks agree whether it failed anywhere.

A step that fails on one rank leaves its peers blocked in a receive or an all-to-all (they
fail at their process group's timeout) or, when every rank fails, with receives posted
that the next step's messages would fill. :class:`StepConsensus` is one tiny all-reduce
over a group of its own: each rank reports how far its step got (:class:`Phase`), and every
rank learns every rank's report, so no rank returns normally from a step that failed
elsewhere. Only public ``torch.distributed`` API is used.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import cast

import torch
import torch.distributed as dist

__all__ = ["Phase", "StepConsensus", "Verdict"]

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
