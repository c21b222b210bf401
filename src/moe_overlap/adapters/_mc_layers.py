"""A Megatron-Core ``TransformerLayer`` cut into the four slots of
:class:`~moe_overlap.SchedulableLayer`.

Every call is Megatron-Core's own; the cut is the one its fine-grained schedule makes
(``build_transformer_layer_callables``), on the layer's and the ``MoELayer``'s methods::

    pre_dispatch: the layer's _forward_attention (input norm, attention, residual add),
                  its _forward_pre_mlp_layernorm; the MoE's shared_experts_compute, route
                  (router) and preprocess (the dispatcher's dispatch_preprocess: permute)
    dispatch:     the MoE's dispatch (the dispatcher's token_dispatch: all-to-all)
    mlp:          the MoE's routed_experts_compute (dispatch_postprocess, the experts,
                  combine_preprocess)
    combine:      the MoE's combine (all-to-all back) and postprocess (unpermute, + the
                  shared experts), the layer's _forward_post_mlp (residual add)

A layer without a ``MoELayer`` runs its own ``forward``, whole, in pre-dispatch.

Megatron-Core's token dispatchers keep each call's routing on themselves (the permutation,
the splits, the token counts) for the next step to read. Two microbatches in flight in
one layer would read each other's: each slot hands the next the dispatcher's attributes
as it left them (a shallow copy, per layer and microbatch) and puts them back before its
own call, so every step reads its own microbatch's routing whatever the order of the
steps. A pre-dispatch the schedule recomputes leaves the MoE's buffers (the router's
expert-bias token counts, its quantile-balancing sums) as it found them: the forward
counted the microbatch once already.

Megatron-Core keeps two tensors with their autograd graph between calls: the router's
``probs`` on the dispatcher (read after only for its dtype) and the pre-MLP norm's input
in the layer's offload manager (a pass-through without offloading, which the adapter
refuses). The slots keep neither: held, they would keep a recomputed pre-dispatch's whole
forward (attention included) alive, and the recompute would save little memory.

The split assumes the layer's output is ``residual + moe(norm(h))`` as Megatron-Core
computes it; the adapter's self-check compares it with the layer's own forward and
backward at construction and refuses a layer it does not reproduce.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn

from moe_overlap import IntegrationError, WgradLayer, WgradScope
from moe_overlap.adapters._hf_experts import WgradGroup
from moe_overlap.adapters._wrapped_layer import WrappedDenseLayer, WrappedLayer
from moe_overlap.blocks import DelayedWgradModule, MoESlots, SlotContext
from moe_overlap.engine import ChunkState
from moe_overlap.protocols import FreeInputConfig

__all__ = ["McDenseLayer", "McLayer", "McMoELayer", "layer_kwargs"]

_KEY = "moe_overlap.megatron.dispatcher."
"""Stash key prefix of the dispatcher's attributes after each step."""


class _DispatcherState:
    """The token dispatcher's attributes as one step left them (a shallow copy)."""

    __slots__ = ("values",)

    def __init__(self, values: dict[str, object]) -> None:
        self.values = values


def layer_kwargs(chunk_state: ChunkState) -> dict[str, object]:
    """What Megatron-Core's ``TransformerBlock`` hands every layer, from the microbatch's
    preprocess output (no cross-attention, inference context or packed sequences)."""
    cs = chunk_state
    return {
        "attention_mask": cs.attention_mask,
        "context": None,
        "context_mask": None,
        "rotary_pos_emb": cs.rotary_pos_emb,
        "rotary_pos_cos": cs.rotary_pos_cos,
        "rotary_pos_sin": cs.rotary_pos_sin,
        "rotary_pos_cos_sin": None,
        "attention_bias": None,
        "inference_context": None,
        "packed_seq_params": None,
        "sequence_len_offset": cs.sequence_len_offset,
        "padding_mask": cs.padding_mask,
    }


def _tensor(value: object, where: str) -> Tensor:
    if not isinstance(value, Tensor):
        raise IntegrationError(f"{where}: expected a tensor, received {type(value).__name__}")
    return value


def _pair(value: object, where: str, what: str) -> tuple[Tensor, Tensor | None]:
    """A Megatron ``(tensor, tensor-or-None)`` result."""
    kind = type(value).__name__
    if isinstance(value, tuple) and len(cast("tuple[object, ...]", value)) == 2:
        first, second = cast("tuple[object, object]", value)
        if isinstance(first, Tensor) and (second is None or isinstance(second, Tensor)):
            return first, second
    raise IntegrationError(
        f"{where}: expected {what} as a pair (tensor, tensor or None), as Megatron-Core "
        f"returns it, received {kind}"
    )


class _McBase(WrappedLayer):
    """What dense and MoE layers share here: the layer's name and how errors name it."""

    def __init__(self, layer: nn.Module, index: int, name: str, config: FreeInputConfig) -> None:
        super().__init__(layer, index, config)
        self.name = name
        self._layer: Any = layer  # Megatron-Core's TransformerLayer (untyped)

    def where(self, slot: str) -> str:
        return f"{self.name} ({type(self.layer).__name__}) {slot}"


class McDenseLayer(WrappedDenseLayer, _McBase):
    """A layer without a ``MoELayer``: its own ``forward``, whole, in pre-dispatch."""

    def __init__(self, layer: nn.Module, index: int, name: str, config: FreeInputConfig) -> None:
        super().__init__(layer, index, name, config)
        self.group = WgradGroup(())

    def forward(self, x: Tensor, chunk_state: ChunkState) -> Tensor:
        out: object = self.layer(hidden_states=x, **layer_kwargs(chunk_state))
        h, _ = _pair(out, self.where("forward"), "the layer's (output, context)")
        return h


