"""A transformers MoE causal LM as a :class:`~moe_overlap.PreprocessableModel`.

Legend: ``B`` batch, ``S`` sequence, ``D`` hidden.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe_overlap import ConfigError, CudaGraphModule, IntegrationError, WgradError
from moe_overlap.adapters._built_on import BuiltOn
from moe_overlap.adapters._hf_aux import (
    RouterAuxLoss,
    aux_top_k,
    model_aux_loss,
    router_logits_source,
)
from moe_overlap.adapters._hf_bypass import bypassed, check_layers_unchanged, repeated_outside
from moe_overlap.adapters._hf_calls import (
    LayerCall,
    base_model,
    causal_lm_output,
    decoder_input,
    decoder_layers,
    layer_calls,
)
from moe_overlap.adapters._hf_ep import expert_parameter_names, experts_of, shard_experts
from moe_overlap.adapters._hf_experts import DelayedLinear
from moe_overlap.adapters._hf_layers import HFDenseLayer, HFLayer, HFMoELayer
from moe_overlap.adapters._hf_plan import LayerPlan, SelfCheck, plan_layers, probe_calls
from moe_overlap.adapters._hf_probe import failing_module, probe_ids
from moe_overlap.adapters._hf_random import RandomModule, check_quiet, config_hint, outside_draws
from moe_overlap.adapters._hf_structure import block_of
from moe_overlap.adapters._hf_tied import TiedGradients, tied_embeddings
from moe_overlap.args import (
    BOOL,
    GROUP,
    MODULE,
    NONE,
    Items,
    OneOf,
    Opt,
    Spec,
    check_arg,
    check_fields,
)
from moe_overlap.blocks import MegatronHooks, TokenDispatcher, check_recompute, recompute_module
from moe_overlap.engine import BypassedModule, ChunkState, check_module

__all__ = ["AdapterConfig", "AdapterDecoder", "TransformersMoEAdapter"]

_NOT_SOFTMAX = ("linear", "mamba", "conv", "delta", "ssm", "recurrent")


@dataclass(frozen=True, slots=True, kw_only=True)
class AdapterConfig:
    """The configuration the schedule reads (free-input policy, MTP layers).

    The all-to-all dispatcher, no FP8/FP4, no CUDA graphs, no MTP: the defaults are what
    the adapter implements.
    """

    delay_wgrad_compute: bool = False
    moe_token_dispatcher_type: str = "alltoall"
    moe_flex_dispatcher_backend: str | None = None
    fp8: str | None = None
    fp4: str | None = None
    cuda_graph_modules: tuple[CudaGraphModule, ...] = ()
    mtp_num_layers: int | None = None

    def __post_init__(self) -> None:
        check_fields(self, _ADAPTER_CONFIG)


_ADAPTER_CONFIG: dict[str, Spec[object]] = {
    "delay_wgrad_compute": BOOL,
    "moe_token_dispatcher_type": OneOf(("alltoall",)),
    "moe_flex_dispatcher_backend": NONE,
    "fp8": NONE,
    "fp4": NONE,
    "cuda_graph_modules": Items(
        OneOf[CudaGraphModule](()), expects="() (the adapter graphs nothing)"
    ),
    "mtp_num_layers": NONE,
}


class AdapterDecoder:
    """``decoder`` as the schedule sees it: the adapted layers; final norm in post-process."""

    def __init__(self, layers: tuple[HFLayer, ...]) -> None:
        self.layers = layers
        self.input_tensor: Tensor | None = None
        self.final_layernorm: Callable[[Tensor], Tensor] | None = None


def _refuse_mixers(config: object, num_layers: int) -> None:
    """Layers whose token mixer is not softmax attention (linear attention, Mamba, convs)."""
    for key in ("layer_types", "layers_block_type", "mixer_types"):
        kinds: object = getattr(config, key, None)
        if not isinstance(kinds, (list, tuple)):
            continue
        for i, kind in enumerate(list(cast("Sequence[object]", kinds))[:num_layers]):
            if isinstance(kind, str) and any(w in kind.lower() for w in _NOT_SOFTMAX):
                raise ConfigError(
                    f"{type(config).__name__}.{key}[{i}]: the adapter schedules softmax-attention "
                    f"layers (full or sliding window); expected such a layer, received {kind!r}"
                )


def _check_arguments(
    model: nn.Module,
    ep_group: dist.ProcessGroup | None,
    delay_wgrad_compute: bool,
    router_aux_loss: bool | None,
    self_check: bool,
    recompute: Iterable[str],
) -> frozenset[str]:
    """:class:`TransformersMoEAdapter`'s arguments checked; the parts to recompute."""
    w = "TransformersMoEAdapter"
    check_arg(w, "model", model, MODULE)
    check_arg(w, "ep_group", ep_group, Opt(GROUP))
    check_arg(w, "delay_wgrad_compute", delay_wgrad_compute, BOOL)
    check_arg(w, "router_aux_loss", router_aux_loss, Opt(BOOL))
    check_arg(w, "self_check", self_check, BOOL)
    name = type(model).__name__
    parts = check_recompute(recompute, f"{name} adapter: recompute")
    unsupported = sorted(parts - {"attention", "norm"})
    if unsupported:
        raise ConfigError(
            f"{name} adapter: recompute: expected 'attention' and/or 'norm' (the layer's "
            f"own modules the slots call), received also {unsupported}, which sit inside "
            "transformers modules the adapter runs whole"
        )
    return parts


