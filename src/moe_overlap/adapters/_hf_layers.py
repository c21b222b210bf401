"""A transformers decoder layer cut into the four slots of :class:`~moe_overlap.SchedulableLayer`.

Legend: ``B`` batch, ``S`` sequence, ``D`` hidden, ``T = B*S`` tokens, ``K`` top-k,
``N = T*K`` token copies sent, ``M`` copies received.

MoE layer slots (a :class:`~._hf_structure.MoESplit` of the layer's own forward; every
module called is the layer's own)::

    pre_dispatch: h = x + attn(in_norm(x)) [norms, multiplier as the split says];
                  u = pre_mlp_norm(h); the MoE block's own forward on u with its experts
                  stood in for (router, shared experts, gates run as the model defines
                  them; the stand-in keeps what the block hands its experts); extra
                  MLPs on u; permute the experts' rows by expert
    dispatch:     all-to-all of rows and routing weights (a copy at EP=1)
    mlp:          local sort (a copy), the model's experts module (or ExpertWeights, for
                  delayed wgrad), unsort
    combine:      all-to-all back, unpermute (sum over K), + the block's other output
                  (+ extras), [post-MLP norm], + residual h

Dense layers run the layer's own ``forward`` whole in pre-dispatch; the other three
slots pass it through.

Free-input contract (:func:`~moe_overlap.should_free_input`): dispatch and combine inputs,
and the mlp input with more than one local expert, lose their storage after forward.
Dispatch and combine save nothing (all-to-all, copies, ``index_select`` and a sum), the
mlp copies its input before the experts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from moe_overlap import CudaGraphModule, IntegrationError, WgradLayer, WgradScope
from moe_overlap.adapters._hf_aux import AuxBatch, RouterAuxLoss
from moe_overlap.adapters._hf_calls import LayerCall, swap_child
from moe_overlap.adapters._hf_experts import (
    ExpertLayout,
    ExpertWeights,
    WgradGroup,
    delay_linears_in,
)
from moe_overlap.adapters._hf_order import row_order
from moe_overlap.adapters._hf_structure import (
    ArgSlot,
    ExpertsKind,
    ExpertsStandIn,
    MoESplit,
    block_norm_identity,
    experts_arguments,
    first_tensor,
)
from moe_overlap.adapters._wrapped_layer import WrappedDenseLayer, WrappedLayer, wgrad_scopes
from moe_overlap.blocks import (
    DelayedWgradModule,
    Gathered,
    GroupSizes,
    MoESlots,
    SlotContext,
    TokenDispatcher,
)
from moe_overlap.engine import ChunkState
from moe_overlap.protocols import FreeInputConfig

__all__ = ["HFDenseLayer", "HFLayer", "HFMoELayer", "LayerCalls"]

LayerCalls = Callable[[ChunkState, int], LayerCall]
"""The model's arguments for layer ``i`` of a microbatch (from the adapter's cache)."""

_REST = "moe_overlap.hf.rest"
_EXTRA = "moe_overlap.hf.extra"
_AUX = "moe_overlap.hf.aux"


def _hand_on(ctx: SlotContext, t: Tensor) -> Tensor:
    """``t`` for a later slot: cut from the graph by the node, or marked as gradient-free."""
    if t.requires_grad:
        return ctx.detach(t)
    ctx.mark_non_differentiable(t)
    return t


class _RoutedStandIn(ExpertsStandIn):
    """Stands in for a block's routed experts; at the point of the call, where the experts'
    own first operation on the hidden rows is, either gathers their copies as the model's
    experts implementation gathers them (:attr:`gathered`, :mod:`._hf_order`) or takes the
    token-major view ``[T, D]`` of the rows (:attr:`rows_TD`). Backward then sums the block
    input's gradient from the router, each routed expert and the shared experts in the
    original's order (autograd runs the ready node created last first): bit-identical to
    the model's own, not only equal up to rounding."""

    def __init__(self, experts: nn.Module, slots: tuple[ArgSlot, ArgSlot, ArgSlot] | None) -> None:
        super().__init__(experts)
        self.slots = slots
        self.rows_TD: Tensor | None = None
        self.gathered: Gathered | None = None

    def forward(self, *args: object, **kwargs: object) -> Tensor:
        out = super().forward(*args, **kwargs)
        if self.slots is not None:
            rows_at, index_at, _ = self.slots
            rows = self.get(rows_at)
            rows_TD = rows if rows.dim() == 2 else rows.view(-1, rows.shape[-1])
            order = row_order(cast(nn.Module, object.__getattribute__(self, "_experts")))
            if order.gather is not None and order.copies is not None:
                index_TK = self.get(index_at)
                order_N = order.copies(index_TK)
                self.gathered = Gathered(order_N, order.gather(rows_TD, index_TK, order_N))
            self.rows_TD = rows_TD
        return out

    def forget(self) -> None:
        super().forget()
        self.rows_TD = None
        self.gathered = None


