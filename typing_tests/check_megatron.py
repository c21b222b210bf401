# pyright: reportMissingModuleSource=false
# (Megatron is not installed: only the stubs in stubs/ exist, which is the point.)
"""Megatron-Core 0.19 against the Protocols, through the stubs in ``stubs/megatron``.

``TransformerConfig`` is a ``FreeInputConfig`` and a model config, ``TransformerBlock`` a
decoder, and Megatron's int-valued ``CudaGraphModule`` works with ``should_free_input``.

``GPTModel`` itself is NOT yet a ``PreprocessableModel``: the marked lines below are
expected errors (a strict xfail). ``WidenedGPTModel`` shows the two parameters at fault
by widening exactly them, after which the Protocol accepts the model:

- ``packed_seq_params``: the Protocol types it ``object | None``; Megatron's
  ``_preprocess`` declares ``PackedSeqParams | None`` (and ``_postprocess`` uses it as
  one). A Protocol method parameter must be at least as narrow as the implementation's.
- ``_postprocess(sequence_len_offset=...)``: the Protocol allows ``Tensor | int | None``;
  Megatron only ever passes (and accepts) a ``Tensor`` or ``None``.

When the Protocol is fixed, mypy and pyright report the ignores below as unused: delete
them (and ``WidenedGPTModel``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from megatron.core.inference.contexts import BaseInferenceContext
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import CudaGraphModule as MegatronCudaGraphModule
from megatron.core.transformer.transformer_block import TransformerBlock
from torch import Tensor

from moe_overlap import FreeInputConfig, PreprocessableModel, should_free_input
from moe_overlap._protocols import DecoderLike, ModelConfigLike


def megatron_config(config: TransformerConfig) -> tuple[FreeInputConfig, ModelConfigLike]:
    """``TransformerConfig`` is both configs the library reads."""
    return config, config


def megatron_graph_modules(config: TransformerConfig) -> bool:
    """Megatron's own (int-valued) enum members are judged by name."""
    config.cuda_graph_modules = [MegatronCudaGraphModule.moe_preprocess]
    return should_free_input("moe_dispatch", True, config, 4)


def megatron_decoder(decoder: TransformerBlock) -> DecoderLike:
    """``TransformerBlock``: layers, pipeline input tensor, optional final norm."""
    return decoder


def megatron_model(model: GPTModel) -> PreprocessableModel:
    """Known issue (see the module docstring): expected to fail until the Protocol is fixed."""
    return model  # type: ignore[return-value]  # pyright: ignore[reportReturnType]


class WidenedGPTModel(GPTModel):
    """``GPTModel`` with only ``packed_seq_params`` and ``sequence_len_offset`` widened."""

    def _preprocess(
        self,
        input_ids: Tensor | None,
        position_ids: Tensor | None,
        decoder_input: Tensor | None = None,
        inference_context: BaseInferenceContext | None = None,
        packed_seq_params: object | None = None,
        padding_mask: Tensor | None = None,
    ) -> tuple[Tensor | None, ...]:
        raise NotImplementedError

    def _postprocess(
        self,
        hidden_states: Tensor,
        input_ids: Tensor | None,
        position_ids: Tensor | None,
        labels: Tensor | None,
        rotary_pos_emb: Tensor | None,
        rotary_pos_cos: Tensor | None,
        rotary_pos_sin: Tensor | None,
        mtp_in_postprocess: bool | None = None,
        loss_mask: Tensor | None = None,
        decoder_input: Tensor | None = None,
        attention_mask: Tensor | None = None,
        padding_mask: Tensor | None = None,
        inference_params: BaseInferenceContext | None = None,
        packed_seq_params: object | None = None,
        sequence_len_offset: Tensor | int | None = None,
        runtime_gather_output: bool | None = None,
        extra_block_kwargs: Mapping[str, Any] | None = None,
        inference_context: BaseInferenceContext | None = None,
        output_processor: Callable[..., Any] | None = None,
        output_processor_context: object | None = None,
    ) -> Any:
        raise NotImplementedError


def widened_model(model: WidenedGPTModel) -> PreprocessableModel:
    """Everything else about ``GPTModel`` (attributes, names, order) matches."""
    return model
