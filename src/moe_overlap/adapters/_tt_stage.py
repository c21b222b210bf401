"""A stage of torchtitan's pipeline split as the module a ``PipelineStage`` runs."""

from __future__ import annotations

from torch import Tensor, nn

from moe_overlap import ConfigError, IntegrationError
from moe_overlap.adapters._adapted_model import AdaptedDecoder
from moe_overlap.adapters._adapted_stage import AdaptedStage, refuse_own_tensors
from moe_overlap.adapters._torch_private import children
from moe_overlap.adapters._tt_layers import TitanLayer
from moe_overlap.adapters._tt_model import TorchtitanMoEAdapter
from moe_overlap.adapters._tt_names import NOT_GIVEN, TitanHooks, refuse_titan_names
from moe_overlap.args import Instance, check_arg

__all__ = ["TorchtitanMoEStage"]

_ADAPTER = Instance(TorchtitanMoEAdapter, "a TorchtitanMoEAdapter", error=IntegrationError)


class TorchtitanMoEStage(AdaptedStage[TorchtitanMoEAdapter], TitanHooks, nn.Module):
    """One model chunk of torchtitan's pipeline split, adapted, as a pipeline stage module.

    ``adapter`` is a :class:`TorchtitanMoEAdapter` built on a chunk that torchtitan's
    ``pipeline_llm`` (its module-FQN split) made: a decoder holding some of the blocks,
    with ``tok_embeddings`` on the first stage only and ``norm`` and ``lm_head`` on the last
    only. Put the stage in place of the chunk in torchtitan's ``PipelineStage``
    (``stage.submod = TorchtitanMoEStage(TorchtitanMoEAdapter(stage.submod))``, as
    torchtitan itself swaps a parallelized chunk in), then
    :func:`~moe_overlap.integrations.pipelining.prepare_schedule` the schedule.

    ``forward(x, position_ids)`` is the plain path (token ids on the first stage, hidden
    states on the others; logits out of the last, for the schedule's ``loss_fn``), which
    torch's own execution of the schedule runs and the prepared schedule matches bit for
    bit. The chunk's modules are registered under their own names, so ``parameters()``,
    ``state_dict()`` and torchtitan's checkpoints see exactly the chunk's keys.

    The stage builds the attention masks from ``position_ids`` itself (as the adapter
    does): pass ``position_ids=`` to ``schedule.step`` and no ``attention_masks``.
    """

    microbatch_inputs = frozenset({"position_ids"})
    """What a stage reads (:class:`~moe_overlap.inputs.DeclaresInputs`): the positions
    (RoPE, and the masks the model builds from them); labels go to the schedule's loss."""

    def __init__(self, adapter: TorchtitanMoEAdapter) -> None:
        super().__init__()
        check_arg("TorchtitanMoEStage", "adapter", adapter, _ADAPTER)
        object.__setattr__(self, "_adapter", adapter)  # not a submodule: it holds no weights
        self.decoder: AdaptedDecoder[TitanLayer] = adapter.decoder
        self.config = adapter.config
        model = adapter.model
        for name, child in list(children(model).items()):
            if child is None:
                continue
            if hasattr(self, name):
                raise ConfigError(
                    f"TorchtitanMoEStage({type(model).__name__}): the chunk's {name!r} would "
                    f"be named like the stage's own member ({type(getattr(self, name)).__name__})"
                    "; expected chunk names that leave the stage's members free, received a "
                    "clash"
                )
            self.add_module(name, child)
        refuse_own_tensors("TorchtitanMoEStage", model, "chunk", "torchtitan's decoders hold them")

    def extra_repr(self) -> str:
        names = [layer.name for layer in self.decoder.layers]
        if not names:
            return "no blocks"
        return f"{names[0]}..{names[-1]}" if len(names) > 1 else names[0]

    def embed_at(self, input_ids: Tensor, position_ids: Tensor | None) -> Tensor:
        return self.adapter.embed_at(input_ids, position_ids)

    def embed(self, input_ids: Tensor) -> Tensor:
        return self.adapter.embed_at(input_ids, None)

    def forward(
        self,
        x: Tensor,
        position_ids: Tensor | None = None,
        *,
        positions: object = NOT_GIVEN,
        attention_masks: object = NOT_GIVEN,
    ) -> Tensor:
        """The plain path: token ids or hidden states in, hidden states or logits out.
        torchtitan's ``positions`` and ``attention_masks`` (``schedule.step``'s keywords in
        its trainer) are refused, naming ``position_ids``."""
        refuse_titan_names(
            f"{type(self).__name__}.forward", positions=positions, attention_masks=attention_masks
        )
        return self.plain_forward(x, position_ids)
