"""A transformers MoE causal LM as a :class:`~moe_overlap.PreprocessableModel`.

Legend: ``B`` batch, ``S`` sequence, ``D`` hidden.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe_overlap import ConfigError, CudaGraphModule, IntegrationError, WgradError
from moe_overlap.adapters._hf_aux import RouterAuxLoss
from moe_overlap.adapters._hf_bypass import bypassed, check_layers_unchanged, repeated_outside
from moe_overlap.adapters._hf_calls import (
    LayerCall,
    base_model,
    causal_lm_output,
    decoder_input,
    decoder_layers,
    layer_calls,
    router_flag,
    swap_child,
)
from moe_overlap.adapters._hf_ep import expert_parameter_names, experts_of, shard_experts
from moe_overlap.adapters._hf_layers import HFDenseLayer, HFLayer, HFMoELayer
from moe_overlap.adapters._hf_probe import (
    Mismatch,
    compare_layer,
    float32_call,
    float32_copy,
    structure_key,
)
from moe_overlap.adapters._hf_random import (
    Draws,
    RandomModule,
    check_quiet,
    config_hint,
    draws_matter,
    record_draws,
    training_mode,
)
from moe_overlap.adapters._hf_structure import (
    ExpertsStandIn,
    LayerTrace,
    MoESplit,
    block_of,
    candidate_splits,
    measure_block,
    trace_layer,
)
from moe_overlap.blocks import MegatronHooks, TokenDispatcher, recompute_module
from moe_overlap.blocks._recompute import check_recompute
from moe_overlap.engine._args import (
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
from moe_overlap.engine._bypass_check import BypassedModule, check_module
from moe_overlap.engine._state import ChunkState

__all__ = ["AdapterConfig", "AdapterDecoder", "SelfCheck", "TransformersMoEAdapter"]

_PROBE_TOKENS = 6
_NOT_SOFTMAX = ("linear", "mamba", "conv", "delta", "ssm", "recurrent")


@dataclass(frozen=True, slots=True)
class LayerPlan:
    """How one decoder layer is scheduled: dense (``split`` None) or split; which linears
    may delay their weight gradient (called once in the traced forward)."""

    split: MoESplit | None
    delayable: frozenset[str]
    quiet: frozenset[str] = frozenset()
    """Modules (by name in the layer) that draw random numbers in training mode: kept in
    eval mode by the probe, refused in training mode (:mod:`._hf_random`)."""

    def describe(self) -> str:
        return "dense" if self.split is None else self.split.describe()


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


@dataclass(slots=True)
class SelfCheck:
    """What the construction-time self-check did: per structure, the split kept."""

    enabled: bool
    seconds: float = 0.0
    structures: list[tuple[str, list[int], str]] = field(
        default_factory=list[tuple[str, list[int], str]]
    )
    """``(layer class, layer indices, split kept)``: ``dense`` or a :class:`MoESplit` description."""


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


def _router_logits(base: nn.Module) -> tuple[type[nn.Module], int] | None:
    """transformers' own record of where router logits come from (module class, index)."""
    records: object = getattr(type(base), "_can_record_outputs", None)
    if not isinstance(records, dict):
        return None
    entry: object = cast("dict[str, object]", records).get("router_logits")
    target: object = getattr(entry, "target_class", None)
    if isinstance(target, type) and issubclass(target, nn.Module):
        index: object = getattr(entry, "index", 0)
        return target, index if isinstance(index, int) else 0
    return None


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if name else prefix


