"""A Megatron-Core ``GPTModel`` or ``HybridModel`` with MoE layers as a
:class:`~moe_overlap.PreprocessableModel`.

Legend: ``S`` sequence, ``B`` batch, ``H`` hidden (Megatron-Core's ``[s, b, h]`` layout).
"""

from __future__ import annotations

import copy
import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import Tensor, nn

from moe_overlap import (
    ConfigError,
    IntegrationError,
    Microbatch,
    PreprocessOutput,
    ScheduleOptions,
)
from moe_overlap.adapters._adapted_model import AdaptedDecoder, AdaptedModel
from moe_overlap.adapters._built_on import BuiltOn
from moe_overlap.adapters._hf_model import AdapterConfig
from moe_overlap.adapters._hf_probe import Mismatch, failing_module, rel_difference, worst_gradient
from moe_overlap.adapters._layer_probe import (
    compare_backward,
    first_of_each,
    probe_tolerance,
    tolerance_text,
)
from moe_overlap.adapters._mc_config import refuse_config
from moe_overlap.adapters._mc_hybrid import (
    ATTENTION,
    final_norm,
    postprocess,
    preprocess,
    probe_model,
    refuse_hybrid,
)
from moe_overlap.adapters._mc_imports import TESTED_MEGATRON_CORE, mcore
from moe_overlap.adapters._mc_layers import McDenseLayer, McLayer, McMoELayer, layer_kwargs
from moe_overlap.adapters._tied_stash import Stash, hand, take
from moe_overlap.args import BOOL, MODULE, check_arg
from moe_overlap.blocks import MegatronHooks
from moe_overlap.engine import Bypass, BypassedModule, ChunkState

__all__ = ["LossFn", "McDecoder", "MegatronMoEAdapter", "SelfCheckReport", "masked_mean"]

LossFn = Callable[[Tensor, "Tensor | None"], Tensor]
"""``loss_fn(per_token_loss, loss_mask)``: the microbatch's scalar loss from what
``GPTModel`` returns with labels (``[b, s]``) and the microbatch's ``loss_mask``."""

PROBE_TOKENS = 8
"""The self-check's probe: two sequences of this many tokens."""


def masked_mean(per_token_loss: Tensor, loss_mask: Tensor | None) -> Tensor:
    """The default loss: the mean over the tokens ``loss_mask`` keeps (all without one),
    in float32, as ``sum(loss * mask) / sum(mask)``."""
    losses = per_token_loss.float()
    if loss_mask is None:
        return losses.sum() / losses.numel()
    mask = loss_mask.float()
    return (losses * mask).sum() / mask.sum()


class McDecoder(AdaptedDecoder[McLayer]):
    """``decoder`` as the schedule sees it: the adapted layers; the model's final norm runs
    in post-process."""


@dataclass(slots=True)
class SelfCheckReport:
    """What the construction-time self-check did: per layer structure, the layers it stands
    for and the largest relative difference found (none accepted on CPU or with
    deterministic algorithms), in the model's dtype."""

    enabled: bool
    seconds: float = 0.0
    structures: list[tuple[str, list[str], float, str]] = field(
        default_factory=list[tuple[str, list[str], float, str]]
    )
    """``(layer class, layer names, largest relative difference, probe dtype)``."""
    glue: float | None = None
    """``HybridModel``: the largest relative difference between the adapter's steps around
    the decoder (embedding, rotary table, final norm, output layer, loss) and the model's
    own ``forward``; ``None`` where not checked (``GPTModel``: its own ``_preprocess`` and
    ``_postprocess`` run)."""


_MODEL = (
    "the adapter calls its _preprocess and _postprocess and the layers' pieces, never its forward"
)
_HYBRID = (
    "the adapter calls its embedding, rotary_pos_emb, output_layer, _scale_logits and "
    "compute_language_model_loss as its forward does, and the layers' pieces, never its forward"
)
_DECODER = "the adapter runs its layers' pieces and its final norm, never its forward"
_MOE_LAYER = (
    "the adapter's slots call its _forward_attention, _forward_pre_mlp_layernorm and "
    "_forward_post_mlp, never its forward"
)
_MOE = (
    "the adapter's slots call its route, preprocess, dispatch, routed_experts_compute, "
    "combine and postprocess, never its forward"
)
_DENSE = "the adapter calls the layer it was built on, not a wrapper around it"