class McMoELayer(_McBase, MoESlots):
    """A Megatron-Core ``TransformerLayer`` whose ``mlp`` is a ``MoELayer``, split as the
    module docstring says."""

    def __init__(self, layer: nn.Module, index: int, name: str, config: FreeInputConfig) -> None:
        super().__init__(layer, index, name, config)
        self.moe: Any = layer.get_submodule("mlp")
        self.dispatcher: object = self.moe.token_dispatcher

    @property
    def num_local_experts(self) -> int:
        n: object = getattr(self.moe, "num_local_experts", None)
        return n if isinstance(n, int) else 1

    # --- the dispatcher's per-microbatch attributes ---------------------------------------
    def _save(self, ctx: SlotContext, step: str) -> None:
        """Stash the dispatcher's attributes, each tensor that records autograd detached
        (on the dispatcher too): Megatron-Core keeps the router's ``probs`` there and reads
        only its dtype after; held with its graph it would keep a recomputed slot's forward
        alive until the next call (the self-check and the tests compare the gradients)."""
        values = vars(self.dispatcher)
        for k, v in values.items():  # values replaced in place: the keys stay as they are
            if isinstance(v, Tensor) and v.grad_fn is not None:
                values[k] = v.detach()
        ctx.layer_state.stash(_KEY + step, _DispatcherState(dict(values)))

    def _restore(self, ctx: SlotContext, step: str) -> None:
        vars(self.dispatcher).update(ctx.layer_state.take(_KEY + step, _DispatcherState).values)

    # --- the four slots --------------------------------------------------------------------
    def pre_dispatch(self, ctx: SlotContext, x: Tensor) -> tuple[Tensor, Tensor]:
        where = self.where("pre_dispatch")
        state = ctx.layer_state
        rerun = _KEY + "pre_dispatch" in state.extras  # a recompute: the forward ran already
        # The router's running state (expert-bias token counts, quantile-balancing sums):
        # buffers its forward updates, which a recompute must leave as the forward did.
        buffers = list(self.moe.buffers()) if rerun else []
        kept = [b.detach().clone() for b in buffers]
        kwargs = layer_kwargs(ctx.chunk_state)
        h, _ = _pair(
            self._layer._forward_attention(hidden_states=x, **kwargs),
            where,
            "the layer's _forward_attention (hidden states, context)",
        )
        normed: object = self._layer._forward_pre_mlp_layernorm(h)
        # The layer keeps its offload manager (holding h, with its graph) for
        # _forward_post_mlp; offloading is refused, so the manager is a pass-through there.
        # Left on the layer it would keep a recomputed slot's forward graph alive until the
        # layer's next combine, and the last microbatch's after the step.
        if getattr(self._layer, "mlp_norm_manager", None) is not None:
            self._layer.mlp_norm_manager = None
        residual = h
        if isinstance(normed, tuple):  # a fused residual norm hands the residual back
            pair = cast("object", normed)
            normed, fused = _pair(pair, where, "the pre-MLP norm's (output, residual)")
            residual = _tensor(fused, where)
        u = _tensor(normed, where)
        if bool(self._layer.config.fp32_residual_connection):
            residual = residual.float()
        padding = ctx.chunk_state.padding_mask
        padding_sb = None if padding is None else padding.transpose(0, 1).bool()
        shared: object = self.moe.shared_experts_compute(u)
        probs, routing_map = self.moe.route(u, padding_sb)
        tokens, probs = _pair(self.moe.preprocess(u, probs, routing_map), where, "preprocess")
        with torch.no_grad():
            for b, k in zip(buffers, kept, strict=True):
                b.copy_(k)
        state.residual = ctx.detach(residual)
        state.shared_expert_output = None if shared is None else ctx.detach(_tensor(shared, where))
        self._save(ctx, "pre_dispatch")
        return tokens, _tensor(probs, where)

    def dispatch(self, ctx: SlotContext, tokens: Tensor, probs: Tensor) -> Tensor:
        where = self.where("dispatch")
        self._restore(ctx, "pre_dispatch")
        received, received_probs = _pair(
            self.moe.dispatch(tokens, probs), where, "the dispatched (tokens, probs)"
        )
        ctx.layer_state.dispatched_probs = ctx.detach(_tensor(received_probs, where))
        self._save(ctx, "dispatch")
        return received

    def mlp_forward(self, ctx: SlotContext, received: Tensor) -> Tensor:
        where = self.where("mlp")
        self._restore(ctx, "dispatch")
        probs = ctx.layer_state.dispatched_probs
        if probs is None:
            raise IntegrationError(f"{where}: expected the dispatched probs, received None")
        out, _ = _pair(
            self.moe.routed_experts_compute(received, probs), where, "the experts' output"
        )
        self._save(ctx, "mlp")
        return out

    def combine(self, ctx: SlotContext, out: Tensor) -> Tensor:
        where = self.where("combine")
        state = ctx.layer_state
        self._restore(ctx, "mlp")
        combined = _tensor(self.moe.combine(out), where)
        moe_out = _tensor(self.moe.postprocess(combined, state.shared_expert_output), where)
        state.shared_expert_output = None
        residual = self.take_residual(ctx)
        return _tensor(self._layer._forward_post_mlp((moe_out, None), residual), where)

    # --- delayed weight gradients: none (see the adapter) ----------------------------------
    def pre_dispatch_wgrad(self) -> Sequence[WgradScope]:
        return []

    def mlp_wgrad(self) -> Sequence[WgradLayer]:
        return []

    def delayed_modules(self) -> tuple[DelayedWgradModule, ...]:
        return ()


McLayer = McDenseLayer | McMoELayer
"""A layer of :class:`~moe_overlap.adapters.megatron.MegatronMoEAdapter`."""
