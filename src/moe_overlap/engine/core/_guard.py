"""The core's extension point: the :class:`Guard` Protocol a check implements.

The core (plans, nodes, the runner) calls a few hooks at fixed points, one list of attached
guards per hook (:mod:`._hooks`), and holds no check itself. The hooks, in the order a plan
meets them::

    plan_started(model, microbatch, where)      a plan is asked for: before anything is built
    inputs_read(model, microbatch, state, where) its inputs are read into the chunk state
    layer_started(layer, where)                 a layer plan is asked for (each layer)
    pre_dispatch_wgrad_listed(layer, listed, where)  its pre_dispatch_wgrad() returned
    mlp_wgrad_listed(layer, listed, pre_dispatch, option, where)  its mlp_wgrad() returned
                                                 (with pre_dispatch_wgrad()'s parts and
                                                 ScheduleOptions.delay_wgrad_compute)
    plan_built(model, plan)                      every node of it exists; before it runs
    node_entered(node, direction)                a node starts its forward or backward
    node_left(node)                              ... and ends it (also on failure)
    node_forwarded(node, detached, outputs)      a node's forward returned
    before_release(node, inputs, detached, outputs)  a freeing node is about to release inputs
    node_detached(node, copy)                    a layer slot handed a tensor on (node.detach)
    slot_returned(node, inputs, output)          a layer slot's function returned
    model_returned(model, method, value)         the model's _preprocess or _postprocess
                                                 returned (before the node reads it)
    copies_backwarded(node, copies)              a layer slot's backward ran from its copies
    backward_failed(node, exc)                   a layer slot's backward raised torch's
                                                 RuntimeError (re-raised unless a guard
                                                 raises its own)
    step_started(forward, backward, grads, where)  a macro step of the runner is asked for:
                                                 its arguments as given, before anything
    backward_ended(plans, where, failed)         a step with backward plans: after its last
                                                 step and their release; also when a step
                                                 failed
    ahead_entered(node)                          a forward step that runs ahead of an earlier
                                                 microbatch's forward starts (a step order
                                                 interleaving two microbatches' forwards)
    ahead_left(node)                             ... and returned
    arguments(owner, value)                      a core constructor was given value (owner
                                                 names it): ScheduleOptions, ChunkHooks,
                                                 StreamPair, ScheduleOrder, itself; a
                                                 NodeSchedule, (index, item, its step);
                                                 TransformerLayerNode, its extra_args dict

The guards themselves, their base class and the registry that attaches them live outside
the core (``engine/_guards.py``, ``engine/_attached_checks.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from torch import Tensor

from moe_overlap.microbatch import Microbatch
from moe_overlap.protocols import PreprocessableModel, SchedulableLayer, WgradScope

from ._chunk_plan import ModelChunkSchedulePlan
from ._layer_node import TransformerLayerNode
from ._node import ScheduleNode
from ._runner import ChunkRun
from ._state import ChunkState

__all__ = ["Guard"]


@runtime_checkable
class Guard(Protocol):
    """A check attached to the schedule core (see the module for when each hook runs).

    ``model`` and ``microbatch`` at ``plan_started`` are what the caller passed (not yet
    checked); later hooks see them checked. Raise the library's error to refuse.
    """

    @property
    def debug_only(self) -> bool: ...
    def plan_started(self, model: object, microbatch: object, where: str) -> None: ...
    def inputs_read(
        self, model: PreprocessableModel, microbatch: Microbatch, state: ChunkState, where: str
    ) -> None: ...
    def plan_built(self, model: PreprocessableModel, plan: ModelChunkSchedulePlan) -> None: ...
    def node_entered(self, node: ScheduleNode, direction: str) -> None: ...
    def node_left(self, node: ScheduleNode) -> None: ...
    def node_forwarded(
        self, node: ScheduleNode, detached: tuple[Tensor | None, ...], outputs: tuple[Tensor, ...]
    ) -> None: ...
    def before_release(
        self,
        node: ScheduleNode,
        inputs: tuple[Tensor | None, ...],
        detached: tuple[Tensor | None, ...],
        outputs: tuple[Tensor, ...],
    ) -> None: ...
    def node_detached(self, node: TransformerLayerNode, copy: Tensor) -> None: ...
    def slot_returned(
        self,
        node: TransformerLayerNode,
        inputs: tuple[Tensor, ...],
        output: object,
    ) -> None: ...
    def model_returned(self, model: PreprocessableModel, method: str, value: object) -> None: ...
    def copies_backwarded(self, node: TransformerLayerNode, copies: tuple[Tensor, ...]) -> None: ...
    def backward_failed(self, node: TransformerLayerNode, exc: RuntimeError) -> None: ...
    def layer_started(self, layer: object, where: Callable[[], str]) -> None: ...
    def pre_dispatch_wgrad_listed(
        self, layer: SchedulableLayer, listed: object, where: Callable[[], str]
    ) -> None: ...
    def mlp_wgrad_listed(
        self,
        layer: SchedulableLayer,
        listed: object,
        pre_dispatch: Sequence[WgradScope],
        option: bool | None,
        where: Callable[[], str],
    ) -> None: ...
    def step_started(
        self,
        forward: Sequence[ChunkRun],
        backward: Sequence[ChunkRun],
        grads: Sequence[object],
        where: str,
    ) -> None: ...
    def backward_ended(self, plans: Sequence[ChunkRun], where: str, failed: bool) -> None: ...
    def ahead_entered(self, node: ScheduleNode) -> None: ...
    def ahead_left(self, node: ScheduleNode) -> None: ...
    def arguments(self, owner: str, value: object) -> None: ...
