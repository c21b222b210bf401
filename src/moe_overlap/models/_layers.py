"""The reference model's layers, schedulable through :class:`~moe_overlap.SchedulableLayer`.

Legend: ``B`` batch, ``S`` sequence, ``D`` hidden, ``T = B*S`` tokens, ``N`` token copies
sent (``T*K``), ``M`` copies received.

Each layer writes its math once, as four slot methods taking a :class:`SlotContext`. The
schedule passes its :class:`~moe_overlap.TransformerLayerNode` (``detach`` cuts the graph
between slots); the plain path (:meth:`run_plain`) passes a :class:`PlainContext` whose
``detach`` is the identity, so both paths run the same operations in the same order.

Free-input contract (see :func:`~moe_overlap.should_free_input`): an MoE layer's dispatch
and combine inputs, and its mlp input with more than one local expert, lose their storage
after forward. So pre-dispatch outputs fresh buffers that its backward does not read,
dispatch and combine save nothing, and mlp copies its input (the local sort) before use.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from moe_overlap import (
    ChunkState,
    CudaGraphModule,
    IntegrationError,
    LayerState,
    WgradLayer,
    WgradScope,
)
from moe_overlap.blocks._dispatcher import DispatchMeta, PermuteMeta, TokenDispatcher
from moe_overlap.blocks._router import TopKRouter
from moe_overlap.models._blocks import RMSNorm, SelfAttention, SwiGLUMLP
from moe_overlap.models._config import GPTMoEConfig
from moe_overlap.models._experts import GroupedExperts

__all__ = ["DenseLayer", "GPTLayer", "MoELayer", "PlainContext", "SlotContext"]

_PERMUTE = "permute"
_DISPATCH = "dispatch"


@runtime_checkable
class SlotContext(Protocol):
    """What a slot reads from its node; :class:`~moe_overlap.TransformerLayerNode` is one."""

    @property
    def layer_state(self) -> LayerState: ...
    @property
    def chunk_state(self) -> ChunkState: ...
    def detach(self, t: Tensor) -> Tensor: ...


class PlainContext:
    """The slot context of the plain (unscheduled) path: ``detach`` keeps the graph whole."""

    def __init__(self, chunk_state: ChunkState) -> None:
        self.layer_state = LayerState()
        self.chunk_state = chunk_state

    def detach(self, t: Tensor) -> Tensor:
        return t


def _single(inputs: tuple[Tensor, ...], where: str) -> Tensor:
    if len(inputs) != 1:
        raise IntegrationError(f"{where}: expected 1 input tensor, received {len(inputs)}")
    return inputs[0]


def _rotary(ctx: SlotContext, where: str) -> tuple[Tensor, Tensor]:
    cs = ctx.chunk_state
    if cs.rotary_pos_cos is None or cs.rotary_pos_sin is None:
        raise IntegrationError(
            f"{where}: expected rotary_pos_cos/sin in the chunk state (from _preprocess), "
            f"received {type(cs.rotary_pos_cos).__name__}/{type(cs.rotary_pos_sin).__name__}"
        )
    return cs.rotary_pos_cos, cs.rotary_pos_sin


class _AttentionBlock(nn.Module):
    """``x + attention(norm(x))``: the first half of every layer."""

    def __init__(self, config: GPTMoEConfig, device: torch.device | None) -> None:
        super().__init__()
        c = config
        self.input_norm = RMSNorm(c.hidden_size, eps=c.norm_eps, dtype=c.dtype, device=device)
        self.attention = SelfAttention(
            c.hidden_size,
            c.num_attention_heads,
            impl=c.attention,
            delay_wgrad=c.delay_wgrad_compute,
            dtype=c.dtype,
            device=device,
        )

    def forward(self, x_BSD: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        attn: Tensor = self.attention(self.input_norm(x_BSD), cos, sin)
        return x_BSD + attn


class DenseLayer(nn.Module):
    """Attention then a SwiGLU MLP, each with a residual. Not MoE: no dispatch/combine.

    Slots: pre-dispatch = attention block; mlp = ``h + mlp(norm(h))``.
    """

    is_moe = False
    num_local_experts = None

    def __init__(self, config: GPTMoEConfig, index: int, device: torch.device | None) -> None:
        super().__init__()
        c = config
        self.config = config
        self.index = index
        self.attn_block = _AttentionBlock(c, device)
        self.pre_mlp_norm = RMSNorm(c.hidden_size, eps=c.norm_eps, dtype=c.dtype, device=device)
        self.mlp = SwiGLUMLP(
            c.hidden_size,
            c.ffn_hidden_size,
            delay_wgrad=c.delay_wgrad_compute,
            dtype=c.dtype,
            device=device,
        )

    def pre_dispatch(self, ctx: SlotContext, x_BSD: Tensor) -> Tensor:
        cos, sin = _rotary(ctx, f"DenseLayer {self.index} pre_dispatch")
        out: Tensor = self.attn_block(x_BSD, cos, sin)
        return out

    def mlp_forward(self, ctx: SlotContext, h_BSD: Tensor) -> Tensor:
        del ctx
        mlp: Tensor = self.mlp(self.pre_mlp_norm(h_BSD))
        return h_BSD + mlp

    def run_plain(self, x_BSD: Tensor, chunk_state: ChunkState) -> Tensor:
        """The layer without a schedule (same operations as the slots)."""
        ctx = PlainContext(chunk_state)
        return self.mlp_forward(ctx, self.pre_dispatch(ctx, x_BSD))

    # SchedulableLayer
    def slot_pre_dispatch(self, node: SlotContext, inputs: tuple[Tensor, ...], /) -> Tensor:
        return self.pre_dispatch(node, _single(inputs, f"DenseLayer {self.index} pre_dispatch"))

    def slot_dispatch(self, node: SlotContext, inputs: tuple[Tensor, ...], /) -> tuple[Tensor, ...]:
        del node
        return inputs

    def slot_mlp(self, node: SlotContext, inputs: tuple[Tensor, ...], /) -> Tensor:
        return self.mlp_forward(node, _single(inputs, f"DenseLayer {self.index} mlp"))

    def slot_combine(self, node: SlotContext, inputs: tuple[Tensor, ...], /) -> tuple[Tensor, ...]:
        del node
        return inputs

    def pre_dispatch_wgrad(self) -> Sequence[WgradScope]:
        if not self.config.delay_wgrad_compute:
            return []  # nothing delayed: the schedule runs no wgrad step for this layer
        return [WgradScope(CudaGraphModule.attn, self.attn_block.attention)]

    def mlp_wgrad(self) -> Sequence[WgradLayer]:
        return [self.mlp] if self.config.delay_wgrad_compute else []


class MoELayer(nn.Module):
    """Attention then a routed mixture of SwiGLU experts (plus an optional shared expert).

    Slots::

        pre_dispatch: h = x + attn(norm(x)); hn = norm(h); route; shared(hn); permute
        dispatch:     all-to-all (tokens, probs)      -> stashes dispatched_probs
        mlp:          local sort, experts, * probs, unsort
        combine:      all-to-all back, unpermute, + residual h (+ shared)
    """

    is_moe = True

    def __init__(
        self,
        config: GPTMoEConfig,
        index: int,
        dispatcher: TokenDispatcher,
        device: torch.device | None,
    ) -> None:
        super().__init__()
        c = config
        self.config = config
        self.index = index
        self.dispatcher = dispatcher
        self.attn_block = _AttentionBlock(c, device)
        self.pre_mlp_norm = RMSNorm(c.hidden_size, eps=c.norm_eps, dtype=c.dtype, device=device)
        self.router = TopKRouter(
            c.hidden_size,
            c.num_experts,
            c.moe_router_topk,
            aux_loss_coeff=c.moe_aux_loss_coeff,
            dtype=c.dtype,
            device=device,
        )
        shared = c.moe_shared_expert_hidden_size
        self.shared_expert: SwiGLUMLP | None = (
            SwiGLUMLP(
                c.hidden_size,
                shared,
                delay_wgrad=c.delay_wgrad_compute,
                dtype=c.dtype,
                device=device,
            )
            if shared is not None
            else None
        )
        self.experts = GroupedExperts(
            dispatcher.local_experts,
            c.hidden_size,
            c.moe_ffn_hidden_size,
            expert_offset=dispatcher.expert_offset,
            delay_wgrad=c.delay_wgrad_compute,
            dtype=c.dtype,
            device=device,
        )

    @property
    def num_local_experts(self) -> int:
        return self.dispatcher.local_experts

    def _where(self, slot: str) -> str:
        return f"MoELayer {self.index} {slot}"

    def pre_dispatch(self, ctx: SlotContext, x_BSD: Tensor) -> tuple[Tensor, Tensor]:
        """Attention, router, shared expert, permute; returns ``(tokens_ND, probs_N)``."""
        cos, sin = _rotary(ctx, self._where("pre_dispatch"))
        h_BSD: Tensor = self.attn_block(x_BSD, cos, sin)
        state = ctx.layer_state
        state.residual = ctx.detach(h_BSD)
        hn_TD = self.pre_mlp_norm(h_BSD).reshape(-1, h_BSD.shape[-1])
        probs_TK, experts_TK = self.router(hn_TD)
        if self.shared_expert is not None:
            shared: Tensor = self.shared_expert(hn_TD)
            state.shared_expert_output = ctx.detach(shared)
        tokens_ND, probs_N, meta = self.dispatcher.permute(hn_TD, probs_TK, experts_TK)
        state.stash(_PERMUTE, meta)
        return tokens_ND, probs_N

    def dispatch(self, ctx: SlotContext, tokens_ND: Tensor, probs_N: Tensor) -> Tensor:
        """The all-to-all; keeps the received probs for mlp in ``dispatched_probs``."""
        state = ctx.layer_state
        meta = state.take(_PERMUTE, PermuteMeta)
        recv_MD, recv_M, dmeta = self.dispatcher.dispatch(tokens_ND, probs_N, meta)
        state.dispatched_probs = ctx.detach(recv_M)
        state.stash(_DISPATCH, dmeta)
        return recv_MD

    def mlp_forward(self, ctx: SlotContext, recv_MD: Tensor) -> Tensor:
        """Local sort (a copy: the input may be freed), experts, weighting by probs, unsort."""
        state = ctx.layer_state
        dmeta = state.take(_DISPATCH, DispatchMeta)
        probs_M = state.dispatched_probs
        if probs_M is None:
            raise IntegrationError(
                f"{self._where('mlp')}: expected dispatched_probs from dispatch, received None"
            )
        x_MD = recv_MD.index_select(0, dmeta.sort_M)
        y_MD: Tensor = self.experts(x_MD, dmeta.local_sizes)
        p_M = probs_M.index_select(0, dmeta.sort_M)
        weighted_MD = (y_MD.float() * p_M.unsqueeze(-1)).to(y_MD.dtype)
        return weighted_MD.index_select(0, dmeta.unsort_M)

    def combine(self, ctx: SlotContext, out_MD: Tensor) -> Tensor:
        """All-to-all back, unpermute, add the residual and the shared expert's output."""
        state = ctx.layer_state
        pmeta = state.take(_PERMUTE, PermuteMeta)
        dmeta = state.take(_DISPATCH, DispatchMeta)
        residual = state.residual
        if residual is None:
            raise IntegrationError(
                f"{self._where('combine')}: expected the residual from pre_dispatch, received None"
            )
        back_ND = self.dispatcher.combine(out_MD, dmeta)
        moe_BSD = self.dispatcher.unpermute(back_ND, pmeta).view(residual.shape)
        out = residual + moe_BSD
        shared = state.shared_expert_output
        if self.shared_expert is not None:
            if shared is None:
                raise IntegrationError(
                    f"{self._where('combine')}: expected the shared expert output from "
                    "pre_dispatch, received None"
                )
            out = out + shared.view(residual.shape)
        return out

    def run_plain(self, x_BSD: Tensor, chunk_state: ChunkState) -> Tensor:
        """The layer without a schedule (same operations as the slots)."""
        ctx = PlainContext(chunk_state)
        tokens_ND, probs_N = self.pre_dispatch(ctx, x_BSD)
        recv_MD = self.dispatch(ctx, tokens_ND, probs_N)
        return self.combine(ctx, self.mlp_forward(ctx, recv_MD))

    # SchedulableLayer
    def slot_pre_dispatch(
        self, node: SlotContext, inputs: tuple[Tensor, ...], /
    ) -> tuple[Tensor, ...]:
        return self.pre_dispatch(node, _single(inputs, self._where("pre_dispatch")))

    def slot_dispatch(self, node: SlotContext, inputs: tuple[Tensor, ...], /) -> Tensor:
        if len(inputs) != 2:
            raise IntegrationError(
                f"{self._where('dispatch')}: expected 2 inputs (tokens, probs), "
                f"received {len(inputs)}"
            )
        return self.dispatch(node, inputs[0], inputs[1])

    def slot_mlp(self, node: SlotContext, inputs: tuple[Tensor, ...], /) -> Tensor:
        return self.mlp_forward(node, _single(inputs, self._where("mlp")))

    def slot_combine(self, node: SlotContext, inputs: tuple[Tensor, ...], /) -> Tensor:
        return self.combine(node, _single(inputs, self._where("combine")))

    def pre_dispatch_wgrad(self) -> Sequence[WgradScope]:
        if not self.config.delay_wgrad_compute:
            return []  # nothing delayed: the schedule runs no wgrad step for this layer
        scopes = [WgradScope(CudaGraphModule.attn, self.attn_block.attention)]
        if self.shared_expert is not None:
            scopes.append(WgradScope(CudaGraphModule.moe_router, self.shared_expert))
        return scopes

    def mlp_wgrad(self) -> Sequence[WgradLayer]:
        return [self.experts] if self.config.delay_wgrad_compute else []


GPTLayer = DenseLayer | MoELayer
"""A layer of :class:`~moe_overlap.models.GPTMoEModel`."""
