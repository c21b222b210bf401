"""A pipeline stage of an adapted transformers model: a range of its decoder layers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import cast

import torch
from torch import Tensor, nn

from moe_overlap import ConfigError, IntegrationError, ScheduleOptions, WgradError
from moe_overlap.adapters._hf_calls import causal_lm_output, decoder_layers
from moe_overlap.adapters._hf_layers import HFLayer
from moe_overlap.adapters._hf_model import AdapterConfig, AdapterDecoder, TransformersMoEAdapter
from moe_overlap.blocks import MegatronHooks, StageRange

__all__ = ["TransformersMoEStage"]


class TransformersMoEStage(StageRange, MegatronHooks, nn.Module):
    """Decoder layers ``layers`` of an adapted model as one pipeline stage.

    A ``PreprocessableModel`` chunk and the ``nn.Module`` a ``PipelineStage`` takes. Its
    parameters are exactly the ones this stage trains (so torch's per-stage gradient
    scaling touches each once): its decoder layers', plus on the first stage (``layers``
    from 0) those the model's own embedding reaches, and on the last (``layers`` to the
    end) those its own final norm and LM head reach, both found by the gradient of a probe.
    ``forward`` is the plain path: token ids (first stage) or hidden states in, hidden
    states or the logits (last stage; the schedule's ``loss_fn`` makes the loss) out,
    running the adapter's layers as :meth:`~moe_overlap.adapters.transformers.HFLayer.run_plain`
    does, so it and the schedule compute bit-identical results.

    Refused with :class:`~moe_overlap.ConfigError`: a range outside the model, a parameter
    both the embedding and the LM head reach (tied embeddings) split over two stages, and a
    router aux loss (it sums over every layer of a microbatch, across stages).
    """

    def __init__(self, adapter: TransformersMoEAdapter, layers: range) -> None:
        super().__init__()
        all_layers = adapter.decoder.layers
        name = type(adapter.model).__name__
        self.set_range(layers, len(all_layers), f"TransformersMoEStage({name})")
        if adapter.aux is not None:
            raise ConfigError(
                f"TransformersMoEStage({name}): the router aux loss sums over every layer of a "
                "microbatch, across stages; expected an adapter without it, received one "
                "(TransformersMoEAdapter(..., router_aux_loss=False))"
            )
        object.__setattr__(self, "_adapter", adapter)  # not a submodule: it holds no weights
        self.config: AdapterConfig = adapter.config
        self.layer_list: tuple[HFLayer, ...] = tuple(all_layers[layers.start : layers.stop])
        self.decoder = AdapterDecoder(self.layer_list)
        self.hf_layers = nn.ModuleList(layer.layer for layer in self.layer_list)
        first, last = _outside_parameters(adapter)
        tied = sorted(first.keys() & last.keys())
        if tied and not (self.pre_process and self.post_process):
            raise ConfigError(
                f"TransformersMoEStage({name}): {tied} are reached by both the embedding and "
                "the LM head (tied weights); expected them on one stage, received a split "
                "into stages (untie them: tie_word_embeddings=False)"
            )
        owned = {**(first if self.pre_process else {}), **(last if self.post_process else {})}
        self.outside = nn.ModuleDict(
            {key.replace(".", "__"): module for key, module in sorted(owned.items())}
        )

    @property
    def adapter(self) -> TransformersMoEAdapter:
        return cast(TransformersMoEAdapter, object.__getattribute__(self, "_adapter"))

    def schedule_options(
        self, *, free_input: bool = True, ep_overlap_early_attn_memory_release: bool = False
    ) -> ScheduleOptions:
        return self.adapter.schedule_options(
            free_input=free_input,
            ep_overlap_early_attn_memory_release=ep_overlap_early_attn_memory_release,
        )

    def embed_at(self, input_ids: Tensor, position_ids: Tensor | None) -> Tensor:
        if not self.pre_process:
            raise IntegrationError(
                f"TransformersMoEStage({self.extra_repr()}): only the first stage embeds "
                "token ids; this stage takes hidden states"
            )
        return self.adapter.embed_at(input_ids, position_ids)

    def embed(self, input_ids: Tensor) -> Tensor:
        return self.embed_at(input_ids, None)

    def on_microbatch(self, decoder_input: Tensor) -> None:
        del decoder_input
        pending = {k: n for layer in self.layer_list for k, n in layer.pending_wgrad().items()}
        if pending:
            raise WgradError(
                f"TransformersMoEStage({self.extra_repr()}): expected no pending weight "
                f"gradients at the start of a microbatch, received {pending}"
            )

    def output(
        self, hidden_states: Tensor, labels: Tensor | None, loss_mask: Tensor | None
    ) -> Tensor:
        if not self.post_process:
            raise IntegrationError(
                f"TransformersMoEStage({self.extra_repr()}): only the last stage has the LM head"
            )
        return self.adapter.output(hidden_states, labels, loss_mask)

    microbatch_inputs = frozenset({"position_ids", "labels"})
    """What a stage reads (:class:`~moe_overlap.DeclaresInputs`): a stage takes no
    ``attention_mask`` (its ``forward`` has none; use the whole adapter for padded
    batches)."""

    def forward(self, x: Tensor, position_ids: Tensor | None = None) -> Tensor:
        """The plain path: token ids or hidden states in, hidden states or logits out."""
        return self.plain_forward(x, position_ids)

    def pending_wgrad(self) -> int:
        """How many delayed weight gradients of this stage wait for ``backward_dw``."""
        return sum(sum(layer.pending_wgrad().values()) for layer in self.layer_list)

    def discard_wgrad(self) -> None:
        """Drop this stage's pending delayed weight gradients (after a failed step)."""
        for layer in self.layer_list:
            layer.discard_wgrad()


def _outside_parameters(
    adapter: TransformersMoEAdapter,
) -> tuple[dict[str, nn.Module], dict[str, nn.Module]]:
    """The modules (by name) owning the parameters outside the decoder layers that the
    model's own embedding reaches, and those its own final norm and LM head reach."""
    model, base = adapter.model, adapter.base
    inside = {id(p) for layer in decoder_layers(base) for p in layer.parameters()}
    outside = [
        (name, p) for name, p in _named_parameters(model) if id(p) not in inside and p.requires_grad
    ]
    if not outside:
        return {}, {}
    p0 = outside[0][1]
    params = [p for _, p in outside]
    with torch.enable_grad():
        ids = torch.zeros(1, 4, dtype=torch.long, device=p0.device)
        embedded = adapter.embed_at(ids, None)
        reach_first = torch.autograd.grad(
            embedded.float().sum(), params, allow_unused=True, materialize_grads=False
        )
        hidden = torch.zeros(
            1, 4, adapter.hidden_size, dtype=embedded.dtype, device=p0.device, requires_grad=True
        )
        logits = causal_lm_output(
            model,
            base,
            hidden,
            labels=None,
            attention_mask=None,
            position_ids=None,
            accepts_router_flag=adapter._accepts_router_flag,  # pyright: ignore[reportPrivateUsage] - same package
        )
        reach_last = torch.autograd.grad(
            logits.float().sum(), params, allow_unused=True, materialize_grads=False
        )

    def owners(reached: tuple[Tensor | None, ...]) -> dict[str, nn.Module]:
        out: dict[str, nn.Module] = {}
        for (name, _), grad in zip(outside, reached, strict=True):
            if grad is not None:
                owner = name.rpartition(".")[0]
                out[owner] = model.get_submodule(owner)
        return out

    return owners(reach_first), owners(reach_last)


def _named_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    return model.named_parameters()
