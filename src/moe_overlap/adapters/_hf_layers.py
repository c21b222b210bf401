"""A transformers decoder layer cut into the four slots of :class:`~moe_overlap.SchedulableLayer`.

Legend: ``B`` batch, ``S`` sequence, ``D`` hidden, ``T = B*S`` tokens, ``K`` top-k,
``E`` experts, ``N = T*K`` token copies sent, ``M`` copies received.

MoE layer slots (transformers' ``*DecoderLayer.forward`` and ``*SparseMoeBlock.forward``,
split)::

    pre_dispatch: h = x + self_attn(input_layernorm(x)); hn = post_attention_layernorm(h);
                  router; shared expert (gated); permute copies by expert
    dispatch:     all-to-all of copies and routing weights (a copy at EP=1)
    mlp:          local sort (a copy), expert SwiGLU on the fused 3-D weights,
                  * routing weight, unsort
    combine:      all-to-all back, unpermute (sum over K), + shared, + residual h

Dense layers: pre_dispatch is the attention half, mlp is ``h + mlp(post_norm(h))``.

Free-input contract (:func:`~moe_overlap.should_free_input`): dispatch and combine inputs,
and the mlp input with more than one local expert, lose their storage after forward.
Dispatch and combine save nothing (all-to-all, copies, ``index_select`` and a sum), the
mlp copies its input before the expert GEMMs, and the routing weights multiply inside mlp.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Protocol, cast, runtime_checkable

import torch
from torch import Tensor

from moe_overlap import (
    ChunkState,
    CudaGraphModule,
    FreeInputConfig,
    IntegrationError,
    TransformerLayerNode,
    WgradLayer,
    WgradScope,
)
from moe_overlap.adapters._hf_aux import RouterAuxLoss
from moe_overlap.adapters._hf_parts import LayerParts, MoEParts, child
from moe_overlap.adapters._hf_wgrad import (
    DelayedLinear,
    ExpertWeights,
    WgradGroup,
    delay_linears,
    delay_linears_in,
)
from moe_overlap.blocks import (
    DelayedWgradModule,
    DenseSlots,
    TokenDispatcher,
    add_residual,
    pair_input,
    single_input,
)

__all__ = ["HFDenseLayer", "HFLayer", "HFMoELayer", "MaskFunction", "mask_function"]


@runtime_checkable
class MaskFunction(Protocol):
    """transformers' ``create_causal_mask`` / ``create_sliding_window_causal_mask``."""

    def __call__(
        self,
        *,
        config: object,
        inputs_embeds: Tensor,
        attention_mask: Tensor | None,
        past_key_values: None,
        position_ids: Tensor | None,
    ) -> object: ...


def mask_function(kind: str) -> MaskFunction:
    """The transformers mask builder for an attention kind (imported here, lazily)."""
    masking = importlib.import_module("transformers.masking_utils")
    name = (
        "create_sliding_window_causal_mask" if kind == "sliding_attention" else "create_causal_mask"
    )
    return cast(MaskFunction, getattr(masking, name))


def positions(cs: ChunkState, x_BSD: Tensor) -> Tensor:
    """``position_ids``, or ``arange(S)`` as transformers defaults them."""
    if cs.position_ids is not None:
        return cs.position_ids
    return torch.arange(x_BSD.shape[1], device=x_BSD.device).unsqueeze(0)


