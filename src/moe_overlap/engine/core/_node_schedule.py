"""A whole schedule as one list of node steps over every microbatch, as data.

A :class:`NodeSchedule` is what the planner's search returns (``search_schedules``'s
``order``, ``frontier.json``'s ``best_order``) and what :func:`~moe_overlap.combined_1f1b`
runs with ``schedule=``: every node step of every microbatch once, each written
``[L<layer>.]<slot>.<D><microbatch>[@stream]`` (``L3.mlp.R0@comp``: microbatch 0's
recompute of layer 3's mlp), in the order the host issues them. Any number of microbatches
may be in flight. The rules that keep a whole schedule exact
(:func:`~moe_overlap.steps.check_node_order`, with the order each microbatch keeps,
:func:`~moe_overlap.steps.microbatch_node_steps`) are a check the driver runs before the
runner, outside the core.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

from moe_overlap.args import refuse

from ._arguments import on_arguments
from ._step import Step

__all__ = ["NodeSchedule"]

_GRAMMAR = "[L<layer>.]<slot>.<D><microbatch>[@stream]"


class NodeSchedule:
    """Every node step of every microbatch, in issue order (checked as data by the guards,
    against a model by :func:`~moe_overlap.steps.check_node_order` when run).

    ``NodeSchedule(steps)``: :class:`~moe_overlap.steps.Step` s or their string forms, or
    one space-separated string (``str(schedule)`` reads back). Each step names a
    microbatch, a slot and a direction (``F``, ``B``, ``W``, ``R``), no role.
    """

    __slots__ = ("_hash", "_microbatches", "steps")
    steps: tuple[Step, ...]
    _hash: int
    _microbatches: int

    def __init__(self, steps: str | Iterable[Step | str]) -> None:
        for guard in on_arguments:  # a string or an iterable (moe_overlap.engine._guards)
            guard.arguments("NodeSchedule", steps)
        items = steps.split() if isinstance(steps, str) else list(steps)
        parsed = tuple(_node_step(i, item) for i, item in enumerate(items))
        object.__setattr__(self, "steps", parsed)
        object.__setattr__(self, "_hash", hash(parsed))  # immutable: hashed once
        count = 1 + max((cast(int, s.microbatch) for s in parsed), default=-1)
        object.__setattr__(self, "_microbatches", count)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"NodeSchedule is immutable: cannot set {name!r}")

    def __str__(self) -> str:
        return " ".join(map(str, self.steps))

    def __repr__(self) -> str:
        return f"NodeSchedule({len(self.steps)} steps, {self.microbatches} microbatches)"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NodeSchedule) and other.steps == self.steps

    def __hash__(self) -> int:
        return self._hash

    def __len__(self) -> int:
        return len(self.steps)

    @classmethod
    def parse(cls, text: str) -> NodeSchedule:
        """Read a schedule back from its string form."""
        if not isinstance(cast(object, text), str):
            raise refuse("NodeSchedule.parse: text", "the node steps, space-separated", text)
        return cls(text)

    @property
    def microbatches(self) -> int:
        """How many microbatches it runs (one more than the largest index)."""
        return self._microbatches


def _node_step(index: int, item: object) -> Step:
    """One step of a :class:`NodeSchedule`, parsed (the guards check its fields)."""
    step = Step.parse(item) if isinstance(item, str) else item
    for guard in on_arguments:  # a Step a schedule can hold (moe_overlap.engine._guards)
        guard.arguments("NodeSchedule step", (index, item, step))
    return cast(Step, step)