def _layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    decoder: object = getattr(model, "decoder", None)
    layers: object = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        got = "an empty ModuleList" if isinstance(layers, nn.ModuleList) else type(layers).__name__
        raise ConfigError(
            f"MegatronMoEAdapter: {type(model).__name__}.decoder.layers: expected a non-empty "
            f"ModuleList of TransformerLayers, received {got}"
        )
    return [(f"decoder.layers.{i}", m) for i, m in enumerate(layers)]


def _tied_embedding(model: nn.Module) -> frozenset[int]:
    """The ids of the word embedding's weight when the output layer shares it (one
    parameter, used by pre- and post-process)."""
    m: Any = model
    if not bool(getattr(m, "share_embeddings_and_output_weights", False)):
        return frozenset()
    if not (bool(m.pre_process) and bool(m.post_process)):
        return frozenset()  # a pipeline stage holds one of the two uses
    return frozenset({id(m.embedding.word_embeddings.weight)})


class _Method(nn.Module):
    """Calls ``model.method(**kwargs)``, or ``method(model, **kwargs)`` for a function, as
    its ``forward`` (for ``functional_call``)."""

    def __init__(self, model: nn.Module, method: str | Callable[..., object]) -> None:
        super().__init__()
        self.model = model
        self.method = method

    def forward(self, **kwargs: object) -> object:
        if isinstance(self.method, str):
            return cast("Callable[..., object]", getattr(self.model, self.method))(**kwargs)
        return self.method(self.model, **kwargs)


def _per_token(per_token_loss: Tensor, loss_mask: Tensor | None) -> Tensor:
    """The glue self-check's loss: the per-token loss itself."""
    del loss_mask
    return per_token_loss


def _structure(layer: nn.Module) -> tuple[object, ...]:
    """Layers of one structure: the same module classes at the same places."""
    named = cast("Iterator[tuple[str, nn.Module]]", layer.named_modules())
    mods = tuple((n, type(m).__qualname__) for n, m in named)
    dispatcher: object = getattr(getattr(layer, "mlp", None), "token_dispatcher", None)
    return (type(layer).__qualname__, mods, type(dispatcher).__qualname__)


