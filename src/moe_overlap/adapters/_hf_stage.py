"""A pipeline stage of an adapted transformers model: a range of its decoder layers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import cast

import torch
from torch import Tensor, nn

from moe_overlap import ConfigError, IntegrationError, ScheduleOptions, WgradError
from moe_overlap.adapters._hf_calls import base_model, causal_lm_output, decoder_layers
from moe_overlap.adapters._hf_layers import HFLayer
from moe_overlap.adapters._hf_model import AdapterConfig, AdapterDecoder, TransformersMoEAdapter
from moe_overlap.args import Instance, check_arg
from moe_overlap.blocks import MegatronHooks, StageLayers, StageRange
from moe_overlap.engine import BypassedModule

__all__ = ["ModelScope", "TransformersMoEStage"]


_ADAPTER = Instance(TransformersMoEAdapter, "a TransformersMoEAdapter", error=IntegrationError)


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

    Its ``state_dict`` and ``named_parameters`` use the model's own names
    (``model.layers.{i}...`` with the global ``i``, ``model.embed_tokens.weight``,
    ``lm_head.weight``, ...), so each rank's stages checkpoint with
    ``torch.distributed.checkpoint`` into one set of keys any layout loads: the model's
    modules are registered at their paths, under
    :class:`~moe_overlap.adapters.transformers.ModelScope` s standing for the modules the
    stage holds only parts of.

    Refused with :class:`~moe_overlap.ConfigError`: a range outside the model, an empty one
    at either end of it (a stage without layers only passes hidden states on), a parameter
    both the embedding and the LM head reach (tied embeddings) split over two stages, a
    router aux loss (it sums over every layer of a microbatch, across stages), and a model
    name that would shadow a member of the stage (``decoder``, ``config``, ``output``, ...).
    """

    def __init__(self, adapter: TransformersMoEAdapter, layers: range) -> None:
        super().__init__()
        check_arg("TransformersMoEStage", "adapter", adapter, _ADAPTER)
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
        first, last = _outside_parameters(adapter)
        first_ids, last_ids = {id(p) for p in first.values()}, {id(p) for p in last.values()}
        tied = sorted(n for n, p in {**first, **last}.items() if id(p) in first_ids & last_ids)
        if tied and not (self.pre_process and self.post_process):
            raise ConfigError(
                f"TransformersMoEStage({name}): {tied} are reached by both the embedding and "
                "the LM head (tied weights); expected them on one stage, received a split "
                "into stages (untie them: tie_word_embeddings=False)"
            )
        owned = {**(first if self.pre_process else {}), **(last if self.post_process else {})}
        held = StageLayers((layer.layer for layer in self.layer_list), start=layers.start)
        _build_view(self, adapter.model, held, owned, name)

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

    def bypassed_modules(self) -> Iterator[BypassedModule]:
        """The transformers modules of this stage whose ``forward`` the slots skip or split."""
        return self.adapter.bypassed_in(self.layers_range)

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
        pending = {
            k: n for layer in self.layer_list for k, n in layer.pending_wgrad_by_module().items()
        }
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
    """What a stage reads (:class:`~moe_overlap.inputs.DeclaresInputs`): a stage takes no
    ``attention_mask`` (its ``forward`` has none; use the whole adapter for padded
    batches)."""

    def forward(self, x: Tensor, position_ids: Tensor | None = None) -> Tensor:
        """The plain path: token ids or hidden states in, hidden states or logits out."""
        return self.plain_forward(x, position_ids)

    @property
    def pending_wgrad(self) -> int:
        """How many delayed weight gradients of this stage wait for ``backward_dw`` (a
        :class:`~moe_overlap.PendingWgrad`)."""
        return sum(layer.pending_wgrad for layer in self.layer_list)

    def discard_wgrad(self) -> None:
        """Drop this stage's pending delayed weight gradients (after a failed step)."""
        for layer in self.layer_list:
            layer.discard_wgrad()


