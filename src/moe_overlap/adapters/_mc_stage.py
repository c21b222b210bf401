"""A Megatron-Core ``GPTModel`` pipeline chunk as the module a ``PipelineStage`` runs."""

from __future__ import annotations

from torch import Tensor, nn

from moe_overlap import IntegrationError, PreprocessOutput
from moe_overlap.adapters._adapted_model import AdaptedDecoder
from moe_overlap.adapters._adapted_stage import AdaptedStage, refuse_own_tensors
from moe_overlap.adapters._hf_model import AdapterConfig
from moe_overlap.adapters._mc_layers import McLayer
from moe_overlap.adapters._mc_model import MegatronMoEAdapter
from moe_overlap.adapters._torch_private import children
from moe_overlap.args import Instance, check_arg
from moe_overlap.blocks import MegatronHooks

__all__ = ["MegatronMoEStage"]

_ADAPTER = Instance(MegatronMoEAdapter, "a MegatronMoEAdapter", error=IntegrationError)


class MegatronMoEStage(AdaptedStage[MegatronMoEAdapter], MegatronHooks, nn.Module):
    """One pipeline chunk of a Megatron-Core ``GPTModel``, adapted, as a stage module.

    ``adapter`` is a :class:`MegatronMoEAdapter` built on a ``GPTModel`` made for one
    pipeline stage (``pre_process`` on the first stage only: the embedding;
    ``post_process`` on the last only: the final norm and output layer; the stage's
    layers). Give the stage to torch's ``PipelineStage``, then
    :func:`~moe_overlap.integrations.pipelining.prepare_schedule` the schedule.

    ``forward(x, position_ids, attention_mask, padding_mask)`` is the plain path (token ids
    on the first stage, hidden states ``[s, b, h]`` on the others; the logits
    ``[b, s, v]`` out of the last, for the schedule's ``loss_fn``), which torch's own
    execution of the schedule runs and the prepared schedule matches bit for bit. The
    model's modules are registered under their own names, so ``parameters()`` and
    ``state_dict()`` see exactly the ``GPTModel``'s keys.
    """

    microbatch_inputs = frozenset({"position_ids", "attention_mask", "padding_mask"})
    """What a stage reads (:class:`~moe_overlap.inputs.DeclaresInputs`); labels go to the
    schedule's loss."""

    def __init__(self, adapter: MegatronMoEAdapter) -> None:
        super().__init__()
        check_arg("MegatronMoEStage", "adapter", adapter, _ADAPTER)
        object.__setattr__(self, "_adapter", adapter)  # not a submodule: it holds no weights
        model = adapter.model
        refuse_own_tensors("MegatronMoEStage", model, "model", "GPTModel holds them")
        # The model's children under their own names. ``decoder`` (its TransformerBlock)
        # is entered in the child dict directly: the name is also the stage's ``decoder``
        # property (the adapted layers the schedule runs), which attribute lookup finds
        # first; parameters, state_dict and .to() walk the child dict.
        mine = children(self)
        for name, child in children(model).items():
            if child is not None:
                mine[name] = child

    @property
    def decoder(self) -> AdaptedDecoder[McLayer]:
        """The adapted layers (what the schedule runs)."""
        return self.adapter.decoder

    @property
    def config(self) -> AdapterConfig:
        return self.adapter.config

    def extra_repr(self) -> str:
        names = [layer.name for layer in self.decoder.layers]
        return f"{names[0]}..{names[-1]}" if len(names) > 1 else names[0]

    def _preprocess(
        self,
        input_ids: Tensor | None,
        position_ids: Tensor | None,
        *,
        decoder_input: Tensor | None = None,
        packed_seq_params: object | None = None,
        padding_mask: Tensor | None = None,
    ) -> PreprocessOutput:
        return self.adapter._preprocess(  # pyright: ignore[reportPrivateUsage]
            input_ids,
            position_ids,
            decoder_input=decoder_input,
            packed_seq_params=packed_seq_params,
            padding_mask=padding_mask,
        )

    def _postprocess(
        self,
        hidden_states: Tensor,
        input_ids: Tensor | None,
        position_ids: Tensor | None,
        labels: Tensor | None,
        *args: object,
        loss_mask: Tensor | None = None,
        **kwargs: object,
    ) -> Tensor:
        return self.adapter._postprocess(  # pyright: ignore[reportPrivateUsage]
            hidden_states, input_ids, position_ids, labels, *args, loss_mask=loss_mask, **kwargs
        )

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
