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

from collections.abc import Callable, Hashable, Sequence

import torch
from torch import Tensor, nn

from moe_overlap import (
    ChunkState,
    CudaGraphModule,
    IntegrationError,
    WgradLayer,
    WgradScope,
)
from moe_overlap.args import NON_NEGATIVE, OPT_DEVICE, Instance, check_arg, refuse
from moe_overlap.blocks import (
    DenseSlots,
    GraphedBlock,
    GroupedExperts,
    MoESlots,
    PlainContext,
    RMSNorm,
    SelfAttention,
    SlotContext,
    SwiGLUMLP,
    TokenDispatcher,
    TopKRouter,
    add_residual,
    blocked_keys,
    check_attention_mask,
    check_padding_mask,
    recompute,
    save_matmuls,
    token_padding,
)
from moe_overlap.blocks import single_input as _single
from moe_overlap.engine import Hook
from moe_overlap.integrations.checkpoint import register_expert_shards
from moe_overlap.models._config import GPTMoEConfig

__all__ = ["DenseLayer", "GPTLayer", "MoELayer"]


def _rotary(ctx: SlotContext, where: str) -> tuple[Tensor, Tensor]:
    cs = ctx.chunk_state
    if cs.rotary_pos_cos is None or cs.rotary_pos_sin is None:
        raise IntegrationError(
            f"{where}: expected rotary_pos_cos/sin in the chunk state (from _preprocess), "
            f"received {type(cs.rotary_pos_cos).__name__}/{type(cs.rotary_pos_sin).__name__}"
        )
    return cs.rotary_pos_cos, cs.rotary_pos_sin


def _masks(ctx: SlotContext, x_BSD: Tensor, where: str) -> tuple[Tensor, ...]:
    """What the attention masks out for this microbatch: ``()`` (causal only), or the
    ``(blocked, dead)`` of :func:`~moe_overlap.blocks.blocked_keys`."""
    cs = ctx.chunk_state
    if cs.attention_mask is None and cs.padding_mask is None:
        return ()
    B, S = x_BSD.shape[:2]
    attention = check_attention_mask(cs.attention_mask, B, S, where)
    padding = check_padding_mask(cs.padding_mask, B, S, where)
    keys = blocked_keys(attention, padding, S, x_BSD.device)
    assert keys is not None
    return keys.blocked, keys.dead


_CONFIG = Instance(GPTMoEConfig, "a GPTMoEConfig")
_DISPATCHER = Instance(TokenDispatcher, "a TokenDispatcher")


def _check_layer(
    where: str, config: GPTMoEConfig, index: int, device: object
) -> torch.device | None:
    """A layer's common arguments; the device as a ``torch.device``."""
    check_arg(where, "config", config, _CONFIG)
    check_arg(where, "index", index, NON_NEGATIVE)
    return check_arg(where, "device", device, OPT_DEVICE)


def _norm(config: GPTMoEConfig, device: torch.device | None) -> RMSNorm:
    c = config
    return RMSNorm(
        c.hidden_size,
        eps=c.norm_eps,
        recompute="norm" in c.recompute,
        dtype=c.dtype,
        device=device,
    )


def _graphed(
    config: GPTMoEConfig,
    scope: CudaGraphModule,
    fn: Callable[..., object],
    modules: Callable[[], Sequence[nn.Module]],
    label: str,
    frozen: Callable[[], Hashable] | None = None,
) -> GraphedBlock | None:
    """A graphed ``fn`` when ``scope`` is graphed; ``modules`` and ``frozen`` are bound
    methods of the layer, read at every walk, so a submodule replaced later is seen."""
    if scope not in config.cuda_graph_modules:
        return None
    return GraphedBlock(fn, modules, scope, label=label, frozen=frozen)