class MegatronMoEAdapter(AdaptedModel[McLayer], MegatronHooks):
    """A Megatron-Core ``GPTModel`` or ``HybridModel`` with MoE layers for
    :func:`~moe_overlap.combined_1f1b`.

    The adapter holds no weights: it runs and trains ``model``'s own modules, so the
    optimizer takes the model as it is and checkpoints stay Megatron-Core's. The embedding
    and rotary tables are the model's own ``_preprocess``; the final norm, output layer and
    per-token loss its own ``_postprocess`` (a ``HybridModel``'s: the same steps of its
    ``forward``, on its own modules); each MoE layer is split into the schedule's four
    slots on its own methods (see :mod:`moe_overlap.adapters.megatron`); other layers run
    whole.

    Args:
        model: a ``GPTModel`` or ``HybridModel`` built with MoE layers, on its device,
            Megatron-Core's model-parallel state initialised: a whole model, or a pipeline
            stage's chunk
            (``pre_process`` / ``post_process`` as built; see
            :class:`~moe_overlap.adapters.megatron.MegatronMoEStage`).
        loss_fn: ``loss_fn(per_token_loss, loss_mask)``, the microbatch's scalar loss from
            the model's per-token loss ``[b, s]``; ``None``: :func:`masked_mean`.
        self_check: compare the split of each distinct layer structure with the layer's own
            forward and backward on a probe (a ``HybridModel``: the steps around its
            decoder with its own ``forward`` too) and refuse a mismatch with
            :class:`~moe_overlap.ConfigError` (see :attr:`self_check_report`).

    Raises :class:`~moe_overlap.ConfigError` at construction for a model or configuration
    it cannot train exactly, naming the member and the reason.
    """

    _built_on: BuiltOn | None

    microbatch_inputs = frozenset(
        {"position_ids", "labels", "loss_mask", "attention_mask", "padding_mask"}
    )
    """What the adapter reads (:class:`~moe_overlap.inputs.DeclaresInputs`): Megatron-Core's
    ``position_ids``, ``attention_mask`` (``[b, 1, s, s]``, ``True`` masked), ``labels``,
    ``loss_mask`` (the default loss's token weights) and ``padding_mask`` (``[b, s]``,
    ``True`` for padding: left out of routing)."""

    def __init__(
        self, model: nn.Module, *, loss_fn: LossFn | None = None, self_check: bool = True
    ) -> None:
        w = "MegatronMoEAdapter"
        check_arg(w, "model", model, MODULE)
        check_arg(w, "self_check", self_check, BOOL)
        if loss_fn is not None and not callable(loss_fn):
            raise ConfigError(
                f"{w}: loss_fn: expected a callable loss_fn(per_token_loss, loss_mask) or None "
                f"(the mean over the tokens loss_mask keeps), received {type(loss_fn).__name__}"
            )
        mc = mcore()
        kinds = (mc.gpt_model,) if mc.hybrid_model is None else (mc.gpt_model, mc.hybrid_model)
        if not isinstance(model, kinds):
            raise ConfigError(
                f"{w}: model: expected a Megatron-Core GPTModel "
                "(megatron.core.models.gpt.GPTModel) or HybridModel "
                "(megatron.core.models.hybrid.hybrid_model.HybridModel), received "
                f"{type(model).__name__}"
            )
        self._bind(model, loss_fn if loss_fn is not None else masked_mean)
        if self._hybrid:
            refuse_hybrid(model, self._layers)
        refuse_config(model, self._layers)
        if not self._moe and self.pre_process and self.post_process:
            raise ConfigError(
                f"{w}: {type(model).__name__}: expected MoE layers (a TransformerLayer whose "
                "mlp is Megatron-Core's MoELayer), received none"
            )
        self._check_bypassed()
        self.self_check_report = SelfCheckReport(enabled=self_check)
        if self_check:
            self._self_check()
        self._built_on = BuiltOn(w, self._layers, self._watched())

    def _bind(self, model: nn.Module, loss_fn: LossFn) -> None:
        """What the adapter reads of ``model`` (no checks: the constructor's, and the glue
        self-check's probe adapter)."""
        mc = mcore()
        self.model = model
        self._model: Any = model  # Megatron-Core's GPTModel or HybridModel (untyped)
        self._hybrid = mc.hybrid_model is not None and isinstance(model, mc.hybrid_model)
        self.loss_fn: LossFn = loss_fn
        self._layers = _layers(model)
        self._moe = [
            name for name, m in self._layers if isinstance(getattr(m, "mlp", None), mc.moe_layer)
        ]
        # What the schedule's free-input policy reads (schedule_options keeps every input).
        self.config = AdapterConfig()
        self._shared = _tied_embedding(model)
        self._stashes: dict[int, Stash] = {}
        self._built_on = None
        self.decoder = McDecoder(self._adapt())

    # --- construction --------------------------------------------------------------------
    def _adapt(self) -> tuple[McLayer, ...]:
        moe = set(self._moe)
        return tuple(
            McMoELayer(layer, i, name, self.config)
            if name in moe
            else McDenseLayer(layer, i, name, self.config)
            for i, (name, layer) in enumerate(self._layers)
        )

    def _watched(self) -> Iterator[tuple[str, nn.Module]]:
        """The modules whose children the adapter calls: the model, its decoder, every
        layer and each layer's MoE."""
        yield "", self.model
        yield "decoder", self.model.get_submodule("decoder")
        moe = set(self._moe)
        for name, layer in self._layers:
            yield name, layer
            if name in moe:
                yield f"{name}.mlp", layer.get_submodule("mlp")

    # --- the self-check -------------------------------------------------------------------
    def _probe(self, device: torch.device, dtype: torch.dtype) -> ChunkState:
        """Two sequences of random hidden states (a private generator), causally masked,
        with the rotary tables the model's own ``_preprocess`` makes for them."""
        hidden = int(self._model.config.hidden_size)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(PROBE_TOKENS, 2, hidden, generator=g).to(device, dtype)
        causal = torch.ones(PROBE_TOKENS, PROBE_TOKENS, dtype=torch.bool, device=device).triu(1)
        mask = causal.expand(2, 1, PROBE_TOKENS, PROBE_TOKENS)
        cs = ChunkState(Microbatch(attention_mask=mask, decoder_input=x))
        with torch.no_grad():
            cs.set_preprocess_output(self._run_preprocess(None, None, x, None))
        return cs

    def _self_check(self) -> None:
        """Each distinct layer structure's split against the layer's own forward/backward."""
        start = time.perf_counter()
        report = self.self_check_report
        p0 = next(self.model.parameters())
        dtype = _activation_dtype(self.model)
        cs = self._probe(p0.device, dtype)
        moe = set(self._moe)
        firsts = first_of_each(((n, m) for n, m in self._layers if n in moe), _structure)
        for name, layer, names in firsts:
            try:
                worst = _compare(layer, name, cs, self.config)
            except (ConfigError, IntegrationError):
                raise
            except Exception as exc:  # Megatron-Core's own code, run as the adapter runs it
                raise ConfigError(
                    f"MegatronMoEAdapter: {name}: {failing_module(exc, layer)} raised "
                    f"{type(exc).__name__}: {exc}, when the self-check ran the layer's own "
                    "forward and backward and the adapter's split of it on a probe; "
                    f"expected both to run (or pass self_check=False){_mixed_hint(self.model)}"
                ) from exc
            tolerance = probe_tolerance(dtype, p0.device)
            if worst.difference > tolerance:
                bound = tolerance_text(tolerance, dtype)
                raise ConfigError(
                    f"MegatronMoEAdapter: {name} ({type(layer).__name__}): the adapter's split "
                    f"of the layer differs from its own forward: {worst} (relative; {bound}); "
                    "expected the layer's output to be residual + moe(pre_mlp_layernorm(h)) "
                    "computed by its own methods, as Megatron-Core's fine-grained schedule "
                    "splits it. This layer cannot be scheduled exactly (self_check=False "
                    "trains it anyway, unverified)"
                )
            report.structures.append(
                (
                    type(layer).__name__,
                    names,
                    worst.difference,
                    str(dtype).removeprefix("torch."),
                )
            )
        if self._hybrid:
            report.glue = self._check_glue(p0.device, dtype)
        report.seconds = time.perf_counter() - start

    def _check_glue(self, device: torch.device, dtype: torch.dtype) -> float:
        """A ``HybridModel``'s steps around its decoder against its own ``forward``: both on
        a probe model sharing its embedding, rotary table, final norm and output layer, with
        a copy of one layer (its first attention layer, else its first); the output and the
        gradients of the input and every parameter (``autograd.grad``: the model's ``.grad``
        is left alone)."""
        m = self._model
        symbols = [str(t) for t in m.decoder.layer_type_list]
        pick = next((i for i, t in enumerate(symbols) if t in ATTENTION), 0)
        name, layer = self._layers[pick]
        probe = probe_model(self.model, _copy(layer))
        try:
            worst = _compare_glue(probe)
        except (ConfigError, IntegrationError):
            raise
        except Exception as exc:  # Megatron-Core's own code, run as the adapter runs it
            raise ConfigError(
                f"MegatronMoEAdapter: {type(self.model).__name__}: "
                f"{failing_module(exc, probe)} raised {type(exc).__name__}: {exc}, when the "
                "self-check ran the model's own forward and the adapter's steps around the "
                f"decoder (with a copy of {name}) on a probe; expected both to run (or pass "
                "self_check=False)"
            ) from exc
        tolerance = probe_tolerance(dtype, device)
        if worst.difference > tolerance:
            bound = tolerance_text(tolerance, dtype)
            raise ConfigError(
                f"MegatronMoEAdapter: {type(self.model).__name__}: the adapter's steps around "
                "the decoder (embedding, rotary table, final norm, output layer, loss) differ "
                f"from the model's own forward: {worst}; {bound} (probed with a copy of "
                f"{name}); expected HybridModel.forward as in Megatron-Core "
                f"{TESTED_MEGATRON_CORE}, received Megatron-Core {mcore().version}. The model "
                "cannot be trained exactly by this adapter (self_check=False trains it anyway, "
                "unverified)"
            )
        return worst.difference

    # --- PreprocessableModel ----------------------------------------------------------------
    @property
    def pre_process(self) -> bool:
        """Whether the model embeds token ids (a whole model or a first stage)."""
        return bool(self._model.pre_process)

    @property
    def post_process(self) -> bool:
        """Whether the model ends in its output layer (a whole model or a last stage);
        otherwise it hands its hidden states on."""
        return bool(self._model.post_process)

    def _run_preprocess(
        self,
        input_ids: Tensor | None,
        position_ids: Tensor | None,
        decoder_input: Tensor | None,
        padding_mask: Tensor | None,
    ) -> PreprocessOutput:
        """The model's own ``_preprocess`` (embedding unless given ``decoder_input``, rotary
        tables; a ``HybridModel``'s the same steps of its ``forward``) and what its decoder
        does to its input before the first layer."""
        mc = mcore()
        stash = (
            self._stash_for(input_ids)
            if self._shared and input_ids is not None and decoder_input is None
            else None
        )
        if self._hybrid:
            x, rotary = cast(
                "tuple[object, Tensor | None]",
                self._call(preprocess, take, stash)(
                    input_ids=input_ids, position_ids=position_ids, decoder_input=decoder_input
                ),
            )
            if not isinstance(x, Tensor):
                raise IntegrationError(
                    f"MegatronMoEAdapter: {type(self.model).__name__}: expected the decoder "
                    f"input as a tensor, received {type(x).__name__}"
                )
            h = mc.make_viewless(inp=x, requires_grad=True, keep_graph=True)
            return PreprocessOutput(h, rotary, padding_mask=padding_mask)
        out = cast(
            "tuple[object, ...]",
            self._call("_preprocess", take, stash)(
                input_ids=input_ids,
                position_ids=position_ids,
                decoder_input=decoder_input,
                inference_context=None,
                packed_seq_params=None,
                padding_mask=padding_mask,
            ),
        )
        first: object = out[0]
        if isinstance(first, mc.wrapped_tensor):
            first = cast("Any", first).unwrap()
        if not isinstance(first, Tensor):
            raise IntegrationError(
                f"MegatronMoEAdapter: {type(self.model).__name__}._preprocess: expected the "
                f"decoder input as a tensor, received {type(first).__name__}"
            )
        h = mc.make_viewless(inp=first, requires_grad=True, keep_graph=True)
        rest = [t if isinstance(t, Tensor) else None for t in out[1:6]]
        return PreprocessOutput(h, rest[0], rest[1], rest[2], rest[3], rest[4])

    def _preprocess(
        self,
        input_ids: Tensor | None,
        position_ids: Tensor | None,
        *,
        decoder_input: Tensor | None = None,
        packed_seq_params: object | None = None,
        padding_mask: Tensor | None = None,
    ) -> PreprocessOutput:
        """The model's own ``_preprocess``; packed sequences are refused."""
        if packed_seq_params is not None:
            raise ConfigError(
                "MegatronMoEAdapter._preprocess: packed sequences are not supported; expected "
                f"packed_seq_params=None, received {type(packed_seq_params).__name__}"
            )
        if decoder_input is None and input_ids is None:
            raise ConfigError(
                "MegatronMoEAdapter._preprocess: expected input_ids or decoder_input, "
                "received neither"
            )
        pre = self._run_preprocess(input_ids, position_ids, decoder_input, padding_mask)
        self.on_microbatch(pre.decoder_input)
        return pre

    def _call(
        self,
        method: str | Callable[..., object],
        through: Callable[[Tensor, Stash], Tensor],
        stash: Stash | None,
    ) -> Callable[..., object]:
        """The model's ``method`` (or ``method(model, ...)`` for a function), its tied weight
        used ``through`` the stash's autograd identity (as it is without a stash or without
        grad)."""
        if stash is None or not torch.is_grad_enabled():
            if not isinstance(method, str):
                return functools.partial(method, self.model)
            return cast("Callable[..., object]", getattr(self.model, method))
        swapped = {
            f"model.{n}": through(p, stash)
            for n, p in self.model.named_parameters()
            if id(p) in self._shared and p.requires_grad
        }
        call = _Method(self.model, method)

        def run(**kwargs: object) -> object:
            return cast("object", torch.func.functional_call(call, swapped, (), kwargs))

        return run

    def _output(
        self,
        hidden_states: Tensor,
        labels: Tensor | None,
        loss_mask: Tensor | None,
        stash: Stash | None,
    ) -> Tensor:
        """The decoder's final norm, then the model's own ``_postprocess`` (output layer,
        per-token loss with ``labels``); ``loss_fn`` of it, else the logits ``[b, s, v]``."""
        mc = mcore()
        decoder = self.model.get_submodule("decoder")
        norm: object = (
            final_norm(decoder) if self._hybrid else getattr(decoder, "final_layernorm", None)
        )
        h = hidden_states
        if isinstance(norm, nn.Module):
            h = mc.make_viewless(inp=norm(h), requires_grad=True, keep_graph=True)
        if self._hybrid:
            out: object = self._call(postprocess, hand, stash)(hidden_states=h, labels=labels)
        else:
            out = self._call("_postprocess", hand, stash)(
                hidden_states=h,
                input_ids=None,
                position_ids=None,
                labels=labels,
                rotary_pos_emb=None,
                rotary_pos_cos=None,
                rotary_pos_sin=None,
                mtp_in_postprocess=False,
                loss_mask=loss_mask,
            )
        if not isinstance(out, Tensor):
            step = "'s output layer and loss" if self._hybrid else "._postprocess"
            raise IntegrationError(
                f"MegatronMoEAdapter: {type(self.model).__name__}{step}: expected a "
                f"tensor, received {type(out).__name__}"
            )
        if labels is None:
            return out
        loss = cast("object", self.loss_fn(out, loss_mask))  # a user's callable
        if not isinstance(loss, Tensor):
            raise IntegrationError(
                f"MegatronMoEAdapter: loss_fn: expected a tensor, received {type(loss).__name__}"
            )
        return loss

    # --- public helpers -------------------------------------------------------------------
    def bypassed_modules(self) -> Iterator[BypassedModule]:
        """The Megatron-Core modules whose ``forward`` the adapter never calls (checked at
        every plan build: wrappers, ``compile`` and hooks on them are refused), and a
        changed model (a layer, MoE, router or expert added, removed or replaced)."""
        cls = type(self.model).__name__
        if self._built_on is not None:
            self._built_on.check_blocks(_layers(self.model), cls)
        yield BypassedModule(cls, self.model, Bypass.FORWARD, _HYBRID if self._hybrid else _MODEL)
        yield BypassedModule(
            f"{cls}.decoder", self.model.get_submodule("decoder"), Bypass.FORWARD, _DECODER
        )
        moe = set(self._moe)
        current = dict(_layers(self.model))
        for name, layer in self._layers:
            where = f"{cls}.{name}"
            if current.get(name) is not layer:
                found = current.get(name)
                raise ConfigError(
                    f"{where}: expected the layer the adapter was built on, received "
                    f"{type(found).__name__} in its place; build a new MegatronMoEAdapter "
                    "after changing the model"
                )
            if name not in moe:
                yield BypassedModule(where, layer, Bypass.WRAPPER, _DENSE)
                continue
            yield BypassedModule(where, layer, Bypass.FORWARD, _MOE_LAYER)
            yield BypassedModule(f"{where}.mlp", layer.get_submodule("mlp"), Bypass.FORWARD, _MOE)
        if self._built_on is not None:
            self._built_on.check_children(cls)

    def schedule_options(
        self, *, free_input: bool = False, ep_overlap_early_attn_memory_release: bool = False
    ) -> ScheduleOptions:
        """Schedule options matching this adapter. ``free_input`` is off: Megatron-Core's
        all-to-all hands its input on as its output on one expert-parallel rank, so no slot
        input is released early."""
        return ScheduleOptions(
            delay_wgrad_compute=False,
            free_input=free_input,
            ep_overlap_early_attn_memory_release=ep_overlap_early_attn_memory_release,
        )

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        *,
        labels: Tensor | None = None,
        loss_mask: Tensor | None = None,
        padding_mask: Tensor | None = None,
    ) -> Tensor:
        """The plain path (each layer's ``run_plain`` between the model's own pre- and
        post-process): ``loss_fn`` of the per-token loss with ``labels``, else the logits.
        Bit-identical to :func:`~moe_overlap.combined_1f1b`."""
        return self.plain_forward(
            input_ids,
            position_ids,
            labels=labels,
            loss_mask=loss_mask,
            attention_mask=attention_mask,
            padding_mask=padding_mask,
        )