class _LayerBase:
    """What dense and MoE layers share: the attention half and the wgrad lists."""

    is_moe: bool

    def __init__(
        self,
        parts: LayerParts,
        config: FreeInputConfig,
        *,
        hf_config: object,
        delay_wgrad: bool,
    ) -> None:
        self.parts = parts
        self.config = config
        self.hf_config = hf_config
        self.index = parts.index
        self.delay_wgrad = delay_wgrad
        self.attention_wgrad = WgradGroup(
            delay_linears_in(parts.attention, delay_wgrad=delay_wgrad)
        )
        self.mask_fn = mask_function(parts.attention_kind)

    def where(self, slot: str) -> str:
        return f"{type(self).__name__} {self.index} {slot}"

    def attention_half(self, node: TransformerLayerNode, x_BSD: Tensor) -> Tensor:
        """``x + self_attn(input_layernorm(x))`` with the chunk's rotary cos/sin and mask."""
        cs = node.chunk_state
        cos, sin = cs.rotary_pos_cos, cs.rotary_pos_sin
        if cos is None or sin is None:
            raise IntegrationError(
                f"{self.where('pre_dispatch')}: expected rotary_pos_cos/sin in the chunk state "
                f"(from _preprocess), received {type(cos).__name__}/{type(sin).__name__}"
            )
        pos = positions(cs, x_BSD)
        mask = self.mask_fn(
            config=self.hf_config,
            inputs_embeds=x_BSD,
            attention_mask=cs.attention_mask,
            past_key_values=None,
            position_ids=pos,
        )
        p = self.parts
        h_BSD: Tensor = p.input_norm(x_BSD)
        attn: tuple[Tensor, object] = p.attention(
            hidden_states=h_BSD,
            position_embeddings=(cos, sin),
            attention_mask=mask,
            position_ids=pos,
        )
        return x_BSD + attn[0]

    def pre_dispatch_wgrad(self) -> Sequence[WgradScope]:
        if not self.delay_wgrad:
            return []
        return [WgradScope(CudaGraphModule.attn, self.attention_wgrad)]

    def delayed_modules(self) -> tuple[DelayedWgradModule, ...]:
        """Every delayable module of the layer (what ``pending_wgrad`` counts)."""
        return self.attention_wgrad.modules

    def pending_wgrad(self) -> dict[str, int]:
        """``{label: count}`` of the delayed modules with weight gradients pending."""
        return {m.label: m.pending_wgrad for m in self.delayed_modules() if m.pending_wgrad}

    def discard_wgrad(self) -> None:
        """Drop the pending weight gradients of every delayed module (after a failed step)."""
        for module in self.delayed_modules():
            module.discard_wgrad()


class HFDenseLayer(DenseSlots, _LayerBase):
    """A dense decoder layer (e.g. Qwen2-MoE's ``mlp_only_layers``): no dispatch/combine."""

    def __init__(
        self,
        parts: LayerParts,
        config: FreeInputConfig,
        *,
        hf_config: object,
        delay_wgrad: bool,
    ) -> None:
        super().__init__(parts, config, hf_config=hf_config, delay_wgrad=delay_wgrad)
        self.mlp_group = WgradGroup(delay_linears_in(parts.mlp, delay_wgrad=delay_wgrad))

    def slot_pre_dispatch(
        self, node: TransformerLayerNode, inputs: tuple[Tensor, ...], /
    ) -> Tensor:
        return self.attention_half(node, single_input(inputs, self.where("pre_dispatch")))

    def slot_mlp(self, node: TransformerLayerNode, inputs: tuple[Tensor, ...], /) -> Tensor:
        del node
        h_BSD = single_input(inputs, self.where("mlp"))
        p = self.parts
        mlp: Tensor = p.mlp(p.post_norm(h_BSD))
        return h_BSD + mlp

    def mlp_wgrad(self) -> Sequence[WgradLayer]:
        return [self.mlp_group] if self.delay_wgrad else []

    def delayed_modules(self) -> tuple[DelayedWgradModule, ...]:
        return super().delayed_modules() + self.mlp_group.modules


