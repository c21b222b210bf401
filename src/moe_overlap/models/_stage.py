"""A pipeline stage of the reference model: a range of its layers, sharing its modules."""

from __future__ import annotations

from typing import cast

from torch import Tensor, nn

from moe_overlap import ChunkState, IntegrationError
from moe_overlap.args import Instance, check_arg
from moe_overlap.blocks import MegatronHooks, Rotary, StageRange
from moe_overlap.engine import check_wgrad_done
from moe_overlap.models._gpt import (
    REFERENCE_INPUTS,
    Decoder,
    GPTMoEModel,
    check_reference_inputs,
    masked_cross_entropy,
)
from moe_overlap.models._layers import GPTLayer

__all__ = ["GPTMoEStage"]


_MODEL = Instance(GPTMoEModel, "a GPTMoEModel (the full model)", error=IntegrationError)


class GPTMoEStage(StageRange, MegatronHooks, nn.Module):
    """Layers ``layers`` of ``model`` as one pipeline stage (a ``PreprocessableModel``).

    The stage holds ``model``'s own modules (no copy): the embedding when ``layers`` starts
    at 0 (``pre_process``), the final norm and output layer when it ends at the last layer
    (``post_process``); an empty ``layers`` only between two stages (it passes hidden
    states on). ``forward`` is the plain path a ``torch.distributed.pipelining``
    stage runs: token ids (first stage) or hidden states ``[B, S, D]`` in; hidden states,
    or the logits ``[B, S, V]`` on the last stage, out (the schedule's ``loss_fn`` makes the
    loss; :func:`~moe_overlap.models.masked_cross_entropy` is the model's own). Build the
    same full model on every pipeline rank (seeded, so identical) and take each rank's stages
    from it.

    Its ``state_dict`` and ``named_parameters`` use the full model's names (layer ``i`` is
    ``decoder.layers.{i}`` in whichever stage holds it, a
    :class:`~moe_overlap.blocks.StageLayers`), so each rank's stages checkpoint with
    ``torch.distributed.checkpoint`` into keys any pipeline layout, or the whole model, loads.
    """

    def __init__(self, model: GPTMoEModel, layers: range) -> None:
        super().__init__()
        check_arg("GPTMoEStage", "model", model, _MODEL)
        self.set_range(layers, model.config.num_layers, "GPTMoEStage")
        self.config = model.config
        self.embedding = model.embedding if self.pre_process else None
        self.decoder = Decoder(
            list(model.layer_list[layers.start : layers.stop]), start=layers.start
        )
        self.final_norm = model.final_norm if self.post_process else None
        self.output_layer = model.output_layer if self.post_process else None
        self._rotary = model.rotary

    @property
    def layer_list(self) -> tuple[GPTLayer, ...]:
        """The stage's layers now (``decoder.layers``)."""
        return cast("tuple[GPTLayer, ...]", tuple(self.decoder.layers))

    def embed(self, input_ids: Tensor) -> Tensor:
        if self.embedding is None:
            raise IntegrationError(
                f"GPTMoEStage({self.extra_repr()}): only the first stage embeds token ids; "
                "this stage takes hidden states"
            )
        return cast(Tensor, self.embedding(input_ids))

    def on_microbatch(self, decoder_input: Tensor) -> None:
        del decoder_input
        check_wgrad_done(self, when="when a microbatch starts")

    def rotary(self, decoder_input: Tensor, position_ids: Tensor | None) -> Rotary:
        return self._rotary(decoder_input, position_ids)

    def output(
        self, hidden_states: Tensor, labels: Tensor | None, loss_mask: Tensor | None
    ) -> Tensor:
        """Final norm and output layer (the logits); with ``labels`` the model's loss."""
        if self.final_norm is None or self.output_layer is None:
            raise IntegrationError(
                f"GPTMoEStage({self.extra_repr()}): only the last stage has the output layer"
            )
        logits_BSV: Tensor = self.output_layer(self.final_norm(hidden_states))
        if labels is None:
            return logits_BSV
        return masked_cross_entropy(logits_BSV, labels, loss_mask)

    microbatch_inputs = frozenset(REFERENCE_INPUTS)
    """What the stage reads (:class:`~moe_overlap.inputs.DeclaresInputs`): as the whole model; a
    pipeline passes ``position_ids``, ``attention_mask`` and ``padding_mask`` as stage
    keywords."""

    def validate_inputs(self, state: ChunkState, /) -> None:
        """As :meth:`GPTMoEModel.validate_inputs <moe_overlap.models.GPTMoEModel.validate_inputs>`."""
        check_reference_inputs(self, state)

    def forward(
        self,
        x: Tensor,
        position_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        padding_mask: Tensor | None = None,
    ) -> Tensor:
        """The plain path: token ids or hidden states in, hidden states or logits out."""
        return self.plain_forward(
            x, position_ids, attention_mask=attention_mask, padding_mask=padding_mask
        )
