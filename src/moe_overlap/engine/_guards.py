"""Checks attached to the schedule core from outside: the guard Protocol and its registry.

The core (plans, nodes, the runner) calls a few hooks at fixed points and holds no check
itself; each check is a :class:`Guard` attached once (:func:`attach`). A hook with no guard
attached costs one empty-list test. The hooks, in the order a plan meets them::

    plan_started(model, microbatch, where)      a plan is asked for: before anything is built
    inputs_read(model, microbatch, state, where) its inputs are read into the chunk state
    plan_built(model, plan)                      every node of it exists; before it runs
    node_entered(node, direction)                a node starts its forward or backward
    node_left(node)                              ... and ends it (also on failure)
    node_forwarded(node, detached, outputs)      a node's forward returned
    before_release(node, inputs, detached, outputs)  a freeing node is about to release inputs

Always-on and debug-only guards are the same mechanism: :func:`attach` takes a guard's
``debug_only`` once and attaches it or not. A guard subclasses :class:`BaseGuard` (whose
hooks do nothing) and overrides the hooks it needs; only those are called.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from torch import Tensor

__all__ = [
    "BEFORE_RELEASE",
    "INPUTS_READ",
    "NODE_ENTERED",
    "NODE_FORWARDED",
    "NODE_LEFT",
    "PLAN_BUILT",
    "PLAN_STARTED",
    "BaseGuard",
    "Guard",
    "attach",
]


@runtime_checkable
class Guard(Protocol):
    """A check attached to the schedule core (see the module for when each hook runs).

    Arguments are typed ``object`` where the core's own types would import the core into
    this module; a guard narrows them. Raise the library's error to refuse.
    """

    @property
    def debug_only(self) -> bool: ...
    def plan_started(self, model: object, microbatch: object, where: str) -> None: ...
    def inputs_read(self, model: object, microbatch: object, state: object, where: str) -> None: ...
    def plan_built(self, model: object, plan: object) -> None: ...
    def node_entered(self, node: object, direction: str) -> None: ...
    def node_left(self, node: object) -> None: ...
    def node_forwarded(
        self, node: object, detached: tuple[Tensor | None, ...], outputs: tuple[Tensor, ...]
    ) -> None: ...
    def before_release(
        self,
        node: object,
        inputs: tuple[Tensor | None, ...],
        detached: tuple[Tensor | None, ...],
        outputs: tuple[Tensor, ...],
    ) -> None: ...


class BaseGuard:
    """A guard whose hooks do nothing: subclass it and override the hooks a check needs."""

    debug_only: bool = False
    """Attach only in debug mode (``MOE_OVERLAP_DEBUG=1``)."""

    def plan_started(self, model: object, microbatch: object, where: str) -> None:
        del model, microbatch, where

    def inputs_read(self, model: object, microbatch: object, state: object, where: str) -> None:
        del model, microbatch, state, where

    def plan_built(self, model: object, plan: object) -> None:
        del model, plan

    def node_entered(self, node: object, direction: str) -> None:
        del node, direction

    def node_left(self, node: object) -> None:
        del node

    def node_forwarded(
        self, node: object, detached: tuple[Tensor | None, ...], outputs: tuple[Tensor, ...]
    ) -> None:
        del node, detached, outputs

    def before_release(
        self,
        node: object,
        inputs: tuple[Tensor | None, ...],
        detached: tuple[Tensor | None, ...],
        outputs: tuple[Tensor, ...],
    ) -> None:
        del node, inputs, detached, outputs


# One list per hook, read by the core on its path (mutated in place, never rebound).
PLAN_STARTED: list[Guard] = []
INPUTS_READ: list[Guard] = []
PLAN_BUILT: list[Guard] = []
NODE_ENTERED: list[Guard] = []
NODE_LEFT: list[Guard] = []
NODE_FORWARDED: list[Guard] = []
BEFORE_RELEASE: list[Guard] = []

_LISTS: dict[str, list[Guard]] = {
    "plan_started": PLAN_STARTED,
    "inputs_read": INPUTS_READ,
    "plan_built": PLAN_BUILT,
    "node_entered": NODE_ENTERED,
    "node_left": NODE_LEFT,
    "node_forwarded": NODE_FORWARDED,
    "before_release": BEFORE_RELEASE,
}


def attach(guard: Guard, *, debug: bool) -> Callable[[], None]:
    """Attach ``guard`` to the hooks it overrides (after the guards attached before it);
    a ``debug_only`` guard only when ``debug``. Returns what detaches it again."""
    if guard.debug_only and not debug:
        return _nothing
    hooks = [
        name for name in _LISTS if getattr(type(guard), name, None) is not getattr(BaseGuard, name)
    ]
    for name in hooks:
        _LISTS[name].append(guard)

    def detach() -> None:
        for name in hooks:
            if guard in _LISTS[name]:
                _LISTS[name].remove(guard)

    return detach


def _nothing() -> None:
    return None
