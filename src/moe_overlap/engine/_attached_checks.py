"""The library's own checks, as guards on the schedule core, attached at import.

Always on: a plan's model and microbatch (wrappers the schedule would skip, the Protocol
members, the input fields), its delayed-wgrad modules and FSDP units, a node's outputs still
in the graph, nothing in use living in a freed input (debug mode walks the references
every time), what ``combined_1f1b`` checks of its step, per run of plans driven by hand
(:mod:`._hand_run_checks`), and no random draw in a forward step that runs ahead of an
earlier microbatch's (:mod:`._random_draws`). The CPU stream-order checker attaches its own guard while it is
active.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from typing import cast

import torch
from torch import Tensor

from moe_overlap.args import BOOL, Instance, Int, Opt, check_arg
from moe_overlap.errors import IntegrationError
from moe_overlap.microbatch import Microbatch
from moe_overlap.protocols import PreprocessableModel, SchedulableLayer, WgradScope

from ._bypass_check import check_bypassed
from ._conformance import (
    as_mtp_layer,
    check_layer,
    check_model,
    check_preprocess_output,
    check_wgrad_layers,
    check_wgrad_scopes,
    delay_option_error,
    not_a_tensor,
)
from ._core_args import CoreArguments
from ._debug import DEBUG
from ._fsdp_check import check_fsdp
from ._guards import BaseGuard, attach
from ._hand_run_checks import HandRunChecks
from ._inputs import check_inputs
from ._node_checks import (
    check_copies_unused,
    check_handoffs,
    check_in_graph,
    check_no_alias,
    check_own_leaves,
    check_release,
    check_undetached_reads,
    second_backward_error,
)
from ._owed_wgrad import check_wgrad_listed
from ._random_draws import RandomDraws
from ._recompute_hold import _HELD as _RECOMPUTE_HELD  # pyright: ignore[reportPrivateUsage]
from ._recompute_hold import held_for_recompute
from ._step_checks import StepChecks
from ._stream_check import _ACTIVE as _CHECKERS  # pyright: ignore[reportPrivateUsage]
from ._stream_check import _ON_ACTIVATE  # pyright: ignore[reportPrivateUsage]
from ._torch_private import storage_cdata, storage_use_count, tensor_use_count
from ._wgrad_hooks import check_wgrad_hooks
from .contracts import Contract, attribute, method
from .core._chunk_plan import ModelChunkSchedulePlan
from .core._executor import NodeSource
from .core._layer_node import TransformerLayerNode
from .core._node import ScheduleNode
from .core._runner import ChunkRun
from .core._state import ChunkState
from .core._steps import ChunkShape
from .core._streams import StreamPair

__all__ = ["inputs_checked"]

_MICROBATCH = Instance(
    Microbatch,
    "a Microbatch",
    hint="Megatron-Core's positional inputs: moe_overlap.megatron.build_schedule_plan",
)


class _PlanChecks(BaseGuard):
    """A plan's model and microbatch, before anything is built; its inputs once read;
    what the model's pre- and post-process return."""

    def plan_started(self, model: object, microbatch: object, where: str) -> None:
        del where
        check_bypassed(model)  # every plan: a hook added since the last one is found too
        check_model(model)  # memoized inside one combined_1f1b call
        check_arg("ModelChunkSchedulePlan", "microbatch", microbatch, _MICROBATCH)

    def inputs_read(
        self, model: PreprocessableModel, microbatch: Microbatch, state: ChunkState, where: str
    ) -> None:
        if id(microbatch) in _CHECKED:  # the step checked every microbatch before the first plan
            return
        check_inputs(model, state, where=where)

    def plan_built(self, model: PreprocessableModel, plan: ModelChunkSchedulePlan) -> None:
        layers = model.decoder.layers
        delayed = any(lp.shape.delay_wgrad for lp in plan.layers)
        if delayed:
            parts = [lp.wgrad_parts for lp in plan.layers]
            check_wgrad_listed(model, list(layers), parts)
            check_wgrad_hooks(model, parts)  # hooks autograd would run before backward_dw
        check_fsdp(model, layers, delayed=delayed)

    def model_returned(self, model: PreprocessableModel, method: str, value: object) -> None:
        if method == "_preprocess":
            check_preprocess_output(model, value)
        elif not isinstance(value, Tensor):
            raise not_a_tensor(model, method, value)


_CHECKED: set[int] = set()


@contextmanager
def inputs_checked(microbatches: Sequence[Microbatch]) -> Generator[None]:
    """Inside the block, plans of these microbatches skip the input check (the caller ran
    it for all of them already: each input is checked once per microbatch)."""
    ids = {id(mb) for mb in microbatches} - _CHECKED
    _CHECKED.update(ids)
    try:
        yield
    finally:
        _CHECKED.difference_update(ids)