def _hf_config(model: nn.Module) -> object:
    """The model's transformers config."""
    hf_config: object = getattr(model, "config", None)
    if hf_config is None:
        raise ConfigError(
            f"{type(model).__name__}.config: expected a transformers config, received None"
        )
    return hf_config


def _check_bypassed(modules: Iterable[BypassedModule]) -> None:
    for item in modules:
        check_module(item.module, item.name, item.reason, item.bypass)


@dataclass(frozen=True, slots=True)
class _MoELayers:
    """The model's MoE layers (by index), their experts' count, those already sharded."""

    layers: list[int]
    count: int
    sharded: list[int]

    @staticmethod
    def of(model: nn.Module, layers: Sequence[nn.Module], *, self_check: bool) -> _MoELayers:
        """Refuses a model without MoE layers, with several expert counts, or already
        sharded when the self-check (which needs every expert) is on."""
        name = type(model).__name__
        moe_layers = [i for i, layer in enumerate(layers) if block_of(layer) is not None]
        if not moe_layers:
            raise ConfigError(
                f"{name}: expected MoE layers, each with a child (the MoE block) holding an "
                "'experts' module with 3-D expert weights (transformers' fused layout); "
                "received none. Experts stored otherwise (flat 2-D weights, product keys, "
                "experts directly on the decoder layer) are not supported"
            )
        num_experts = {experts_of(layers[i]).num_global for i in moe_layers}
        if len(num_experts) != 1:
            raise ConfigError(
                f"{name}: expected every MoE layer to have the same number of experts, received {sorted(num_experts)}"
            )
        sharded = [
            i
            for i in moe_layers
            if experts_of(layers[i]).num_local != experts_of(layers[i]).num_global
        ]
        if sharded and self_check:
            e = experts_of(layers[sharded[0]])
            raise ConfigError(
                f"{name}: the experts are already sharded ({e.num_local} of {e.num_global} in "
                f"layer {sharded[0]}); the self-check compares each layer with its own forward, "
                "which needs all experts: pass the full model (the adapter shards it after the "
                "check) or self_check=False"
            )
        return _MoELayers(moe_layers, num_experts.pop(), sharded)