class _AttentionBlock(nn.Module):
    """``x + attention(norm(x))``: the first half of every layer.

    With ``"attention"`` in ``config.recompute``, recomputed in backward selectively: its
    matrix products saved, the rest recomputed (:func:`~moe_overlap.blocks.save_matmuls`).
    With ``attn`` in ``config.cuda_graph_modules``, run as CUDA graphs.
    """

    def __init__(self, config: GPTMoEConfig, device: torch.device | None, label: str) -> None:
        super().__init__()
        c = config
        self.selective = "attention" in c.recompute
        self.input_norm = _norm(c, device)
        self.attention = SelfAttention(
            c.hidden_size,
            c.num_attention_heads,
            impl=c.attention,
            delay_wgrad=c.delay_wgrad_compute,
            recompute_core="attention_core" in c.recompute,
            dtype=c.dtype,
            device=device,
        )
        self.graph = _graphed(
            c, CudaGraphModule.attn, self._block, self._graphed_modules, f"{label} attention"
        )

    def _graphed_modules(self) -> tuple[nn.Module, ...]:
        return (self,)

    def forward(self, x_BSD: Tensor, cos: Tensor, sin: Tensor, *masks: Tensor) -> Tensor:
        """``masks``: none (causal), or ``blocked`` and ``dead`` of
        :func:`~moe_overlap.blocks.blocked_keys`."""
        if self.graph is not None:
            (out,) = self.graph(x_BSD, cos, sin, *masks)
            return out
        if self.selective:
            return recompute(self._block, x_BSD, cos, sin, *masks, policy=save_matmuls)
        return self._block(x_BSD, cos, sin, *masks)

    def _block(self, x_BSD: Tensor, cos: Tensor, sin: Tensor, *masks: Tensor) -> Tensor:
        attn: Tensor = self.attention(self.input_norm(x_BSD), cos, sin, *masks)
        return x_BSD + attn


class DenseLayer(DenseSlots, nn.Module):
    """Attention then a SwiGLU MLP, each with a residual. Not MoE: no dispatch/combine.

    Slots: pre-dispatch = attention block; mlp = ``h + mlp(norm(h))``.
    """

    def __init__(self, config: GPTMoEConfig, index: int, device: torch.device | None) -> None:
        super().__init__()
        device = _check_layer("DenseLayer", config, index, device)
        c = config
        self.config = config
        self.index = index
        self.attn_block = _AttentionBlock(c, device, f"DenseLayer {index}")
        self.pre_mlp_norm = _norm(c, device)
        self.mlp = SwiGLUMLP(
            c.hidden_size,
            c.ffn_hidden_size,
            delay_wgrad=c.delay_wgrad_compute,
            recompute_activation="activation" in c.recompute,
            dtype=c.dtype,
            device=device,
        )
        self.mlp_graph = _graphed(
            c,
            CudaGraphModule.mlp,
            self._mlp_block,
            self._graphed_modules,
            f"DenseLayer {index} mlp",
        )

    def _graphed_modules(self) -> tuple[nn.Module, ...]:
        """What the graphed mlp runs (read at each walk: a replaced module is seen)."""
        return (self.pre_mlp_norm, self.mlp)

    def pre_dispatch(self, ctx: SlotContext, x_BSD: Tensor) -> Tensor:
        where = f"DenseLayer {self.index} pre_dispatch"
        cos, sin = _rotary(ctx, where)
        out: Tensor = self.attn_block(x_BSD, cos, sin, *_masks(ctx, x_BSD, where))
        return out

    def mlp_forward(self, ctx: SlotContext, h_BSD: Tensor) -> Tensor:
        del ctx
        if self.mlp_graph is not None:
            (out,) = self.mlp_graph(h_BSD)
            return out
        return self._mlp_block(h_BSD)

    def _mlp_block(self, h_BSD: Tensor) -> Tensor:
        mlp: Tensor = self.mlp(self.pre_mlp_norm(h_BSD))
        return h_BSD + mlp

    def run_plain(self, x_BSD: Tensor, chunk_state: ChunkState) -> Tensor:
        """The layer without a schedule (same operations as the slots)."""
        ctx = PlainContext(chunk_state)
        return self.mlp_forward(ctx, self.pre_dispatch(ctx, x_BSD))

    # SchedulableLayer
    def slot_pre_dispatch(self, node: SlotContext, inputs: tuple[Tensor, ...], /) -> Tensor:
        return self.pre_dispatch(node, _single(inputs, f"DenseLayer {self.index} pre_dispatch"))

    def slot_mlp(self, node: SlotContext, inputs: tuple[Tensor, ...], /) -> Tensor:
        return self.mlp_forward(node, _single(inputs, f"DenseLayer {self.index} mlp"))

    def pre_dispatch_wgrad(self) -> Sequence[WgradScope]:
        if not self.config.delay_wgrad_compute:
            return []  # nothing delayed: the schedule runs no wgrad step for this layer
        return [WgradScope(CudaGraphModule.attn, self.attn_block.attention)]

    def mlp_wgrad(self) -> Sequence[WgradLayer]:
        return [self.mlp] if self.config.delay_wgrad_compute else []

    def graphed_blocks(self) -> list[GraphedBlock]:
        """The layer's CUDA-graphed parts."""
        return [g for g in (self.attn_block.graph, self.mlp_graph) if g is not None]

    # GraphedWgradLayer
    def graphed_backward_dw_callable(self) -> Hook | None:
        return _wgrad_replay([self.attn_block.graph], self.config)