class _LayerChecks(BaseGuard):
    """A layer's Protocol members (the MTP slot callable where present) and the modules it
    lists for delayed pre-dispatch and mlp weight gradients, which
    ``ScheduleOptions.delay_wgrad_compute``, when given, agrees with."""

    def layer_started(self, layer: object, where: Callable[[], str]) -> None:
        as_mtp_layer(check_layer(layer, where))

    def pre_dispatch_wgrad_listed(
        self, layer: SchedulableLayer, listed: object, where: Callable[[], str]
    ) -> None:
        del layer
        check_wgrad_scopes(listed, where)

    def mlp_wgrad_listed(
        self,
        layer: SchedulableLayer,
        listed: object,
        pre_dispatch: Sequence[WgradScope],
        option: bool | None,
        where: Callable[[], str],
    ) -> None:
        del layer
        mlp = check_wgrad_layers(listed, where, "mlp_wgrad()")
        if option is not None and option != (bool(pre_dispatch) or bool(mlp)):
            delay_option_error(where(), option, pre_dispatch, mlp)


class _InGraph(BaseGuard):
    """A floating-point output that does not require grad although an input does: the
    graph was cut (see :meth:`ScheduleNode.mark_non_differentiable`)."""

    def node_forwarded(
        self, node: ScheduleNode, detached: tuple[Tensor | None, ...], outputs: tuple[Tensor, ...]
    ) -> None:
        for out in outputs:
            if not out.requires_grad:
                check_in_graph(node.name, detached, outputs, node.non_differentiable)
                break


class _FreeInput(BaseGuard):
    """Nothing still in use lives in the storage a freeing node is about to release.

    Checked for every input before any is released, with no allocation on this per-node
    path. Anything else that holds an input (a view or copy over its storage, autograd's
    saves, a checkpoint) shows in the reference counts of its storage and tensors: the
    schedule's own are the input (one tensor), the node's detached copy (one tensor, plus
    its grad accumulator when it requires grad) and the storage object read here. More
    sends the node to ``check_release``, which names what holds it (debug mode: always).
    """

    def before_release(
        self,
        node: ScheduleNode,
        inputs: tuple[Tensor | None, ...],
        detached: tuple[Tensor | None, ...],
        outputs: tuple[Tensor, ...],
    ) -> None:
        kept = node.detached
        also = node.kept_as_is
        count_inputs = node.count_input_refs
        count_copies = node.count_copy_refs
        suspect = DEBUG
        storage: torch.UntypedStorage | None = None
        i = -1
        for tensor in inputs:
            i += 1  # no zip or enumerate object on this path: they cost more than the checks
            if tensor is None:
                continue
            storage = tensor.untyped_storage()
            ptr = storage.data_ptr()
            if not ptr:  # an empty storage: no memory to lose
                continue
            for out in outputs:
                if out.untyped_storage().data_ptr() == ptr:
                    check_no_alias(node.name, _storages(inputs), outputs, ())
            for t in (*kept, *also) if also else kept:
                if t.untyped_storage().data_ptr() == ptr:
                    named = node.handed_on()
                    tensors = [k for _, k in named]
                    labels = [label for label, _ in named]
                    check_no_alias(node.name, _storages(inputs), (), tensors, labels)
            if _RECOMPUTE_HELD and held_for_recompute(ptr):
                raise IntegrationError(
                    f"node {node.name!r}: the free-input policy releases this node's inputs "
                    "after forward, but a recomputed region (activation checkpointing) "
                    "holds one of them to rerun on in backward, which would read freed "
                    "memory; expected recomputed regions to take tensors no freeing slot "
                    "receives (recompute inside the slot that produces them, or on a copy), "
                    "or ScheduleOptions(free_input=False)"
                )
            if suspect:
                continue
            cdata = storage_cdata(storage)
            if storage_use_count(cdata) > 3 or (count_inputs and tensor_use_count(tensor) > 1):
                suspect = True
            elif count_copies:
                leaf = detached[i]
                if leaf is not None:
                    count = tensor_use_count(leaf)
                    suspect = count > 2 or (count == 2 and not leaf.requires_grad)
        storage = None  # one reference less: check_release counts them
        if suspect:
            roots = [t.grad_fn for t in (*outputs, *node.graph_tails())]
            check_release(
                node.name,
                inputs,
                detached,
                outputs,
                node.handed_on(),
                roots,
                count_inputs=count_inputs,
                count_copies=count_copies,
                walk=DEBUG,
            )


def _storages(inputs: tuple[Tensor | None, ...]) -> list[torch.UntypedStorage]:
    return [t.untyped_storage() for t in inputs if t is not None]