def _shared(root: nn.Module) -> dict[int, object]:
    """What a copy of ``root`` must not copy: every process group (they cannot be copied)
    and every config object reachable from its modules' attributes, shared; a tensor with
    a graph (a dispatcher's routing state from the last call: the next call sets it anew),
    detached."""
    found: dict[int, object] = {}
    seen: set[int] = set()
    todo: list[object] = [root]
    while todo:
        obj = todo.pop()
        if isinstance(obj, Tensor) and obj.grad_fn is not None:
            found[id(obj)] = obj.detach()
            continue
        if id(obj) in seen or isinstance(obj, (Tensor, str, bytes, int, float, bool, type)):
            continue
        seen.add(id(obj))
        kind = type(obj)
        if isinstance(obj, torch.distributed.ProcessGroup) or kind.__name__ in _SHARED_KINDS:
            found[id(obj)] = obj
            continue
        if isinstance(obj, dict):
            todo.extend(cast("dict[object, object]", obj).values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo.extend(cast("list[object]", obj))
        elif (hasattr(obj, "__dict__") and not callable(obj)) or isinstance(obj, nn.Module):
            todo.extend(vars(obj).values())
    return found


_SHARED_KINDS = frozenset({"ProcessGroupCollection", "TransformerConfig", "MLATransformerConfig"})


def _copy(layer: nn.Module) -> nn.Module:
    """A training-mode copy of ``layer`` sharing its process groups and config."""
    dup = copy.deepcopy(layer, cast("dict[int, Any]", _shared(layer)))
    dup.train()
    return dup


def _activation_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the hidden states ``model`` computes in: that of most of its floating
    parameters' elements (a bf16 model's local norms may keep fp32 weights, and a stage
    without the embedding starts with one)."""
    count: dict[torch.dtype, int] = {}
    for q in model.parameters():
        if q.is_floating_point():
            count[q.dtype] = count.get(q.dtype, 0) + q.numel()
    return max(count, key=lambda d: count[d]) if count else torch.get_default_dtype()


def _mixed_hint(model: nn.Module) -> str:
    """A hint for a model whose floating parameters have several dtypes (Megatron-Core
    builds the local norms in fp32 under ``params_dtype=bf16``; its ``Float16Module`` casts
    the whole model, and CUDA's ``layer_norm`` takes no mixed dtypes)."""
    dtypes = sorted({str(q.dtype) for q in model.parameters() if q.is_floating_point()})
    if len(dtypes) < 2:
        return ""
    return (
        f". The model's parameters have several dtypes ({', '.join(dtypes)}): cast the whole "
        "model to one (model.to(torch.bfloat16), as Megatron-Core's Float16Module does)"
    )


def _compare_glue(probe: nn.Module) -> Mismatch:
    """The adapter's plain path (on an adapter bound to ``probe``) against ``probe``'s own
    ``forward``: output (the per-token loss, or the last layer's hidden states on a stage
    without post-process), input gradient, parameter gradients."""
    p: Any = probe
    device, dtype = next(probe.parameters()).device, _activation_dtype(probe)
    g = torch.Generator().manual_seed(0)
    vocab, hidden = int(p.vocab_size), int(p.config.hidden_size)
    shape = (2, PROBE_TOKENS)
    causal = torch.ones(PROBE_TOKENS, PROBE_TOKENS, dtype=torch.bool, device=device).triu(1)
    mask = causal.expand(2, 1, PROBE_TOKENS, PROBE_TOKENS)
    positions = torch.arange(PROBE_TOKENS, device=device).expand(shape)
    pre, post = bool(p.pre_process), bool(p.post_process)
    if pre:
        x = torch.randint(0, vocab, shape, generator=g).to(device)
    else:
        x = torch.randn(PROBE_TOKENS, 2, hidden, generator=g).to(device, dtype)
    labels = torch.randint(0, vocab, shape, generator=g).to(device) if post else None
    x_ref = x if pre else x.detach().clone().requires_grad_()
    x_cand = x if pre else x.detach().clone().requires_grad_()
    if not pre:
        p.set_input_tensor(x_ref)
    out_r = cast("Tensor", probe(x_ref if pre else None, positions, mask, labels=labels))
    adapter = MegatronMoEAdapter.__new__(MegatronMoEAdapter)
    adapter._bind(probe, _per_token)  # pyright: ignore[reportPrivateUsage]
    out_c = adapter.forward(x_cand, positions, mask, labels=labels)
    if out_c.shape != out_r.shape:
        return Mismatch("output shape", float("inf"))
    worst = Mismatch("output", rel_difference(out_c, out_r))
    params = [(n, q) for n, q in probe.named_parameters() if q.requires_grad]
    wrt_r = [q for _, q in params] + ([] if pre else [x_ref])
    wrt_c = [q for _, q in params] + ([] if pre else [x_cand])
    grad_out = torch.randn(out_r.shape, generator=g).to(out_r.device, out_r.dtype)
    grads_r = torch.autograd.grad(out_r, wrt_r, grad_out, allow_unused=True)
    grads_c = torch.autograd.grad(out_c, wrt_c, grad_out, allow_unused=True)
    names = [f"gradient of {n}" for n, _ in params] + ([] if pre else ["input gradient"])
    pairs: list[tuple[str, Tensor | None, Tensor | None]] = [
        (what, c, r) for what, c, r in zip(names, grads_c, grads_r, strict=True)
    ]
    return worst_gradient(pairs, worst)


def _compare(layer: nn.Module, name: str, cs: ChunkState, config: AdapterConfig) -> Mismatch:
    """The split (on one copy) against the layer's own forward and backward (on another):
    output, input gradient, parameter gradients."""
    ref, cand = _copy(layer), _copy(layer)
    split = McMoELayer(cand, 0, name, config)
    x = cs.decoder_input
    if x is None:
        raise IntegrationError(f"MegatronMoEAdapter: {name}: the probe has no hidden states")
    x_ref = x.detach().clone().requires_grad_()
    x_cand = x.detach().clone().requires_grad_()
    out_r, _ = cast("tuple[Tensor, object]", ref(hidden_states=x_ref, **layer_kwargs(cs)))
    g = torch.Generator().manual_seed(1)
    grad_out = torch.randn(out_r.shape, generator=g).to(out_r.device, out_r.dtype)
    torch.autograd.backward(out_r, grad_out)
    out_c = split.run_plain(x_cand, cs)
    return compare_backward(out_c, out_r, grad_out, (x_cand, x_ref), (cand, ref))
