"""Chunk-level nodes: the model's ``_preprocess`` and ``_postprocess``."""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor

from moe_overlap.protocols import PreprocessableModel, StreamProvider

from ._hooks import on_model_returned
from ._node import _OWN_FORWARD, ScheduleNode  # pyright: ignore[reportPrivateUsage]
from ._state import ChunkState, PreprocessOutput
from ._streams import AnyEvent

__all__ = ["PostProcessNode", "PreProcessNode"]


class PreProcessNode(ScheduleNode):
    """Run the model's ``_preprocess`` (embedding, rotary, padding mask) for a chunk.

    Takes ``decoder.input_tensor`` as the decoder input when the model is not the first
    pipeline stage. Writes the :class:`~moe_overlap.PreprocessOutput` into the chunk state,
    where the layer slots read it by name; returns ``decoder_input``.
    """

    def __init__(
        self,
        model: PreprocessableModel,
        chunk_state: ChunkState,
        event: AnyEvent,
        stream: StreamProvider,
    ) -> None:
        # forward_func is this class's method: the node holds no reference to itself.
        super().__init__(_OWN_FORWARD, stream, event, name="pre_process")
        self.model = model
        self.chunk_state = chunk_state

    def forward_func(self, *args: Tensor | None) -> Tensor:
        """The node's forward work (:meth:`forward_impl`), as :class:`ScheduleNode` calls it."""
        return self.forward_impl(*args)

    def forward_impl(self) -> Tensor:
        """Run ``_preprocess`` and keep its :class:`~moe_overlap.PreprocessOutput` in the
        chunk state (for the layer nodes)."""
        model, cs = self.model, self.chunk_state
        mb = cs.microbatch
        decoder_input = mb.decoder_input if model.pre_process else model.decoder.input_tensor
        raw: object = model._preprocess(  # pyright: ignore[reportPrivateUsage] - the contract
            input_ids=mb.input_ids,
            position_ids=mb.position_ids,
            decoder_input=decoder_input,
            packed_seq_params=mb.packed_seq_params,
            padding_mask=mb.padding_mask,
        )
        for guard in on_model_returned:  # a PreprocessOutput's fields (moe_overlap.engine._guards)
            guard.model_returned(model, "_preprocess", raw)
        out = PreprocessOutput(*cast("tuple[Any, ...]", raw))  # checked by the guards
        cs.set_preprocess_output(out)
        return out.decoder_input


class PostProcessNode(ScheduleNode):
    """Run the model's ``_postprocess`` (output layer, loss) and return the loss in float32.

    Calls ``_postprocess`` with ``mtp_in_postprocess=False``: MTP layers are layer nodes of
    the chunk. The decoder's final norm is applied here only when this rank's decoder is
    empty and the model has no MTP layers (otherwise the last layer applies it).
    ``float32_output=False`` returns ``_postprocess``'s result in its own dtype (a pipeline's
    last stage whose output goes to the schedule's loss function as the plain module's does).
    """

    def __init__(
        self,
        model: PreprocessableModel,
        chunk_state: ChunkState,
        event: AnyEvent,
        stream: StreamProvider,
        *,
        float32_output: bool = True,
    ) -> None:
        # forward_func is this class's method: the node holds no reference to itself.
        super().__init__(_OWN_FORWARD, stream, event, name="post_process")
        self.model = model
        self.chunk_state = chunk_state
        self.float32_output = float32_output

    def forward_func(self, *args: Tensor | None) -> Tensor:
        """The node's forward work (:meth:`forward_impl`), as :class:`ScheduleNode` calls it."""
        return self.forward_impl(*args)  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]  # what forward_impl takes

    def forward_impl(self, hidden_states: Tensor) -> Tensor:
        """Optional final norm, then ``_postprocess``; half-precision results become float32
        (unless ``float32_output`` is off)."""
        model, cs = self.model, self.chunk_state
        norm = model.decoder.final_layernorm
        if not model.config.mtp_num_layers and len(model.decoder.layers) == 0 and norm is not None:
            hidden_states = norm(hidden_states)
        out = model._postprocess(  # pyright: ignore[reportPrivateUsage] - the contract
            hidden_states,
            cs.input_ids,
            cs.position_ids,
            cs.labels,
            cs.rotary_pos_emb,
            cs.rotary_pos_cos,
            cs.rotary_pos_sin,
            mtp_in_postprocess=False,
            loss_mask=cs.loss_mask,
            decoder_input=cs.decoder_input,
            attention_mask=cs.attention_mask,
            packed_seq_params=cs.packed_seq_params,
            sequence_len_offset=cs.sequence_len_offset,
            runtime_gather_output=cs.runtime_gather_output,
            extra_block_kwargs=cs.extra_block_kwargs,
            output_processor=cs.output_processor,
            output_processor_context=cs.output_processor_context,
        )
        for guard in on_model_returned:  # a Tensor
            guard.model_returned(model, "_postprocess", out)
        if self.float32_output and out.dtype in (torch.float16, torch.bfloat16):
            out = out.float()
        return out