def _dispatchers(
    plans: Iterable[LayerPlan], num_experts: int, ep_group: dist.ProcessGroup | None
) -> dict[int, TokenDispatcher]:
    """One dispatcher per top-k of the MoE layers."""
    found: dict[int, TokenDispatcher] = {}
    for plan in plans:
        k = plan.split.experts.top_k if plan.split is not None else None
        if k is not None and k not in found:
            found[k] = TokenDispatcher(num_experts, k, group=ep_group)
    return found


class TransformersMoEAdapter(MegatronHooks):
    """A transformers 5 MoE ``*ForCausalLM`` for :func:`~moe_overlap.combined_1f1b`.

    The adapter holds no weights: it reads and trains ``model``'s own parameters, so the
    optimizer takes ``model.parameters()`` and checkpoints stay in transformers' format.
    Everything the model computes outside its decoder layers (embedding scaling, masks,
    rotary tables of any form, final norm, LM head, logit scaling, loss) is the model's own
    ``forward``, run with the layers stood in for; inside a MoE layer every module called
    is the layer's own (see :mod:`moe_overlap.adapters.transformers`).

    Args:
        model: the causal LM.
        ep_group: expert-parallel group; ``None`` keeps every expert local. A model holding
            all experts is sharded in place (:func:`shard_experts`) after the self-check.
        delay_wgrad_compute: delay the weight gradients of the layers' ``nn.Linear`` s
            (swapped in place for delayable linears sharing their parameters and
            ``state_dict`` keys) and of the routed experts to the schedule's ``backward_dw``.
        router_aux_loss: add transformers' load-balancing loss times
            ``config.router_aux_loss_coef``; ``None`` follows ``config.output_router_logits``
            as the model's own ``forward`` does (which loss it adds, if any, is found by
            running it on a probe: none is followed, another one is refused).
        self_check: compare the adapter's split of each distinct layer structure with the
            layer's own ``forward`` on a float32 probe (outputs and gradients) and refuse a
            mismatch with :class:`~moe_overlap.ConfigError`. On by default; ``False`` takes
            the likeliest split unverified (see :attr:`self_check_report`).
        recompute: parts of every layer recomputed in backward instead of stored, through
            ``torch.utils.checkpoint`` (:func:`~moe_overlap.blocks.recompute_module`):
            ``"attention"`` (the layer's attention module, selectively: its matrix products
            kept) and ``"norm"`` (the norms around attention and MLP). Applied to the
            model's own modules, so its own ``forward`` recomputes them too.

    Raises :class:`~moe_overlap.ConfigError` at construction for a model it cannot train
    exactly, naming the member and the reason.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        ep_group: dist.ProcessGroup | None = None,
        delay_wgrad_compute: bool = False,
        router_aux_loss: bool | None = None,
        self_check: bool = True,
        recompute: Iterable[str] = (),
    ) -> None:
        parts = _check_arguments(
            model, ep_group, delay_wgrad_compute, router_aux_loss, self_check, recompute
        )
        self.model = model
        self.base = base_model(model)
        self._layer_list = decoder_layers(self.base)
        self.hf_config = _hf_config(model)
        self.config = AdapterConfig(delay_wgrad_compute=delay_wgrad_compute)
        self._built_on: BuiltOn | None = None  # what it was built on, once built
        self.hidden_size = self._int("hidden_size")
        self._built_layers = tuple(self._layer_list)
        # Wrappers, compile and hooks the slots would skip, before anything runs the layers.
        self._bypassed = bypassed(model, self.base, self._built_layers)
        _check_bypassed(self._bypassed.all())
        experts = _MoELayers.of(model, self._built_layers, self_check=self_check)
        _refuse_mixers(self.hf_config, len(self._built_layers))
        self.self_check_report = SelfCheck(enabled=self_check)
        self._accepts_router_flag = (
            "output_router_logits" in inspect.signature(type(model).forward).parameters
        )
        plans = self._probe(delay=delay_wgrad_compute)
        self._dispatchers = _dispatchers(plans, experts.count, ep_group)
        first = plans[experts.layers[0]].split
        assert first is not None
        self.dispatcher = self._dispatchers[first.experts.top_k]
        """The first MoE layer's dispatcher (layers with another top-k have their own)."""
        router_logits = router_logits_source(self.base)
        self.aux = self._aux_loss(
            router_aux_loss, experts.count, recorded=router_logits is not None
        )
        # Every refusal above; only now is the model changed (a refused model stays whole).
        self._shard(experts, ep_group)
        self._calls: dict[int, tuple[LayerCall, ...]] = {}
        self._tied = TiedGradients(model, tied_embeddings(model))
        self.decoder = AdapterDecoder(self._adapt(plans, router_logits))
        self._recompute(parts)
        self._label_delayed_modules()
        # (The layers themselves: check_layers_unchanged, at every plan build.)
        layers = [(str(i), layer) for i, layer in enumerate(self._built_layers)]
        self._built_on = BuiltOn(
            "TransformersMoEAdapter",
            layers,
            self._watched(),
            held=self._held(),
            settings=self._settings(router_aux_loss),
        )

    def _watched(self) -> Iterator[tuple[str, nn.Module]]:
        """The modules whose children the slots call: every decoder layer and its MoE
        block (router and experts); every module holding a linear swapped for a
        :class:`DelayedLinear` (the adapter's wgrad groups hold it)."""
        for i, layer in enumerate(self._built_layers):
            yield f"layers[{i}]", layer
            found = block_of(layer)
            if found is not None:
                yield f"layers[{i}].{found[0]}", found[1]
            for name, module in cast("Iterator[tuple[str, nn.Module]]", layer.named_modules()):
                if name and any(isinstance(c, DelayedLinear) for c in module.children()):
                    yield f"layers[{i}].{name}", module

    def _held(self) -> Iterator[tuple[str, nn.Module]]:
        """The experts modules whose weights a MoE layer holds by reference (delayed
        weight gradients, prescaled experts: :class:`~._hf_experts.ExpertWeights`)."""
        for layer in self.decoder.layers:
            if isinstance(layer, HFMoELayer) and layer.weights is not None:
                yield f"layers[{layer.index}].{layer.split.block}.experts", layer.experts_module

    def _settings(self, router_aux_loss: bool | None) -> list[tuple[str, object, str, str]]:
        """What the adapter read once and the model's own ``forward`` reads at every call:
        whether it adds the router aux loss, and with which coefficient and top-k."""
        found: list[tuple[str, object, str, str]] = []
        if router_aux_loss is None:
            why = "the adapter adds the router aux loss as the model did then"
            found.append(
                ("config.output_router_logits", self.hf_config, "output_router_logits", why)
            )
        if self.aux is not None:  # the model's own copies where it has them, else the config's
            why = "the adapter's router aux loss uses it"
            for attr in ("router_aux_loss_coef", "num_experts", "num_experts_per_tok"):
                owner = self.model if hasattr(self.model, attr) else self.hf_config
                where = "" if owner is self.model else "config."
                found.append((f"{where}{attr}", owner, attr, why))
        return found

    # --- construction --------------------------------------------------------------------
    def _int(self, key: str) -> int:
        value: object = getattr(self.hf_config, key, None)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(
                f"{type(self.hf_config).__name__}.{key}: expected an int, received {value!r}"
            )
        return value

    def _probe(self, *, delay: bool) -> list[LayerPlan]:
        """Each layer's plan, found on probes of the model's own code (its layers' arguments
        first: what the model's forward hands its layers is checked there); the modules
        drawing random numbers in training mode (refused while in it, here and at every
        plan build) and the modules outside the layers its forward calls more than once."""
        model, layers = self.model, self._built_layers
        name = type(model).__name__
        try:
            p0 = next(model.parameters())
            probe = probe_calls(self.base, self.hidden_size, p0.dtype, p0.device)
            self._random: list[RandomModule] = outside_draws(
                model,
                self.base,
                layers,
                probe_ids(self.hf_config, p0.device),
                accepts_router_flag=self._accepts_router_flag,
            )
            plans, random = plan_layers(
                model,
                layers,
                probe,
                config=self.config,
                hidden_size=self.hidden_size,
                delay=delay,
                report=self.self_check_report,
            )
            self._random += random
            repeated = repeated_outside(
                model, self.base, accepts_router_flag=self._accepts_router_flag
            )
        except ConfigError:
            raise
        except Exception as exc:  # the model's own code, run as the adapter runs it
            raise ConfigError(
                f"{name}: {failing_module(exc, model)} raised {type(exc).__name__}: {exc}, "
                "when the adapter ran the model's own forward around stand-ins for its decoder "
                "layers (on a probe of two sequences of six tokens); expected it to run as in "
                "the model's own forward"
            ) from exc
        _check_bypassed(repeated)
        self._bypassed = self._bypassed.with_outside(repeated)
        return plans

    def _aux_loss(
        self, router_aux_loss: bool | None, num_experts: int, *, recorded: bool
    ) -> RouterAuxLoss | None:
        """The load-balancing loss the adapter adds. ``None`` follows the model: one when the
        config asks for router logits and the model's forward then adds one (found by
        running it, not read)."""
        want = (
            bool(getattr(self.hf_config, "output_router_logits", False))
            if router_aux_loss is None
            else router_aux_loss
        )
        if not want:
            return None
        return model_aux_loss(
            self.model,
            self._built_layers,
            num_experts=num_experts,
            top_k=aux_top_k(self.model, sorted(self._dispatchers)),
            explicit=router_aux_loss is True,
            recorded=recorded,
            accepts_router_flag=self._accepts_router_flag,
        )

    def _shard(self, experts: _MoELayers, ep_group: dist.ProcessGroup | None) -> None:
        """Shard the experts over ``ep_group`` unless they are already; check the result."""
        if self.dispatcher.ep_size > 1 and not experts.sharded:
            shard_experts(self.model, ep_group)
        local = {experts_of(self._built_layers[i]).num_local for i in experts.layers}
        if local != {self.dispatcher.local_experts}:
            raise ConfigError(
                f"{type(self.model).__name__}: expected {self.dispatcher.local_experts} local "
                f"experts per MoE layer (EP size {self.dispatcher.ep_size}), received "
                f"{sorted(local)}"
            )

    def _adapt(
        self, plans: Sequence[LayerPlan], router_logits: tuple[type[nn.Module], int] | None
    ) -> tuple[HFLayer, ...]:
        """The schedulable layers, as their plans say."""
        delay = self.config.delay_wgrad_compute
        adapted: list[HFLayer] = []
        for i, (layer, plan) in enumerate(zip(self._built_layers, plans, strict=True)):
            if plan.split is None:
                adapted.append(
                    HFDenseLayer(
                        layer,
                        i,
                        self.config,
                        self.layer_call,
                        delay_wgrad=delay,
                        delayable=plan.delayable,
                    )
                )
                continue
            adapted.append(
                HFMoELayer(
                    layer,
                    i,
                    self.config,
                    self.layer_call,
                    split=plan.split,
                    dispatcher=self._dispatchers[plan.split.experts.top_k],
                    delay_wgrad=delay,
                    hidden_size=self.hidden_size,
                    aux=self.aux,
                    router_logits=router_logits if self.aux is not None else None,
                    delayable=plan.delayable,
                )
            )
        return tuple(adapted)

    def _random_hint(self) -> str:
        return config_hint(self.hf_config)

    def _recompute(self, parts: frozenset[str]) -> None:
        """Recompute the named parts of every layer (the MoE splits name the children; a
        dense layer's children of the same names are its own attention and norms)."""
        if not parts:
            return
        attn: set[str] = set()
        norms: set[str] = set()
        for layer in self.decoder.layers:
            if isinstance(layer, HFMoELayer):
                s = layer.split
                attn.add(s.attn)
                norms.update(
                    n for n in (s.in_norm, s.attn_out_norm, s.pre_mlp_norm, s.mlp_out_norm) if n
                )
                if s.block_out_norm is not None:
                    norms.add(f"{s.block}.{s.block_out_norm}")
        for layer in self.decoder.layers:
            owned = dict(cast("Iterator[tuple[str, nn.Module]]", layer.layer.named_modules()))
            if "attention" in parts:
                for n in sorted(attn & owned.keys()):
                    recompute_module(owned[n], selective=True)
            if "norm" in parts:
                for n in sorted(norms & owned.keys()):
                    recompute_module(owned[n])

    def _label_delayed_modules(self) -> None:
        """Name each delayed module after its place in the model, for error messages."""
        named = cast("Iterator[tuple[str, nn.Module]]", self.model.named_modules())
        names = {id(m): n for n, m in named}
        for layer in self.decoder.layers:
            for module in layer.delayed_modules():
                if id(module) in names:
                    module.label = names[id(module)]
            if isinstance(layer, HFMoELayer) and layer.weights is not None:
                experts = names[id(layer.experts_module)]
                layer.weights.gate_up.label = f"{experts}.gate_up_proj"
                layer.weights.down.label = f"{experts}.down_proj"

    # --- the layers' arguments, per microbatch -------------------------------------------
    def layer_call(self, chunk_state: ChunkState, index: int) -> LayerCall:
        """What the model passes layer ``index`` for this microbatch (computed once per chunk)."""
        key = id(chunk_state)
        calls = self._calls.get(key)
        if calls is None:
            x = chunk_state.decoder_input
            if x is None:
                raise IntegrationError(
                    f"{type(self.model).__name__} adapter: expected the chunk's decoder_input "
                    "(from _preprocess), received None"
                )
            with torch.no_grad():
                calls = layer_calls(
                    self.base,
                    inputs_embeds=x.detach(),
                    attention_mask=chunk_state.attention_mask,
                    position_ids=chunk_state.position_ids,
                )
            self._calls[key] = calls
            weakref.finalize(chunk_state, self._calls.pop, key, None)
        return calls[index]

    # --- public helpers -------------------------------------------------------------------
    microbatch_inputs = frozenset({"position_ids", "attention_mask", "labels"})
    """What the adapter reads (:class:`~moe_overlap.inputs.DeclaresInputs`): the arguments of the
    model's own ``forward`` it reproduces. ``attention_mask`` is transformers' (``[B, S]``,
    ``1`` at tokens to attend, or what the model's ``forward`` takes), not Megatron-Core's;
    ``loss_mask`` and ``padding_mask`` are refused: set ignored labels to ``-100``, and
    mask padding with ``attention_mask``."""

    def bypassed_modules(self) -> Iterator[BypassedModule]:
        """The transformers modules whose ``forward`` the slots skip or split (checked at
        every plan build: wrappers, ``compile`` and hooks on them are refused)."""
        return self.bypassed_in(range(len(self._built_layers)))

    def bypassed_in(self, layers: range) -> Iterator[BypassedModule]:
        """:meth:`bypassed_modules` of the causal LM, its decoder stack and ``layers``.

        Also refuses, at every plan build, a module that draws random numbers in training
        mode while it is in training mode (:mod:`._hf_random`)."""
        check_quiet(self._random, self._random_hint)
        yield from check_layers_unchanged(self.model, self._layer_list, self._built_layers, layers)
        if self._built_on is not None:  # a changed layer is refused (not while building)
            cls = type(self.model).__name__
            self._built_on.check_children(cls)
            self._built_on.check_settings(cls)
            self._tied.follow(self.model)
        yield from self._bypassed.outside
        for i in layers:
            yield from self._bypassed.layers[i]

    @property
    def pre_process(self) -> bool:
        return True

    @property
    def post_process(self) -> bool:
        return True

    def parameters(self) -> Iterator[nn.Parameter]:
        """The model's parameters (what the optimizer takes)."""
        return self.model.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The model's parameters with their names in the model."""
        return self.model.named_parameters()

    def forward(
        self,
        input_ids: Tensor,
        *,
        position_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        labels: Tensor | None = None,
    ) -> Tensor:
        """The plain path: the adapter's layers without a schedule (each one's
        ``run_plain``, as the self-check compared it with the layer's own forward) between
        the model's own embedding and head; the loss with ``labels``, else the logits.

        Everything after ``input_ids`` is keyword-only: transformers' models take
        ``(input_ids, attention_mask, position_ids)`` in that order, so a positional call
        in their order would silently swap the mask and the positions.

        Bit-identical to :func:`~moe_overlap.combined_1f1b` (the same operations); debug
        mode's first-step check compares the two.
        """
        return self.plain_forward(
            input_ids, position_ids, labels=labels, attention_mask=attention_mask
        )

    def expert_parameters(self) -> list[nn.Parameter]:
        """The routed experts' weights: sharded under EP, so not averaged like the rest."""
        named = dict(self.model.named_parameters())
        return [named[n] for n in expert_parameter_names(self.model)]

    @property
    def pending_wgrad(self) -> int:
        """How many delayed weight gradients wait for ``backward_dw`` (0 after a schedule;
        a :class:`~moe_overlap.PendingWgrad`)."""
        return sum(layer.pending_wgrad for layer in self.decoder.layers)

    def discard_wgrad(self) -> None:
        """Drop every pending delayed weight gradient.

        After a failed :func:`~moe_overlap.combined_1f1b` step (zero the gradients too):
        the next step's ``_preprocess`` refuses to start while any is pending.
        """
        for layer in self.decoder.layers:
            layer.discard_wgrad()

    # --- MegatronHooks: what _preprocess / _postprocess are built on ----------------------
    def embed(self, input_ids: Tensor) -> Tensor:
        """The first layer's input as the model's own ``forward`` computes it."""
        return self.embed_at(input_ids, None)

    def embed_at(self, input_ids: Tensor, position_ids: Tensor | None) -> Tensor:
        """The first layer's input for these positions, by the model's own ``forward``
        (tied embeddings: their gradient summed with the head's, :mod:`._hf_tied`)."""
        with self._tied.embedding() as result:
            result.append(decoder_input(self.base, input_ids=input_ids, position_ids=position_ids))
        return result[0]

    def on_microbatch(self, decoder_input: Tensor) -> None:
        """Refuse pending weight gradients; open the aux-loss microbatch."""
        pending = {
            k: n
            for layer in self.decoder.layers
            for k, n in layer.pending_wgrad_by_module().items()
        }
        if pending:
            raise WgradError(
                f"{type(self.model).__name__} adapter: expected no pending weight gradients "
                f"at the start of a microbatch (use schedule_options(); after a failed step, "
                f"discard_wgrad()), received {pending}"
            )
        if self.aux is not None:
            self.aux.begin(decoder_input.device)

    def output(
        self, hidden_states: Tensor, labels: Tensor | None, loss_mask: Tensor | None
    ) -> Tensor:
        """The model's own final norm, head and loss (+ the router aux loss); logits without labels."""
        aux = self.aux.finish() if self.aux is not None else None
        if loss_mask is not None:
            raise ConfigError(
                "TransformersMoEAdapter: transformers models take no loss_mask; expected None "
                "(set ignored label positions to -100), received a tensor"
            )
        with self._tied.head():
            out = causal_lm_output(
                self.model,
                self.base,
                hidden_states,
                labels=labels,
                accepts_router_flag=self._accepts_router_flag,
            )
        if labels is None or aux is None:
            return out
        assert self.aux is not None
        return out + self.aux.coef * aux.to(out.device)
