"""Checks attached to the schedule core from outside: the guard registry.

The core calls a few hooks at fixed points, each with the guards attached to it
(:mod:`.core._hooks`; what each hook is told, and when: the :class:`Guard` Protocol,
:mod:`.core._guard`), and holds no check itself; each check is a guard attached once
(:func:`attach`). A hook with no guard attached costs one empty-list test.

Always-on and debug-only guards are the same mechanism: :func:`attach` takes a guard's
``debug_only`` once and attaches it or not. A guard subclasses :class:`BaseGuard` (whose
hooks do nothing) and overrides the hooks it needs; only those are called.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from typing import cast

from torch import Tensor

from moe_overlap.args import BOOL
from moe_overlap.microbatch import Microbatch
from moe_overlap.protocols import PreprocessableModel, SchedulableLayer, WgradScope

from .contracts import Contract, attribute, method
from .core import _hooks
from .core._arguments import ArgumentsGuard
from .core._chunk_plan import ModelChunkSchedulePlan
from .core._guard import Guard
from .core._layer_node import TransformerLayerNode
from .core._node import ScheduleNode
from .core._runner import ChunkRun
from .core._state import ChunkState

__all__ = ["ARGUMENTS_GUARD", "GUARD", "BaseGuard", "Guard", "attach", "by_hook", "without_guards"]


GUARD: Contract[Guard] = Contract(
    Guard,
    "a Guard (moe_overlap.engine._guards.BaseGuard's hooks)",
    attribute("debug_only", BOOL),
    method("plan_started"),
    method("inputs_read"),
    method("plan_built"),
    method("node_entered"),
    method("node_left"),
    method("node_forwarded"),
    method("before_release"),
    method("node_detached"),
    method("slot_returned"),
    method("model_returned"),
    method("copies_backwarded"),
    method("backward_failed"),
    method("layer_started"),
    method("pre_dispatch_wgrad_listed"),
    method("mlp_wgrad_listed"),
    method("step_started"),
    method("backward_ended"),
    method("ahead_entered"),
    method("ahead_left"),
    method("arguments"),
)
"""Its rule table: :func:`attach` refuses what does not conform."""

ARGUMENTS_GUARD: Contract[ArgumentsGuard] = Contract(
    ArgumentsGuard, "a guard of the arguments hook", method("arguments")
)
"""The rule table of the ``arguments`` hook's guards (a :class:`Guard` conforms)."""

by_hook: dict[str, list[Guard]] = {
    "plan_started": _hooks.on_plan_started,
    "inputs_read": _hooks.on_inputs_read,
    "plan_built": _hooks.on_plan_built,
    "node_entered": _hooks.on_node_entered,
    "node_left": _hooks.on_node_left,
    "node_forwarded": _hooks.on_node_forwarded,
    "before_release": _hooks.on_before_release,
    "node_detached": _hooks.on_node_detached,
    "slot_returned": _hooks.on_slot_returned,
    "model_returned": _hooks.on_model_returned,
    "copies_backwarded": _hooks.on_copies_backwarded,
    "backward_failed": _hooks.on_backward_failed,
    "layer_started": _hooks.on_layer_started,
    "pre_dispatch_wgrad_listed": _hooks.on_pre_dispatch_wgrad_listed,
    "mlp_wgrad_listed": _hooks.on_mlp_wgrad_listed,
    "step_started": _hooks.on_step_started,
    "backward_ended": _hooks.on_backward_ended,
    "ahead_entered": _hooks.on_ahead_entered,
    "ahead_left": _hooks.on_ahead_left,
    "arguments": cast("list[Guard]", _hooks.on_arguments),  # holds Guards (a subtype)
}
"""The core's guard list of each hook, by the hook's name (the Guard Protocol's methods)."""