def _outside_parameters(
    adapter: TransformersMoEAdapter,
) -> tuple[dict[str, nn.Parameter], dict[str, nn.Parameter]]:
    """The parameters outside the decoder layers (under every name the model gives them,
    tied ones included) that the model's own embedding reaches, and those its own final
    norm and LM head reach."""
    model, base = adapter.model, adapter.base
    inside = {id(p) for layer in decoder_layers(base) for p in layer.parameters()}
    outside = [p for _, p in _named_parameters(model) if id(p) not in inside and p.requires_grad]
    if not outside:
        return {}, {}
    names: dict[int, list[str]] = {}
    for n, p in _named_parameters(model, remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    p0 = outside[0]
    with torch.enable_grad():
        ids = torch.zeros(1, 4, dtype=torch.long, device=p0.device)
        embedded = adapter.embed_at(ids, None)
        reach_first = torch.autograd.grad(
            embedded.float().sum(), outside, allow_unused=True, materialize_grads=False
        )
        hidden = torch.zeros(
            1, 4, adapter.hidden_size, dtype=embedded.dtype, device=p0.device, requires_grad=True
        )
        logits = causal_lm_output(
            model,
            base,
            hidden,
            labels=None,
            accepts_router_flag=adapter._accepts_router_flag,  # pyright: ignore[reportPrivateUsage] - same package
        )
        reach_last = torch.autograd.grad(
            logits.float().sum(), outside, allow_unused=True, materialize_grads=False
        )

    def reached(grads: tuple[Tensor | None, ...]) -> dict[str, nn.Parameter]:
        out: dict[str, nn.Parameter] = {}
        for p, grad in zip(outside, grads, strict=True):
            if grad is not None:
                out.update((n, p) for n in names[id(p)])
        return out

    return reached(reach_first), reached(reach_last)


class ModelScope(nn.Module):
    """Stands, in a stage, for a module of the model the stage holds only parts of (so those
    parts keep the model's names); it has no forward."""


def _build_view(
    stage: nn.Module,
    model: nn.Module,
    layers: StageLayers,
    owned: dict[str, nn.Parameter],
    name: str,
) -> None:
    """Register ``layers`` and ``owned`` in ``stage`` under the model's own names.

    A module whose parameters are all ``owned`` comes whole (its buffers too); the others'
    owned parameters come alone, in :class:`ModelScope` s standing for their modules.
    """
    modules = dict(_named_modules(model))
    order = {n: i for i, n in enumerate(modules)}
    layers_path = next(n for n, m in modules.items() if m is decoder_layers(base_model(model)))
    owned_ids = {id(p) for p in owned.values()}
    whole: list[str] = []
    for owner in sorted({n.rpartition(".")[0] for n in owned} - {""}, key=len):
        if any(owner.startswith(w + ".") for w in whole):
            continue
        if all(id(p) in owned_ids for p in modules[owner].parameters()):
            whole.append(owner)
    entries: list[tuple[int, str, nn.Module | nn.Parameter]] = [
        (order[layers_path], layers_path, layers)
    ]
    entries += [(order[w], w, modules[w]) for w in whole]
    entries += [
        (order[n.rpartition(".")[0]], n, p)
        for n, p in owned.items()
        if not any(n.startswith(w + ".") for w in whole)
    ]
    for _, path, obj in sorted(entries, key=lambda e: (e[0], e[1])):
        _place(stage, path, obj, name)


def _place(stage: nn.Module, path: str, obj: nn.Module | nn.Parameter, name: str) -> None:
    *scopes, leaf = path.split(".")
    node = stage
    for i, part in enumerate(scopes):
        child = dict(node.named_children()).get(part)
        if child is None:
            _check_free(node, part, ".".join(scopes[: i + 1]), name)
            child = ModelScope()
            node.add_module(part, child)
        node = child
    _check_free(node, leaf, path, name)
    if isinstance(obj, nn.Parameter):
        node.register_parameter(leaf, obj)
    else:
        node.add_module(leaf, obj)


def _check_free(node: nn.Module, attr: str, path: str, name: str) -> None:
    if hasattr(node, attr):
        raise ConfigError(
            f"TransformersMoEStage({name}): the model's {path!r} would be named like the "
            f"stage's own member {attr!r} ({type(getattr(node, attr)).__name__}); expected "
            "model names that leave the stage's members free (its state_dict keys are the "
            "model's), received a clash"
        )


def _named_parameters(
    model: nn.Module, *, remove_duplicate: bool = True
) -> Iterator[tuple[str, nn.Parameter]]:
    return model.named_parameters(remove_duplicate=remove_duplicate)


def _named_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    return cast("Iterator[tuple[str, nn.Module]]", model.named_modules(remove_duplicate=False))