def failing_module(exc: BaseException, root: nn.Module) -> str:
    """Where ``exc`` was raised: the innermost module of ``root`` (by its path) whose code
    is on the traceback, for messages."""
    names = {id(m): n for n, m in cast("Iterator[tuple[str, nn.Module]]", root.named_modules())}
    cls = type(root).__name__
    found = cls
    tb = exc.__traceback__
    while tb is not None:
        obj: object = tb.tb_frame.f_locals.get("self")
        if isinstance(obj, nn.Module) and id(obj) in names:
            path = names[id(obj)]
            found = f"{cls}.{path} ({type(obj).__name__})" if path else cls
        tb = tb.tb_next
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
        self.model = model
        self.base = base_model(model)
        layer_list = decoder_layers(self.base)
        hf_config: object = getattr(model, "config", None)
        if hf_config is None:
            raise ConfigError(f"{name}.config: expected a transformers config, received None")
        self.hf_config = hf_config
        self.config = AdapterConfig(delay_wgrad_compute=delay_wgrad_compute)
        hidden_size = self._int("hidden_size")
        self.hidden_size = hidden_size
        layers = list(layer_list)
        # Wrappers, compile and hooks the slots would skip, before anything runs the layers.
        self._bypassed = bypassed(model, self.base, layers)
        for item in self._bypassed.all():
            check_module(item.module, item.name, item.reason, item.bypass)
        self._layer_list = layer_list
        self._built_layers = tuple(layers)
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
        _refuse_mixers(hf_config, len(layers))
        self.self_check_report = SelfCheck(enabled=self_check)
        self._accepts_router_flag = (
            "output_router_logits" in inspect.signature(type(model).forward).parameters
        )
        # Modules drawing random numbers in training mode: refused while in it (here and
        # at every plan build), accepted in eval mode.
        self._random: list[RandomModule] = []
        try:
            # The layers' arguments first: what the model's forward hands its layers is
            # checked there (hidden states of the embeddings' shape, nothing else).
            p0 = next(model.parameters())
            probe = self._probe_calls(p0.dtype, p0.device)
            self._random += self._outside_draws(layers)
            plans = self._plan(layers, probe, delay=delay_wgrad_compute, self_check=self_check)
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
        for item in repeated:
            check_module(item.module, item.name, item.reason, item.bypass)
        self._bypassed = self._bypassed.with_outside(repeated)
        count = num_experts.pop()
        self._dispatchers: dict[int, TokenDispatcher] = {}
        for plan in plans:
            k = plan.split.experts.top_k if plan.split is not None else None
            if k is not None and k not in self._dispatchers:
                self._dispatchers[k] = TokenDispatcher(count, k, group=ep_group)
        first = plans[moe_layers[0]].split
        assert first is not None
        self.dispatcher = self._dispatchers[first.experts.top_k]
        """The first MoE layer's dispatcher (layers with another top-k have their own)."""
        # None follows the model: a load-balancing loss when the config asks for router
        # logits and the model's forward then adds one (found by running it, not read).
        want_aux = (
            bool(getattr(hf_config, "output_router_logits", False))
            if router_aux_loss is None
            else router_aux_loss
        )
        router_logits = _router_logits(self.base)
        self.aux: RouterAuxLoss | None = None
        if want_aux:
            top_ks = sorted(self._dispatchers)
            self.aux = self._model_aux(
                count,
                self._aux_top_k(top_ks),
                explicit=router_aux_loss is True,
                recorded=router_logits is not None,
            )
        # Every refusal above; only now is the model changed (a refused model stays whole).
        if self.dispatcher.ep_size > 1 and not sharded:
            shard_experts(model, ep_group)
        local = {experts_of(layers[i]).num_local for i in moe_layers}
        if local != {self.dispatcher.local_experts}:
            raise ConfigError(
                f"{name}: expected {self.dispatcher.local_experts} local experts per MoE layer "
                f"(EP size {self.dispatcher.ep_size}), received {sorted(local)}"
            )
        self._calls: dict[int, tuple[LayerCall, ...]] = {}
        adapted: list[HFLayer] = []
        for i, layer in enumerate(layers):
            plan = plans[i]
            if plan.split is None:
                adapted.append(
                    HFDenseLayer(
                        layer,
                        i,
                        self.config,
                        self.layer_call,
                        delay_wgrad=delay_wgrad_compute,
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
                    delay_wgrad=delay_wgrad_compute,
                    hidden_size=hidden_size,
                    aux=self.aux,
                    router_logits=router_logits if self.aux is not None else None,
                    delayable=plan.delayable,
                )
            )
        self.decoder = AdapterDecoder(tuple(adapted))
        self._recompute(parts)
        self._label_delayed_modules()

    # --- construction --------------------------------------------------------------------
    def _int(self, key: str) -> int:
        value: object = getattr(self.hf_config, key, None)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(
                f"{type(self.hf_config).__name__}.{key}: expected an int, received {value!r}"
            )
        return value

    def _config_top_k(self, index: int) -> int | None:
        """The router's top-k the config gives layer ``index``: one int for every layer, or
        a list with one per layer (HunYuan's ``moe_topk``); ``None`` when it gives none."""
        cfg = self.hf_config
        for key in ("num_experts_per_tok", "moe_topk", "top_k", "num_experts_per_token"):
            value: object = getattr(cfg, key, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
            if isinstance(value, (list, tuple)):
                items = list(cast("Sequence[object]", value))
                item = items[index] if index < len(items) else None
                if not isinstance(item, int) or isinstance(item, bool) or item <= 0:
                    raise ConfigError(
                        f"{type(cfg).__name__}.{key}: expected a positive int, or one per "
                        f"layer, received {value!r} (layer {index}: {item!r})"
                    )
                return item
        return None

    def _aux_top_k(self, top_ks: Sequence[int]) -> int:
        """The top-k of transformers' load-balancing loss: the config's, or the layers' one."""
        value: object = getattr(self.hf_config, "num_experts_per_tok", None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
        if len(top_ks) != 1:
            raise ConfigError(
                f"{type(self.model).__name__}: router_aux_loss: transformers' "
                "load_balancing_loss_func takes one top-k for every layer; expected one, "
                f"received per-layer top-k {list(top_ks)} (pass router_aux_loss=False to "
                "train without it)"
            )
        return top_ks[0]

    def _probe_ids(self, device: torch.device) -> Tensor:
        vocab: object = getattr(self.hf_config, "vocab_size", None)
        high = vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else 2
        g = torch.Generator().manual_seed(0)
        return torch.randint(0, max(2, min(high, 100)), (2, _PROBE_TOKENS), generator=g).to(device)

    def _outside_draws(self, layers: list[nn.Module]) -> list[RandomModule]:
        """The modules outside the decoder layers whose forward draws random numbers that
        change its output in training mode (embedding dropout, ...): found on a probe of
        the model's own forward with the layers stood in for, those modules put in training
        mode for it (their flags restored after)."""
        model, base = self.model, self.base
        inside = {id(m) for layer in layers for m in layer.modules()}
        outside = [m for m in model.modules() if id(m) not in inside]
        p0 = next(model.parameters())
        ids = self._probe_ids(p0.device)
        name = type(model).__name__

        def run(quiet: Sequence[str]) -> list[str]:
            with torch.no_grad(), training_mode(outside):
                for n in quiet:
                    model.get_submodule(n).training = False
                with record_draws(model, p0.device, skip=layers) as draws:
                    hidden = decoder_input(base, input_ids=ids, position_ids=None)
                    causal_lm_output(
                        model,
                        base,
                        hidden,
                        labels=ids,
                        attention_mask=None,
                        position_ids=None,
                        accepts_router_flag=self._accepts_router_flag,
                    )
                return self._random_of(draws, p0.device)

        drawn = run(())
        if not drawn:
            return []
        found = [RandomModule(_join(name, n), model.get_submodule(n)) for n in drawn]
        check_quiet(found, self._random_hint)
        self._refuse_eval_draws(
            [RandomModule(_join(name, n), model.get_submodule(n)) for n in run(drawn)]
        )
        return found

    def _random_of(self, draws: Draws, device: torch.device) -> list[str]:
        """The modules that drew whose output depends on the draws (all that drew, when
        the config sets a non-zero dropout or jitter probability)."""
        if not draws.names:
            return []
        if config_hint(self.hf_config):
            return list(draws.names)
        return [n for n in draws.names if draws_matter(draws, n, device)]

    def _path(self, module: nn.Module) -> str:
        """``module``'s qualified name in the model."""
        named = cast("Iterator[tuple[str, nn.Module]]", self.model.named_modules())
        return next(n for n, m in named if m is module)

    def _random_hint(self) -> str:
        return config_hint(self.hf_config)

    def _refuse_eval_draws(self, found: Sequence[RandomModule]) -> None:
        if found:
            item = found[0]
            raise ConfigError(
                f"{item.name} ({type(item.module).__name__}): its forward draws random "
                "numbers in eval mode too (sampled "
                "routing, noise not tied to training mode), which the schedule cannot "
                "reproduce; expected a forward that draws none, at least in eval mode, "
                f"received draws{self._random_hint()}"
            )

    def _probe_calls(
        self, dtype: torch.dtype, device: torch.device
    ) -> tuple[Tensor, tuple[LayerCall, ...]]:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(2, _PROBE_TOKENS, self.hidden_size, generator=g)
        # With grad, from embeddings that require it: a layer argument computed from
        # parameters or from the embeddings would tie the layers into one graph (refused).
        embeds = x.to(dtype=dtype, device=device, copy=True).requires_grad_()
        with torch.enable_grad():
            calls = layer_calls(
                self.base, inputs_embeds=embeds, attention_mask=None, position_ids=None
            )
        return x, calls

    def _plan(
        self,
        layers: list[nn.Module],
        probe: tuple[Tensor, tuple[LayerCall, ...]],
        *,
        delay: bool,
        self_check: bool,
    ) -> list[LayerPlan]:
        start = time.perf_counter()
        p0 = next(self.model.parameters())
        x, calls = probe
        multiplier: object = getattr(self.hf_config, "residual_multiplier", None)
        mult = (
            float(multiplier)
            if isinstance(multiplier, (int, float)) and not isinstance(multiplier, bool)
            else None
        )
        plans: list[LayerPlan] = []
        seen: dict[tuple[object, ...], tuple[LayerPlan, list[int]]] = {}
        model_name = type(self.model).__name__
        names = {
            id(m): n for n, m in cast("Iterator[tuple[str, nn.Module]]", self.model.named_modules())
        }
        for i, layer in enumerate(layers):
            key = structure_key(layer, calls[i])
            if key in seen:
                plan, where = seen[key]
                where.append(i)
                plans.append(plan)
            else:
                plan = self._plan_one(
                    layer,
                    i,
                    x.to(p0.device),
                    float32_call(calls[i]),
                    top_k=self._config_top_k(i),
                    mult=mult,
                    delay=delay,
                    self_check=self_check,
                )
                seen[key] = (plan, [i])
                plans.append(plan)
            prefix = f"{model_name}.{names[id(layer)]}"
            self._random += [
                RandomModule(_join(prefix, n), layer.get_submodule(n)) for n in sorted(plan.quiet)
            ]
        for plan, where in seen.values():
            self.self_check_report.structures.append(
                (type(layers[where[0]]).__name__, where, plan.describe())
            )
        self.self_check_report.seconds = time.perf_counter() - start
        return plans

    def _trace(
        self, layer: nn.Module, x: Tensor, call: LayerCall, where: str, quiet: frozenset[str]
    ) -> tuple[nn.Module, Tensor, LayerTrace, list[str]]:
        """A float32 copy of ``layer`` run on the probe, its trace, and the modules whose
        forward drew random numbers (the routed experts' too: run once on what they got)."""
        traced = float32_copy(layer, immediate=True, quiet=quiet)
        with record_draws(traced, x.device) as draws:
            try:
                with torch.enable_grad():
                    out, trace = trace_layer(traced, x.clone().requires_grad_(), call)
                found = block_of(layer)
                experts = experts_of(layer) if found is not None else None
                if trace.experts_calls and experts and experts.num_local == experts.num_global:
                    ec = trace.experts_calls[0]  # (sharded experts take only local indices)
                    with torch.no_grad():
                        ec.module(*ec.args, **ec.kwargs)
            except ConfigError:
                raise
            except Exception as exc:
                raise ConfigError(
                    f"{where}: {failing_module(exc, traced)} raised {type(exc).__name__}: "
                    f"{exc}, when the adapter ran the layer's own forward on a probe (hidden "
                    f"states {list(x.shape)} = [batch, sequence, hidden_size] and the "
                    "arguments the model's forward passes it); expected it to run as in the "
                    "model's own forward"
                ) from exc
        return traced, out, trace, self._random_of(draws, x.device)

    def _plan_one(
        self,
        layer: nn.Module,
        index: int,
        x: Tensor,
        call: LayerCall,
        *,
        top_k: int | None,
        mult: float | None,
        delay: bool,
        self_check: bool,
    ) -> LayerPlan:
        where = f"{type(layer).__name__} (layer {index})"
        calls: Callable[[ChunkState, int], LayerCall] = lambda cs, i: call  # noqa: E731
        traced, out, trace, drawn = self._trace(layer, x, call, where, frozenset())
        quiet = frozenset(drawn)
        if quiet:
            # Accepted only in eval mode (checked again at every plan build), and then only
            # if it draws nothing there: traced again so.
            prefix = f"{type(self.model).__name__}.{self._path(layer)}"
            check_quiet(
                [RandomModule(_join(prefix, n), layer.get_submodule(n)) for n in sorted(quiet)],
                self._random_hint,
            )
            traced, out, trace, again = self._trace(layer, x, call, where, quiet)
            self._refuse_eval_draws(
                [RandomModule(_join(prefix, n), layer.get_submodule(n)) for n in again]
            )
        # A linear may delay its weight gradient if the forward calls it once and its weight
        # gets a gradient at all (an indexer's projection, say, gets none).
        torch.autograd.backward(out.sum())
        delayable = frozenset(
            n
            for n in trace.delayable()
            if traced.get_submodule(n).get_parameter("weight").grad is not None
        )
        if block_of(layer) is None:
            if self_check and delay:
                ref = float32_copy(layer, immediate=True, quiet=quiet)
                cand = float32_copy(layer, quiet=quiet)
                dense = HFDenseLayer(
                    cand, index, self.config, calls, delay_wgrad=True, delayable=delayable
                )
                mismatch = compare_layer(
                    ref, dense.run_plain, cand, lambda: _finish(dense), x, call, seed=index
                )
                if mismatch is not None:
                    raise ConfigError(
                        f"{where}: with delayed weight gradients the layer no longer computes "
                        f"its own forward: {mismatch}"
                    )
            return LayerPlan(None, delayable, quiet)
        splits = candidate_splits(traced, trace, top_k=top_k, multiplier=mult)
        measured = measure_block(traced.get_submodule(splits[0].block), trace, splits[0], where)
        splits = [
            dataclasses.replace(
                s, experts_scale=measured.experts_scale, block_adds=measured.block_adds
            )
            for s in splits
        ]
        if not self_check:
            return LayerPlan(splits[0], delayable, quiet)
        best: tuple[Mismatch, MoESplit] | None = None
        failure: Exception | None = None
        experts = experts_of(layer).num_global
        for split in splits:
            ref = float32_copy(layer, immediate=True, quiet=quiet)
            cand = float32_copy(layer, quiet=quiet)
            adapted = HFMoELayer(
                cand,
                index,
                self.config,
                calls,
                split=split,
                dispatcher=TokenDispatcher(experts, split.experts.top_k),
                delay_wgrad=delay,
                hidden_size=self.hidden_size,
                aux=None,
                router_logits=None,
                delayable=delayable,
            )
            try:
                mismatch = compare_layer(
                    ref, adapted.run_plain, cand, partial(_finish, adapted), x, call, seed=index
                )
            except Exception as exc:
                failure = failure or exc
                mismatch = Mismatch(
                    f"the split's run ({failing_module(exc, cand)} raised "
                    f"{type(exc).__name__}: {exc})",
                    float("inf"),
                )
            if mismatch is None:
                return LayerPlan(split, delayable, quiet)
            if best is None or mismatch.difference < best[0].difference:
                best = (mismatch, split)
        assert best is not None
        raise ConfigError(
            f"{where}: the adapter's split of this layer does not reproduce its forward on the "
            f"float32 probe: {best[0]} (closest split tried: {best[1].describe()}; "
            f"{len(splits)} tried)"
        ) from failure

    def _model_aux(
        self, num_experts: int, top_k: int, *, explicit: bool, recorded: bool
    ) -> RouterAuxLoss | None:
        """The load-balancing loss the model's own ``forward`` adds, if it is transformers'
        standard one; ``None`` when it adds none (refused if ``explicit``ly asked for).

        Found by running the forward (its routed experts stood in for: the loss depends on
        the router logits only) on a padded probe with ``output_router_logits`` on and off:
        the loss it adds is compared with ``load_balancing_loss_func`` on the router logits
        it returns, times ``router_aux_loss_coef``. Never read off its source.
        """
        model, cfg = self.model, self.hf_config
        name = type(model).__name__
        standard = "the adapter adds transformers' standard load_balancing_loss_func"
        advice = "pass router_aux_loss=False to train without it"
        coef_value: object = getattr(cfg, "router_aux_loss_coef", 0.0)
        coef = (
            float(coef_value)
            if isinstance(coef_value, (int, float)) and not isinstance(coef_value, bool)
            else 0.0
        )
        p0 = next(model.parameters())
        ids = self._probe_ids(p0.device)
        mask = torch.ones_like(ids)
        mask[0, :2] = 0
        labels = ids.masked_fill(mask == 0, -100)
        runs: dict[bool, object] = {}
        try:
            with torch.no_grad(), contextlib.ExitStack() as stack:
                for layer in self._built_layers:
                    found = block_of(layer)
                    if found is not None:
                        experts = found[1].get_submodule("experts")
                        stack.enter_context(
                            swap_child(found[1], "experts", ExpertsStandIn(experts))
                        )
                for flag in (True, False):
                    with router_flag(cfg, flag, self._accepts_router_flag) as kwargs:
                        runs[flag] = model(
                            input_ids=ids, attention_mask=mask, labels=labels, **kwargs
                        )
        except Exception as exc:
            raise ConfigError(
                f"{name}: router_aux_loss: {standard}, read off the model's own forward with "
                f"output_router_logits=True; that forward (on a probe, its routed experts "
                f"stood in for) raised in {failing_module(exc, model)} "
                f"{type(exc).__name__}: {exc} ({advice})"
            ) from exc
        on, off = runs[True], runs[False]
        loss_on: object = getattr(on, "loss", None)
        loss_off: object = getattr(off, "loss", None)
        aux_on: object = getattr(on, "aux_loss", None)
        logits: object = getattr(on, "router_logits", None)
        if not isinstance(loss_on, Tensor) or not isinstance(loss_off, Tensor):
            raise ConfigError(
                f"{name}.forward: expected a loss for the given labels, received "
                f"{type(loss_on).__name__}"
            )
        added = float(loss_on.double() - loss_off.double())
        if not isinstance(aux_on, Tensor) and added == 0.0:
            if explicit:
                raise ConfigError(
                    f"{name}: router_aux_loss: {standard}; this model's forward computes no "
                    "such loss (with output_router_logits=True it adds nothing to the loss "
                    "and returns no aux_loss); expected router_aux_loss=None (follow the "
                    f"model) or False, received True"
                )
            return None
        items = list(cast("Sequence[object]", logits)) if isinstance(logits, (tuple, list)) else []
        if not recorded or not items or not all(isinstance(t, Tensor) for t in items):
            raise ConfigError(
                f"{name}: router_aux_loss: {standard}; this model's forward adds "
                f"{added:.6g} to the loss but the router logits it is computed from are not "
                f"where transformers records them ({advice})"
            )
        ours = RouterAuxLoss(num_experts=num_experts, top_k=top_k, coef=coef)
        ours.begin(p0.device)
        dtype = torch.float32
        with torch.no_grad():
            for i, t in enumerate(cast("list[Tensor]", items)):
                logits_TE = t.reshape(-1, t.shape[-1])
                dtype = logits_TE.dtype
                weights = torch.zeros(logits_TE.shape[0], top_k, device=logits_TE.device)
                ours.attach(i, weights, logits_TE, mask)
            value = ours.finish()
        std = float(value) if value is not None else 0.0
        rtol = max(1e-4, 16 * torch.finfo(dtype).eps)
        floor = 16 * torch.finfo(torch.float32).eps * abs(float(loss_off))
        problems: list[str] = []
        if isinstance(aux_on, Tensor) and abs(float(aux_on) - std) > rtol * abs(std):
            problems.append(f"its aux_loss is {float(aux_on):.6g}, the standard one {std:.6g}")
        if abs(added - coef * std) > rtol * abs(coef * std) + floor:
            problems.append(
                f"it adds {added:.6g} to the loss, the standard one times "
                f"router_aux_loss_coef={coef:g} is {coef * std:.6g}"
            )
        if problems:
            raise ConfigError(
                f"{name}: router_aux_loss: {standard}; this model's forward computes another "
                f"one ({'; '.join(problems)}, on a padded probe) ({advice})"
            )
        return RouterAuxLoss(num_experts=num_experts, top_k=top_k, coef=coef)

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
    """What the adapter reads (:class:`~moe_overlap.DeclaresInputs`): the arguments of the
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
        position_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        labels: Tensor | None = None,
    ) -> Tensor:
        """The plain path: the adapter's layers without a schedule (each one's
        ``run_plain``, as the self-check compared it with the layer's own forward) between
        the model's own embedding and head; the loss with ``labels``, else the logits.

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
        """The first layer's input for these positions, by the model's own ``forward``."""
        return decoder_input(self.base, input_ids=input_ids, position_ids=position_ids)

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
        out = causal_lm_output(
            self.model,
            self.base,
            hidden_states,
            labels=labels,
            attention_mask=None,
            position_ids=None,
            accepts_router_flag=self._accepts_router_flag,
        )
        if labels is None or aux is None:
            return out
        assert self.aux is not None
        return out + self.aux.coef * aux.to(out.device)


def _finish(layer: HFLayer) -> None:
    """The delayed weight gradients of one backward, as the schedule's wgrad steps run them."""
    for scope in layer.pre_dispatch_wgrad():
        scope.module.backward_dw()
    for part in layer.mlp_wgrad():
        part.backward_dw()