class HFMoELayer(_LayerBase):
    """A sparse decoder layer: router, routed experts (EP-sharded), optional shared expert."""

    is_moe = True

    def __init__(
        self,
        parts: LayerParts,
        config: FreeInputConfig,
        *,
        hf_config: object,
        delay_wgrad: bool,
        dispatcher: TokenDispatcher,
        aux: RouterAuxLoss | None,
    ) -> None:
        super().__init__(parts, config, hf_config=hf_config, delay_wgrad=delay_wgrad)
        moe = parts.moe
        assert moe is not None
        self.moe: MoEParts = moe
        self.dispatcher = dispatcher
        self.aux = aux
        gate_up = getattr(moe.experts, "gate_up_proj")  # noqa: B009 - checked by find_parts
        down = getattr(moe.experts, "down_proj")  # noqa: B009 - checked by find_parts
        self.experts = ExpertWeights(gate_up, down, moe.act_fn, delay_wgrad=delay_wgrad)
        shared: list[DelayedLinear] = []
        if moe.shared_expert is not None:
            shared += delay_linears(moe.block, "shared_expert", delay_wgrad=delay_wgrad)
            shared += delay_linears(moe.block, "shared_expert_gate", delay_wgrad=delay_wgrad)
        self.shared_group = WgradGroup(shared)

    @property
    def num_local_experts(self) -> int:
        return self.dispatcher.local_experts

    def slot_pre_dispatch(
        self, node: TransformerLayerNode, inputs: tuple[Tensor, ...], /
    ) -> tuple[Tensor, ...]:
        """Attention, norm, router, shared expert, permute; returns ``(tokens_ND, probs_N)``."""
        h_BSD = self.attention_half(node, single_input(inputs, self.where("pre_dispatch")))
        state = node.layer_state
        state.residual = node.detach(h_BSD)
        moe, block = self.moe, self.moe.block
        hn_BSD: Tensor = self.parts.post_norm(h_BSD)
        hn_TD = hn_BSD.view(-1, hn_BSD.shape[-1])
        shared_TD: Tensor | None = None
        if moe.shared_expert is not None:
            shared_TD = child(block, "shared_expert")(hn_TD)
        routed: tuple[Tensor, Tensor, Tensor] = moe.router(hn_TD)
        logits_TE, weights_TK, experts_TK = routed
        if self.aux is not None:
            weights_TK = self.aux.attach(
                self.index, weights_TK, logits_TE, node.chunk_state.attention_mask
            )
        if shared_TD is not None:
            gate_T1: Tensor = child(block, "shared_expert_gate")(hn_TD)
            shared_TD = torch.sigmoid(gate_T1) * shared_TD
            state.shared_expert_output = node.detach(shared_TD)
        return self.dispatcher.slot_permute(node, hn_TD, weights_TK, experts_TK)

    def slot_dispatch(self, node: TransformerLayerNode, inputs: tuple[Tensor, ...], /) -> Tensor:
        """The all-to-all; keeps the received routing weights for mlp."""
        return self.dispatcher.slot_dispatch(node, *pair_input(inputs, self.where("dispatch")))

    def slot_mlp(self, node: TransformerLayerNode, inputs: tuple[Tensor, ...], /) -> Tensor:
        """Local sort (a copy: the input may be freed), experts, * routing weight, unsort."""
        recv_MD = single_input(inputs, self.where("mlp"))
        # As transformers: expert output times its weight, then cast to the hidden dtype.
        return self.dispatcher.slot_experts(node, recv_MD, self.experts, weigh_in_float32=False)

    def slot_combine(self, node: TransformerLayerNode, inputs: tuple[Tensor, ...], /) -> Tensor:
        """All-to-all back, unpermute, + shared expert, + residual."""
        out_MD = single_input(inputs, self.where("combine"))
        moe_TD = self.dispatcher.slot_combine(node, out_MD)
        return add_residual(
            node, moe_TD, self.where("combine"), shared=self.moe.shared_expert is not None
        )

    def pre_dispatch_wgrad(self) -> Sequence[WgradScope]:
        scopes = list(super().pre_dispatch_wgrad())
        if self.delay_wgrad and self.shared_group.modules:
            scopes.append(WgradScope(CudaGraphModule.moe_router, self.shared_group))
        return scopes

    def mlp_wgrad(self) -> Sequence[WgradLayer]:
        return [self.experts] if self.delay_wgrad else []

    def delayed_modules(self) -> tuple[DelayedWgradModule, ...]:
        return super().delayed_modules() + self.shared_group.modules + self.experts.modules()


HFLayer = HFDenseLayer | HFMoELayer
"""A layer of :class:`~moe_overlap.adapters.transformers.TransformersMoEAdapter`."""