class _Handoffs(BaseGuard):
    """What a layer slot hands on: ``node.detach`` copies and layer-state tensors used as
    the slot's inputs said, no tensor an earlier slot kept without ``node.detach`` read,
    and no copy that received a gradient from the slot's own backward; torch's "backward
    through the graph a second time" (a tensor handed on without ``node.detach``) said in
    the library's words."""

    def slot_returned(
        self,
        node: TransformerLayerNode,
        inputs: tuple[Tensor, ...],
        output: object,
    ) -> None:
        state = node.layer_state
        copies = node.detached
        if state.undetached:  # an earlier slot kept a tensor without node.detach (rare)
            tails = [t for t in (*_items(output), *node.before_detached) if isinstance(t, Tensor)]
            check_undetached_reads(node.name, [t.grad_fn for t in tails], state.undetached)
        if copies or state.fresh:  # identity checks, no allocation
            outs = _items(output)
            check_handoffs(node.name, inputs, outs, copies, state, node.non_differentiable)

    def copies_backwarded(self, node: TransformerLayerNode, copies: tuple[Tensor, ...]) -> None:
        check_copies_unused(node.name, copies)

    def backward_failed(self, node: TransformerLayerNode, exc: RuntimeError) -> None:
        error = second_backward_error(node.name, exc, node.layer_state.undetached)
        if error is not None:
            raise error from exc


def _items(out: object) -> tuple[object, ...]:
    """A slot's result as a tuple (what the node then checks to be tensors)."""
    if isinstance(out, tuple):
        return cast("tuple[object, ...]", out)
    return (out,)


class _OwnLeaves(BaseGuard):
    """Debug mode: a slot's graph reaches only parameters, its inputs and what earlier
    slots of the layer handed on with ``node.detach`` (never its own copies)."""

    debug_only = True

    def node_detached(self, node: TransformerLayerNode, copy: Tensor) -> None:
        node.layer_state.detached_leaves.append(copy)

    def slot_returned(
        self,
        node: TransformerLayerNode,
        inputs: tuple[Tensor, ...],
        output: object,
    ) -> None:
        copies = node.detached
        # Not a tensor: the node refuses the result itself, once the slot has returned.
        tails = [t for t in (*_items(output), *node.before_detached) if isinstance(t, Tensor)]
        roots = [t.grad_fn for t in tails]
        state = node.layer_state
        leaves = [d for d in state.detached_leaves if not any(d is c for c in copies)]
        check_own_leaves(node.name, roots, (*inputs, *leaves), copies)


class _NodeLabels(BaseGuard):
    """The CPU stream-order checker's guard, attached while one is active: each node's
    place, for its messages."""

    def plan_built(self, model: PreprocessableModel, plan: ModelChunkSchedulePlan) -> None:
        del model
        chunk = f"microbatch {plan.microbatch_index}"
        if plan.vp_stage is not None:
            chunk += f" of stage {plan.vp_stage}"
        for process in (plan.pre_process, plan.post_process):
            if process is not None:
                process.where = chunk
        for i, lp in enumerate(plan.layers):
            for node in lp.nodes.values():
                node.where = f"{chunk}, layer {i}"

    def node_entered(self, node: ScheduleNode, direction: str) -> None:
        if _CHECKERS:
            where = f"{node.where} " if node.where else ""
            _CHECKERS[-1].push_label(f"node {where}{node.name!r} {direction}")

    def node_left(self, node: ScheduleNode) -> None:
        del node
        if _CHECKERS:
            _CHECKERS[-1].pop_label()


def _attach_labels() -> Callable[[], None]:
    return attach(_NodeLabels(), debug=DEBUG)


_ON_ACTIVATE.append(_attach_labels)
_GUARDS = (
    CoreArguments(),
    _PlanChecks(),
    _LayerChecks(),
    _InGraph(),
    _FreeInput(),
    _OwnLeaves(),
    _Handoffs(),
    StepChecks(),
    HandRunChecks(),
    RandomDraws(),
)
for _guard in _GUARDS:
    attach(_guard, debug=DEBUG)


# The rule tables of the core's own Protocols (the core imports no check module).
NODE_SOURCE: Contract[NodeSource] = Contract(
    NodeSource,
    "a NodeSource (a plan: microbatch_index and node_for(step))",
    attribute("microbatch_index", Opt(Int(0), expects="None or an int >= 0")),
    method("node_for"),
)

CHUNK_RUN: Contract[ChunkRun] = Contract(
    ChunkRun,
    "a model-chunk plan (ModelChunkSchedulePlan)",
    attribute("microbatch_index", Opt(Int(0), expects="None or an int >= 0")),
    attribute("released", BOOL),
    attribute("shape", Instance(ChunkShape, "a ChunkShape")),
    attribute("streams", Instance(StreamPair, "a StreamPair")),
    attribute("vp_stage", Opt(Int(0), expects="None or an int >= 0")),
    method("node_for"),
    method("record_current_stream"),
    method("wait_current_stream"),
    method("hand_to_caller"),
    method("release_state"),
)
