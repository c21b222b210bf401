"""Megatron's GPT model: the hooks the combined-1F1B schedule calls."""

from collections.abc import Callable, Mapping
from typing import Any

from megatron.core.inference.contexts import BaseInferenceContext
from megatron.core.models.common.model_chunk_schedule_plan import (
    TransformerModelChunkSchedulePlan,
)
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import TransformerBlock
from torch import Tensor

# In Megatron the base class is LanguageModule (itself a MegatronModule); nothing the
# schedule reads comes from it, so the stub skips that level.
class GPTModel(MegatronModule):
    """A GPT model chunk (one pipeline stage, one virtual stage)."""

    pre_process: bool
    """True on the first pipeline stage (it owns the embedding)."""
    post_process: bool
    """True on the last pipeline stage (it owns the output layer and the loss)."""
    decoder: TransformerBlock
    vp_stage: int | None
    mtp_process: bool
    def set_input_tensor(self, input_tensor: Tensor | list[Tensor]) -> None: ...
    def _preprocess(
        self,
        input_ids: Tensor | None,
        position_ids: Tensor | None,
        decoder_input: Tensor | None = None,
        inference_context: BaseInferenceContext | None = None,
        packed_seq_params: PackedSeqParams | None = None,
        padding_mask: Tensor | None = None,
    ) -> tuple[Tensor | None, ...]:
        """Embed and build rotary embeddings.

        Returns ``(decoder_input, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin,
        sequence_len_offset, padding_mask)``; a 7th element (fused cos/sin) is appended on
        the flashinfer fused-rope inference path. ``decoder_input`` is ``None`` on a stage
        that is not first and got no ``decoder_input``.
        """
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
        packed_seq_params: PackedSeqParams | None = None,
        sequence_len_offset: Tensor | None = None,
        runtime_gather_output: bool | None = None,
        extra_block_kwargs: Mapping[str, Any] | None = None,
        inference_context: BaseInferenceContext | None = None,
        output_processor: Callable[..., Any] | None = None,
        output_processor_context: object | None = None,
    ) -> Any:
        """Optional MTP, output layer and loss.

        Returns ``hidden_states`` when not ``post_process``, else ``output_processor(...)``
        when one is given (any type: hence ``Any``), else the logits ``[b, s, v]`` when
        ``labels`` is None, else the per-token loss ``[b, s]``. Megatron leaves this method
        unannotated; the types follow how each argument is used.
        """
    def build_schedule_plan(
        self,
        input_ids: Tensor | None,
        position_ids: Tensor | None,
        attention_mask: Tensor | None,
        decoder_input: Tensor | None = None,
        labels: Tensor | None = None,
        inference_context: BaseInferenceContext | None = None,
        packed_seq_params: PackedSeqParams | None = None,
        extra_block_kwargs: Mapping[str, Any] | None = None,
        runtime_gather_output: bool | None = None,
        inference_params: BaseInferenceContext | None = None,
        loss_mask: Tensor | None = None,
        padding_mask: Tensor | None = None,
        *,
        output_processor: Callable[..., Any] | None = None,
        output_processor_context: object | None = None,
    ) -> TransformerModelChunkSchedulePlan:
        """Megatron's own plan for one microbatch (``inference_*`` are ignored)."""
