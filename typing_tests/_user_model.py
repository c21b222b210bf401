"""A minimal user model and layer written against the public Protocols (shared fixtures).

Type-checked only: nothing here is run. ``check_positive.py`` asserts these satisfy the
Protocols; ``check_negative.py`` varies them one member at a time.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import Parameter

from moe_overlap import (
    CudaGraphModule,
    PreprocessOutput,
    TransformerLayerNode,
    WgradLayer,
    WgradScope,
)


@dataclass(frozen=True, kw_only=True)
class UserConfig:
    """One frozen config: the model's (``mtp_num_layers``) and the free-input fields."""

    mtp_num_layers: int | None = None
    moe_token_dispatcher_type: str = "alltoall"
    moe_flex_dispatcher_backend: str | None = None
    fp8: str | None = None
    fp4: str | None = None
    cuda_graph_modules: tuple[CudaGraphModule, ...] = ()


class DelayedLinear(nn.Linear):
    """A linear layer whose weight gradient is computed in ``backward_dw``."""

    def backward_dw(self) -> None:
        pass


class UserLayer(nn.Module):
    """A schedulable MoE layer: four slot methods, MoE metadata, delayed-wgrad modules."""

    def __init__(self, config: UserConfig) -> None:
        super().__init__()
        self.config = config
        self.is_moe = True
        self.num_local_experts: int | None = 2
        self.attn = DelayedLinear(8, 8)
        self.expert = DelayedLinear(8, 8)

    def slot_pre_dispatch(
        self, node: TransformerLayerNode, inputs: tuple[Tensor, ...], /
    ) -> tuple[Tensor, ...]:
        (hidden,) = inputs
        out = hidden + self.attn(hidden)
        node.layer_state.residual = node.detach(out)
        return (out, torch.ones_like(out))

    def slot_dispatch(self, node: TransformerLayerNode, inputs: tuple[Tensor, ...], /) -> Tensor:
        tokens, probs = inputs
        node.layer_state.dispatched_probs = node.detach(probs)
        return tokens

    def slot_mlp(self, node: TransformerLayerNode, inputs: tuple[Tensor, ...], /) -> Tensor:
        probs = node.layer_state.dispatched_probs
        out: Tensor = self.expert(inputs[0])
        return out if probs is None else out * probs

    def slot_combine(self, node: TransformerLayerNode, inputs: tuple[Tensor, ...], /) -> Tensor:
        residual = node.layer_state.residual
        return inputs[0] if residual is None else inputs[0] + residual

    def pre_dispatch_wgrad(self) -> Sequence[WgradScope]:
        return [WgradScope(CudaGraphModule.attn, self.attn)]

    def mlp_wgrad(self) -> Sequence[WgradLayer]:
        return [self.expert]


class UserDecoder(nn.Module):
    """``decoder``: its layers, the pipeline input and an optional final norm."""

    def __init__(self, layers: Sequence[UserLayer]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.input_tensor: Tensor | None = None
        self.final_layernorm: nn.LayerNorm | None = nn.LayerNorm(8)


class UserModel(nn.Module):
    """A model with Megatron's hook names, its signatures spelled out in full."""

    def __init__(self, config: UserConfig) -> None:
        super().__init__()
        self.pre_process = True
        self.post_process = True
        self.config = config
        self.decoder = UserDecoder([UserLayer(config), UserLayer(config)])
        self.embedding = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)

    def _preprocess(
        self,
        input_ids: Tensor | None,
        position_ids: Tensor | None,
        *,
        decoder_input: Tensor | None = None,
        packed_seq_params: object | None = None,
        padding_mask: Tensor | None = None,
    ) -> PreprocessOutput:
        if decoder_input is None:
            assert input_ids is not None
            embedded: Tensor = self.embedding(input_ids)
            decoder_input = embedded
        return PreprocessOutput(decoder_input, padding_mask=padding_mask)

    def _postprocess(
        self,
        hidden_states: Tensor,
        input_ids: Tensor | None,
        position_ids: Tensor | None,
        labels: Tensor | None,
        rotary_pos_emb: Tensor | None,
        rotary_pos_cos: Tensor | None,
        rotary_pos_sin: Tensor | None,
        *,
        mtp_in_postprocess: bool | None = None,
        loss_mask: Tensor | None = None,
        decoder_input: Tensor | None = None,
        attention_mask: Tensor | None = None,
        packed_seq_params: object | None = None,
        sequence_len_offset: Tensor | int | None = None,
        runtime_gather_output: bool | None = None,
        extra_block_kwargs: Mapping[str, object] | None = None,
        output_processor: object | None = None,
        output_processor_context: object | None = None,
    ) -> Tensor:
        logits: Tensor = self.head(hidden_states)
        assert labels is not None
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


class ShortUserModel(nn.Module):
    """The shortest spelling: keywords the model ignores are taken by ``**kwargs: object``."""

    def __init__(self, config: UserConfig) -> None:
        super().__init__()
        self.pre_process = True
        self.post_process = True
        self.config = config
        self.decoder = UserDecoder([UserLayer(config)])
        self.embedding = nn.Embedding(16, 8)

    def _preprocess(
        self, input_ids: Tensor | None, position_ids: Tensor | None, **kwargs: object
    ) -> tuple[Tensor, None, None, None, None, None]:
        assert input_ids is not None
        embedded: Tensor = self.embedding(input_ids)
        return (embedded, None, None, None, None, None)

    def _postprocess(self, hidden_states: Tensor, *args: Tensor | None, **kwargs: object) -> Tensor:
        return hidden_states.sum()


class UserWgrad:
    """A ``WgradLayer`` that is not a module: any ``backward_dw`` plus ``parameters``."""

    def __init__(self, weight: Parameter) -> None:
        self.weight = weight

    def backward_dw(self) -> None:
        pass

    def parameters(self) -> Iterator[Parameter]:
        yield self.weight