def _wgrad_replay(blocks: Sequence[GraphedBlock | None], config: GPTMoEConfig) -> Hook | None:
    """The graphed-wgrad hook: replay each graphed pre-dispatch block's wgrad graph."""
    graphed = [b for b in blocks if b is not None]
    if not (graphed and config.delay_wgrad_compute):
        return None

    def replay() -> None:
        for block in graphed:
            block.backward_dw()

    return replay


class MoELayer(MoESlots, nn.Module):
    """Attention then a routed mixture of SwiGLU experts (plus an optional shared expert).

    Slots::

        pre_dispatch: h = x + attn(norm(x)); hn = norm(h); route; shared(hn); permute
        dispatch:     all-to-all (tokens, probs)      -> stashes dispatched_probs
        mlp:          local sort, experts, * probs, unsort
        combine:      all-to-all back, unpermute, + residual h (+ shared)

    With ``config.moe_a2a_chunks`` K > 1 the dispatcher does this per token group: dispatch
    sends group 0, mlp runs each group's experts with the next group's all-to-all and the
    previous group's return under them (a side stream), combine returns the last group and
    concatenates (see :class:`~moe_overlap.blocks.TokenDispatcher`).
    """

    def __init__(
        self,
        config: GPTMoEConfig,
        index: int,
        dispatcher: TokenDispatcher,
        device: torch.device | None,
    ) -> None:
        super().__init__()
        device = _check_layer("MoELayer", config, index, device)
        check_arg("MoELayer", "dispatcher", dispatcher, _DISPATCHER)
        if (dispatcher.num_experts, dispatcher.topk, dispatcher.chunks) != (
            config.num_experts,
            config.moe_router_topk,
            config.moe_a2a_chunks,
        ):
            raise refuse(
                "MoELayer: dispatcher",
                f"a TokenDispatcher of the config's num_experts={config.num_experts}, "
                f"topk={config.moe_router_topk} and chunks={config.moe_a2a_chunks} "
                "(moe_a2a_chunks)",
                dispatcher,
                detail=(
                    f"num_experts={dispatcher.num_experts}, topk={dispatcher.topk}, "
                    f"chunks={dispatcher.chunks}"
                ),
            )
        c = config
        self.config = config
        self.index = index
        self.dispatcher = dispatcher
        self.attn_block = _AttentionBlock(c, device, f"MoELayer {index}")
        self.pre_mlp_norm = _norm(c, device)
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
                recompute_activation="activation" in c.recompute,
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
            recompute_activation="activation" in c.recompute,
            calls_per_backward=c.moe_a2a_chunks,  # the experts run once per chunk
            dtype=c.dtype,
            device=device,
        )
        # Checkpoints: the experts appear in state dicts as DTensors over the EP group.
        register_expert_shards(
            self.experts,
            ("fc1.weight", "fc2.weight"),
            num_experts=c.num_experts,
            group=dispatcher.group,
        )
        self.router_graph = _graphed(
            c,
            CudaGraphModule.moe_router,
            self._route,
            self._graphed_modules,
            f"MoELayer {index} router",
            frozen=self._graph_key,
        )

    def _graphed_modules(self) -> tuple[nn.Module, ...]:
        """What the graphed router runs (read at each walk: a replaced module is seen)."""
        parts = (self.pre_mlp_norm, self.router, self.shared_expert)
        return tuple(m for m in parts if m is not None)

    def _graph_key(self) -> Hashable:
        return self.router.graph_key()

    @property
    def num_local_experts(self) -> int:
        return self.dispatcher.local_experts

    def where(self, slot: str) -> str:
        return f"MoELayer {self.index} {slot}"

    def pre_dispatch(self, ctx: SlotContext, x_BSD: Tensor) -> tuple[Tensor, Tensor]:
        """Attention, router, shared expert, permute; returns ``(tokens_ND, probs_N)``."""
        where = self.where("pre_dispatch")
        cos, sin = _rotary(ctx, where)
        h_BSD: Tensor = self.attn_block(x_BSD, cos, sin, *_masks(ctx, x_BSD, where))
        state = ctx.layer_state
        state.residual = ctx.detach(h_BSD)
        padding = token_padding(ctx.chunk_state)
        pad = () if padding is None else (padding,)
        graph = self.router_graph
        routed = graph(h_BSD, *pad) if graph is not None else self._route(h_BSD, *pad)
        hn_TD, probs_TK, experts_TK, *shared = routed
        if shared:
            state.shared_expert_output = ctx.detach(shared[0])
        return self.dispatcher.slot_permute(ctx, hn_TD, probs_TK, experts_TK)

    def _route(self, h_BSD: Tensor, *padding_T: Tensor) -> tuple[Tensor, ...]:
        """Norm, router, shared expert: ``(hn_TD, probs_TK, experts_TK[, shared_TD])``;
        ``padding_T`` (``[T]``, ``True`` at padding): padded tokens stay out of the aux loss."""
        hn_TD = self.pre_mlp_norm(h_BSD).reshape(-1, h_BSD.shape[-1])
        probs_TK, experts_TK = self.router(hn_TD, *padding_T)
        if self.shared_expert is None:
            return hn_TD, probs_TK, experts_TK
        shared: Tensor = self.shared_expert(hn_TD)
        return hn_TD, probs_TK, experts_TK, shared

    def dispatch(self, ctx: SlotContext, tokens_ND: Tensor, probs_N: Tensor) -> Tensor:
        """The all-to-all; keeps the received probs for mlp in ``dispatched_probs``."""
        return self.dispatcher.slot_dispatch(ctx, tokens_ND, probs_N)

    def mlp_forward(self, ctx: SlotContext, recv_MD: Tensor) -> Tensor:
        """Local sort (a copy: the input may be freed), experts, weighting by probs, unsort."""
        return self.dispatcher.slot_experts(ctx, recv_MD, self.experts, weigh_in_float32=True)

    def combine(self, ctx: SlotContext, out_MD: Tensor) -> Tensor:
        """All-to-all back, unpermute, add the residual and the shared expert's output."""
        moe_TD = self.dispatcher.slot_combine(ctx, out_MD)
        return add_residual(
            ctx, moe_TD, self.where("combine"), shared=self.shared_expert is not None
        )

    def pre_dispatch_wgrad(self) -> Sequence[WgradScope]:
        if not self.config.delay_wgrad_compute:
            return []  # nothing delayed: the schedule runs no wgrad step for this layer
        scopes = [WgradScope(CudaGraphModule.attn, self.attn_block.attention)]
        if self.shared_expert is not None:
            scopes.append(WgradScope(CudaGraphModule.moe_router, self.shared_expert))
        return scopes

    def mlp_wgrad(self) -> Sequence[WgradLayer]:
        return [self.experts] if self.config.delay_wgrad_compute else []

    def graphed_blocks(self) -> list[GraphedBlock]:
        """The layer's CUDA-graphed parts."""
        return [g for g in (self.attn_block.graph, self.router_graph) if g is not None]

    # GraphedWgradLayer
    def graphed_backward_dw_callable(self) -> Hook | None:
        return _wgrad_replay([self.attn_block.graph, self.router_graph], self.config)


GPTLayer = DenseLayer | MoELayer
"""A layer of :class:`~moe_overlap.models.GPTMoEModel`."""