class BaseGuard:
    """A guard whose hooks do nothing: subclass it and override the hooks a check needs."""

    debug_only: bool = False
    """Attach only in debug mode (``MOE_OVERLAP_DEBUG=1``)."""

    def plan_started(self, model: object, microbatch: object, where: str) -> None:
        del model, microbatch, where

    def inputs_read(
        self, model: PreprocessableModel, microbatch: Microbatch, state: ChunkState, where: str
    ) -> None:
        del model, microbatch, state, where

    def plan_built(self, model: PreprocessableModel, plan: ModelChunkSchedulePlan) -> None:
        del model, plan

    def node_entered(self, node: ScheduleNode, direction: str) -> None:
        del node, direction

    def node_left(self, node: ScheduleNode) -> None:
        del node

    def node_forwarded(
        self, node: ScheduleNode, detached: tuple[Tensor | None, ...], outputs: tuple[Tensor, ...]
    ) -> None:
        del node, detached, outputs

    def before_release(
        self,
        node: ScheduleNode,
        inputs: tuple[Tensor | None, ...],
        detached: tuple[Tensor | None, ...],
        outputs: tuple[Tensor, ...],
    ) -> None:
        del node, inputs, detached, outputs

    def node_detached(self, node: TransformerLayerNode, copy: Tensor) -> None:
        del node, copy

    def slot_returned(
        self,
        node: TransformerLayerNode,
        inputs: tuple[Tensor, ...],
        output: object,
    ) -> None:
        del node, inputs, output

    def model_returned(self, model: PreprocessableModel, method: str, value: object) -> None:
        del model, method, value

    def copies_backwarded(self, node: TransformerLayerNode, copies: tuple[Tensor, ...]) -> None:
        del node, copies

    def backward_failed(self, node: TransformerLayerNode, exc: RuntimeError) -> None:
        del node, exc

    def layer_started(self, layer: object, where: Callable[[], str]) -> None:
        del layer, where

    def pre_dispatch_wgrad_listed(
        self, layer: SchedulableLayer, listed: object, where: Callable[[], str]
    ) -> None:
        del layer, listed, where

    def mlp_wgrad_listed(
        self,
        layer: SchedulableLayer,
        listed: object,
        pre_dispatch: Sequence[WgradScope],
        option: bool | None,
        where: Callable[[], str],
    ) -> None:
        del layer, listed, pre_dispatch, option, where

    def step_started(
        self,
        forward: Sequence[ChunkRun],
        backward: Sequence[ChunkRun],
        grads: Sequence[object],
        where: str,
    ) -> None:
        del forward, backward, grads, where

    def backward_ended(self, plans: Sequence[ChunkRun], where: str, failed: bool) -> None:
        del plans, where, failed

    def ahead_entered(self, node: ScheduleNode) -> None:
        del node

    def ahead_left(self, node: ScheduleNode) -> None:
        del node

    def arguments(self, owner: str, value: object) -> None:
        del owner, value


def attach(guard: Guard, *, debug: bool) -> Callable[[], None]:
    """Attach ``guard`` to the hooks it overrides (after the guards attached before it);
    a ``debug_only`` guard only when ``debug``. Returns what detaches it again."""
    guard = GUARD.check(guard)
    if guard.debug_only and not debug:
        return _nothing
    hooks = [
        name for name in by_hook if getattr(type(guard), name, None) is not getattr(BaseGuard, name)
    ]
    for name in hooks:
        by_hook[name].append(guard)

    def detach() -> None:
        for name in hooks:
            if guard in by_hook[name]:
                by_hook[name].remove(guard)

    return detach


def _nothing() -> None:
    return None


@contextmanager
def without_guards() -> Generator[None]:
    """Every attached guard detached inside the block, attached again after it (also on
    failure). For measuring what the checks cost (``benchmarks/bench_host_megatron.py
    --without-guards``) only: inside it nothing the schedule runs is checked, the always-on
    checks included (arguments, a step's plans and gradients, what the model returns):
    inputs are not checked, and the results for a misused input are undefined."""
    saved = {name: list(hooks) for name, hooks in by_hook.items()}
    for hooks in by_hook.values():
        hooks.clear()
    try:
        yield
    finally:
        for name, hooks in by_hook.items():
            hooks[:] = saved[name]