class _LayerBase(WrappedLayer):
    """What dense and MoE layers share here: the microbatch's arguments, how errors name
    the layer, pending weight gradients by module."""

    def __init__(
        self, layer: nn.Module, index: int, config: FreeInputConfig, calls: LayerCalls
    ) -> None:
        super().__init__(layer, index, config)
        self.calls = calls

    def where(self, slot: str) -> str:
        return f"{type(self.layer).__name__} {self.index} {slot}"

    def pending_wgrad_by_module(self) -> dict[str, int]:
        """``{"path (Class)": count}`` of the delayed modules with weight gradients pending
        (the path is the module's place in the transformers model)."""
        return {
            f"{m.label} ({type(m).__name__})": m.pending_wgrad
            for m in self.delayed_modules()
            if m.pending_wgrad
        }


class HFDenseLayer(WrappedDenseLayer, _LayerBase):
    """A decoder layer without routed experts: its own ``forward``, whole, in pre-dispatch."""

    def __init__(
        self,
        layer: nn.Module,
        index: int,
        config: FreeInputConfig,
        calls: LayerCalls,
        *,
        delay_wgrad: bool,
        delayable: frozenset[str],
    ) -> None:
        super().__init__(layer, index, config, calls)
        self.delay_wgrad = delay_wgrad
        only = _ids(layer, delayable)
        self.group = WgradGroup(delay_linears_in(layer, delay_wgrad=delay_wgrad, only=only))

    def forward(self, x_BSD: Tensor, chunk_state: ChunkState) -> Tensor:
        call = self.calls(chunk_state, self.index)
        return first_tensor(self.layer(x_BSD, *call.args, **dict(call.kwargs)))

    def pre_dispatch_wgrad(self) -> Sequence[WgradScope]:
        # The layer's linears are swapped whether or not they delay.
        return super().pre_dispatch_wgrad() if self.delay_wgrad else []


class HFMoELayer(_LayerBase, MoESlots):
    """A sparse decoder layer split as its :class:`~._hf_structure.MoESplit` says."""

    def __init__(
        self,
        layer: nn.Module,
        index: int,
        config: FreeInputConfig,
        calls: LayerCalls,
        *,
        split: MoESplit,
        dispatcher: TokenDispatcher,
        delay_wgrad: bool,
        hidden_size: int,
        aux: RouterAuxLoss | None,
        router_logits: tuple[type[nn.Module], int] | None,
        delayable: frozenset[str],
    ) -> None:
        super().__init__(layer, index, config, calls)
        self.split = split
        self.dispatcher = dispatcher
        self.delay_wgrad = delay_wgrad
        self.aux = aux
        self.block = layer.get_submodule(split.block)
        self.experts_module = self.block.get_submodule("experts")
        self.stand_in = _RoutedStandIn(
            self.experts_module,
            split.experts.routed_slots() if split.experts.kind is ExpertsKind.ROUTED else None,
        )
        where = f"{type(layer).__name__}.{split.block}.experts"
        self.layout = ExpertLayout.of(self.experts_module, hidden_size, where)
        self.weights = (
            ExpertWeights(self.experts_module, self.layout, delay_wgrad=delay_wgrad)
            if delay_wgrad or split.experts.kind is ExpertsKind.PRESCALED
            else None
        )
        self.router_module: nn.Module | None = None
        self.router_index = 0
        if router_logits is not None:
            cls, self.router_index = router_logits
            self.router_module = next((m for m in self.block.modules() if isinstance(m, cls)), None)
        # The children the slots call, looked up once (not per slot and microbatch).
        attn = layer.get_submodule(split.attn)
        self.attn = attn
        self.in_norm = self._child(split.in_norm)
        self.attn_out_norm = self._child(split.attn_out_norm)
        self.pre_mlp_norm = self._child(split.pre_mlp_norm)
        self.mlp_out_norm = self._child(split.mlp_out_norm)
        self.block_out_norm = (
            cast("Callable[[Tensor], Tensor]", self.block.get_submodule(split.block_out_norm))
            if split.block_out_norm is not None
            else None
        )
        self.extras = tuple((layer.get_submodule(n), spec) for n, spec in split.extras)
        # Where a routed call passes its arguments, looked up once.
        self.routed_slots = (
            split.experts.routed_slots() if split.experts.kind is ExpertsKind.ROUTED else None
        )
        self.score_router = (
            self.block.get_submodule(split.experts.router)
            if split.experts.kind is ExpertsKind.PRESCALED
            else None
        )
        skip = (self.experts_module,)
        only = _ids(layer, delayable)
        self.attention_group = WgradGroup(
            delay_linears_in(attn, delay_wgrad=delay_wgrad, only=only)
        )
        mlp_side = delay_linears_in(self.block, delay_wgrad=delay_wgrad, skip=skip, only=only)
        for part, _ in self.extras:
            mlp_side += delay_linears_in(part, delay_wgrad=delay_wgrad, only=only)
        self.block_group = WgradGroup(mlp_side)

    @property
    def num_local_experts(self) -> int:
        return self.dispatcher.local_experts

    def _child(self, name: str | None) -> Callable[[Tensor], Tensor] | None:
        if name is None:
            return None
        return cast("Callable[[Tensor], Tensor]", self.layer.get_submodule(name))

    def _scaled(self, x: Tensor) -> Tensor:
        m = self.split.multiplier
        return x * m if m is not None else x

    # --- the math, once, for the slots and the plain path --------------------------------
    def pre_dispatch(self, ctx: SlotContext, x_BSD: Tensor) -> tuple[Tensor, Tensor]:
        s = self.split
        call = self.calls(ctx.chunk_state, self.index)
        xa = self.in_norm(x_BSD) if self.in_norm is not None else x_BSD
        a = first_tensor(s.attn_call.call(self.attn, xa, call))
        if self.attn_out_norm is not None:
            a = self.attn_out_norm(a)
        h = x_BSD + self._scaled(a)
        pre = self.pre_mlp_norm
        u = xa if s.parallel else (pre(h) if pre is not None else h)
        rest, hidden_TD, index_TK, weights_TK, logits, gathered = self._block(u, call)
        extra: Tensor | None = None
        for part, spec in self.extras:
            out = first_tensor(spec.call(part, u, call))
            extra = out if extra is None else extra + out
        if self.aux is not None:
            if logits is None:
                raise IntegrationError(
                    f"{self.where('pre_dispatch')}: expected router logits for the aux loss, "
                    "received none"
                )
            weights_TK = self._attach_aux(ctx, self.aux, weights_TK, logits)
        state = ctx.layer_state
        state.residual = ctx.detach(h)
        # The block's output with its experts stood in for (its shared experts) and the
        # extras beside it go to combine; a frozen shared expert's carries no gradient.
        state.stash(_REST, _hand_on(ctx, rest) if s.block_adds else None)
        state.stash(_EXTRA, _hand_on(ctx, extra) if extra is not None else None)
        # The experts' rows grouped, gathered and combined as the model's own experts
        # do (_hf_order).
        if self.routed_slots is None:
            return self.dispatcher.slot_permute(ctx, hidden_TD, weights_TK, index_TK)
        rows = row_order(self.experts_module)
        return self.dispatcher.slot_permute(
            ctx,
            hidden_TD,
            weights_TK,
            index_TK,
            order=rows.copies if gathered is None else None,
            gathered=gathered,
            combine=rows.combine,
        )

    def _attach_aux(
        self, ctx: SlotContext, aux: RouterAuxLoss, weights_TK: Tensor, logits_TE: Tensor
    ) -> Tensor:
        """The routing weights carrying the aux loss's gradient. A pre-dispatch the schedule
        recomputes (its forward stashed the microbatch's batch) attaches to the batch its
        forward added to, adding nothing again: the sums count each layer once."""
        mask = ctx.chunk_state.attention_mask
        state = ctx.layer_state
        if _AUX in state.extras:
            return aux.attach_again(state.take(_AUX, AuxBatch), weights_TK, logits_TE, mask)
        attached = aux.attach(self.index, weights_TK, logits_TE, mask)
        state.stash(_AUX, aux.open)
        return attached

    def _block(
        self, u: Tensor, call: LayerCall
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None, Gathered | None]:
        """The block's own forward with the experts stood in for; what it handed them (and
        their copies, if the stand-in gathered them)."""
        s, ex = self.split, self.split.experts
        seen: dict[str, object] = {}
        hooks: list[RemovableHandle] = []
        if self.router_module is not None:

            def keep_logits(m: nn.Module, args: object, out: object) -> None:
                del m, args
                seen["logits"] = out[self.router_index] if isinstance(out, tuple) else out

            hooks.append(self.router_module.register_forward_hook(keep_logits))
        if self.score_router is not None:
            router = self.score_router

            def keep_scores(m: nn.Module, args: object, out: object) -> None:
                del m, args
                seen["scores"] = out[ex.router_output] if isinstance(out, tuple) else out

            hooks.append(router.register_forward_hook(keep_scores))
        try:
            with (
                swap_child(self.block, "experts", self.stand_in),
                block_norm_identity(self.block, s),
            ):
                rest = first_tensor(s.block_call.call(self.block, u, call))
        finally:
            for h in hooks:
                h.remove()
        logits = seen.get("logits")
        if self.routed_slots is not None:
            hidden_at, index_at, weights_at = self.routed_slots
            get = self.stand_in.get
            index, weights = get(index_at), get(weights_at)
            taken = self.stand_in.rows_TD
            hidden = taken if taken is not None else get(hidden_at)
        else:
            scores = seen.get("scores")
            assert isinstance(scores, Tensor)
            hidden = u.reshape(-1, u.shape[-1])
            weights, index = torch.topk(scores, ex.top_k, dim=-1)
        gathered = self.stand_in.gathered
        self.stand_in.forget()
        hidden_TD = hidden.reshape(-1, hidden.shape[-1])
        logits_out = logits if isinstance(logits, Tensor) else None
        return rest, hidden_TD, index, weights, logits_out, gathered

    def dispatch(self, ctx: SlotContext, tokens_ND: Tensor, probs_N: Tensor) -> Tensor:
        return self.dispatcher.slot_dispatch(ctx, tokens_ND, probs_N)

    def mlp_forward(self, ctx: SlotContext, recv_MD: Tensor) -> Tensor:
        """The routed experts on the received rows, each row weighted as the model weighs it."""
        ex, weights = self.split.experts, self.weights

        def run(x_MD: Tensor, sizes: GroupSizes, p_M: Tensor) -> Tensor:
            if (
                ex.kind is ExpertsKind.PRESCALED
            ):  # as the model: rows scaled by their score, then experts
                assert weights is not None
                return weights((x_MD * p_M.unsqueeze(-1)).to(x_MD.dtype), sizes)
            if weights is not None:  # delayed wgrad: the same products, grouped
                return (weights(x_MD, sizes) * p_M.unsqueeze(-1)).to(x_MD.dtype)
            ids = sizes.group_ids(x_MD.device)
            regroup = row_order(self.experts_module).regroup
            if regroup is None:
                args, kwargs = experts_arguments(ex, x_MD, ids.unsqueeze(-1), p_M.unsqueeze(-1))
                out: Tensor = self.experts_module(*args, **kwargs)
                return out
            # The module moves the rows it is given (perm_M) before its GEMMs: hand them
            # over so moved, each expert's rows reach its GEMM in x_MD's order.
            perm_M = regroup(ids)
            inv_M = torch.argsort(perm_M)
            args, kwargs = experts_arguments(
                ex,
                x_MD.index_select(0, inv_M),
                ids.unsqueeze(-1),
                p_M.index_select(0, inv_M).unsqueeze(-1),
            )
            moved: Tensor = self.experts_module(*args, **kwargs)
            return moved.index_select(0, perm_M)

        return self.dispatcher.slot_routed_experts(ctx, recv_MD, run)

    def combine(self, ctx: SlotContext, out_MD: Tensor) -> Tensor:
        state = ctx.layer_state
        moe_TD = self.dispatcher.slot_combine(ctx, out_MD)
        residual = self.take_residual(ctx)
        rest: object = state.extras.get(_REST)
        extra: object = state.extras.get(_EXTRA)
        m = moe_TD.view(residual.shape)
        if self.split.experts_scale is not None:
            m = m * self.split.experts_scale
        if isinstance(rest, Tensor):
            m = m + rest.view(residual.shape)
        if self.block_out_norm is not None:
            m = self.block_out_norm(m)
        if isinstance(extra, Tensor):  # as the layer: the block's output plus its extras
            m = m + extra.view(residual.shape)
        if self.mlp_out_norm is not None:
            m = self.mlp_out_norm(m)
        return residual + self._scaled(m).view(residual.shape)

    def pre_dispatch_wgrad(self) -> Sequence[WgradScope]:
        if not self.delay_wgrad:
            return []
        return wgrad_scopes(
            (CudaGraphModule.attn, self.attention_group),
            (CudaGraphModule.moe_router, self.block_group),
        )

    def mlp_wgrad(self) -> Sequence[WgradLayer]:
        return [self.weights] if self.delay_wgrad and self.weights is not None else []

    def delayed_modules(self) -> tuple[DelayedWgradModule, ...]:
        experts = self.weights.modules() if self.delay_wgrad and self.weights is not None else ()
        return self.attention_group.modules + self.block_group.modules + experts


def _ids(layer: nn.Module, names: frozenset[str]) -> frozenset[int]:
    """The modules of ``layer`` at ``names`` (the linears a traced forward called once)."""
    return frozenset(id(layer.get_submodule(n)) for n in names)


HFLayer = HFDenseLayer | HFMoELayer
"""A layer of :class:`~moe_overlap.adapters.transformers.TransformersMoEAdapter`."""
