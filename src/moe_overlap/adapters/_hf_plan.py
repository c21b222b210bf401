"""How each decoder layer of a model is scheduled: traced, split and self-checked on a probe.

Layers of one structure (:func:`~._hf_probe.structure_key`) are planned once. A dense
layer runs whole; a MoE layer's candidate splits (:func:`~._hf_structure.candidate_splits`)
are tried on float32 copies against the layer's own ``forward`` (:mod:`._hf_probe`) and
the first that reproduces it is kept. Modules that draw random numbers are found on the
way (:mod:`._hf_random`).

Legend: ``B`` batch, ``S`` sequence, ``D`` hidden.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import cast

import torch
from torch import Tensor, nn

from moe_overlap import ConfigError
from moe_overlap.adapters._hf_calls import LayerCall, layer_calls
from moe_overlap.adapters._hf_ep import experts_of
from moe_overlap.adapters._hf_layers import HFDenseLayer, HFLayer, HFMoELayer
from moe_overlap.adapters._hf_probe import (
    PROBE_TOKENS,
    Mismatch,
    compare_layer,
    failing_module,
    float32_call,
    float32_copy,
    structure_key,
)
from moe_overlap.adapters._hf_random import (
    RandomModule,
    check_quiet,
    config_hint,
    random_modules,
    random_of,
    record_draws,
    refuse_eval_draws,
)
from moe_overlap.adapters._hf_structure import (
    LayerTrace,
    MoESplit,
    block_of,
    candidate_splits,
    measure_block,
    trace_layer,
)
from moe_overlap.blocks import TokenDispatcher
from moe_overlap.engine import ChunkState, claim_wgrad
from moe_overlap.protocols import FreeInputConfig

__all__ = ["LayerPlan", "Probe", "SelfCheck", "plan_layers", "probe_calls"]


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


@dataclass(slots=True)
class SelfCheck:
    """What the construction-time self-check did: per structure, the split kept."""

    enabled: bool
    seconds: float = 0.0
    structures: list[tuple[str, list[int], str]] = field(
        default_factory=list[tuple[str, list[int], str]]
    )
    """``(layer class, layer indices, split kept)``: ``dense`` or a :class:`MoESplit` description."""


Probe = tuple[Tensor, tuple[LayerCall, ...]]
"""The probe's hidden states ``[B, S, D]`` and the arguments the model passes each layer."""


def probe_calls(
    base: nn.Module, hidden_size: int, dtype: torch.dtype, device: torch.device
) -> Probe:
    """Random hidden states of a private generator and the model's layer arguments for them."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, PROBE_TOKENS, hidden_size, generator=g)
    # With grad, from embeddings that require it: a layer argument computed from
    # parameters or from the embeddings would tie the layers into one graph (refused).
    embeds = x.to(dtype=dtype, device=device, copy=True).requires_grad_()
    with torch.enable_grad():
        calls = layer_calls(base, inputs_embeds=embeds, attention_mask=None, position_ids=None)
    return x, calls


def plan_layers(
    model: nn.Module,
    layers: Sequence[nn.Module],
    probe: Probe,
    *,
    config: FreeInputConfig,
    hidden_size: int,
    delay: bool,
    report: SelfCheck,
) -> tuple[list[LayerPlan], list[RandomModule]]:
    """Each layer's plan, and the layers' modules that draw random numbers in training
    mode; fills ``report`` (whose ``enabled`` says whether to self-check)."""
    planner = _Planner(model, config=config, hidden_size=hidden_size, delay=delay, report=report)
    return planner.plan(layers, probe), planner.random


@contextmanager
def delayed_wgrad(layer: HFLayer) -> Generator[None]:
    """One backward inside, with the layer's listed modules claimed as a schedule claims
    them; after it, their delayed weight gradients, as the schedule's wgrad steps run them."""
    scopes, parts = layer.pre_dispatch_wgrad(), layer.mlp_wgrad()
    with claim_wgrad(*(scope.module for scope in scopes), *parts):
        yield
    for scope in scopes:
        scope.module.backward_dw()
    for part in parts:
        part.backward_dw()


class _Planner:
    """One model's layers planned on a probe; collects their random modules."""

    def __init__(
        self,
        model: nn.Module,
        *,
        config: FreeInputConfig,
        hidden_size: int,
        delay: bool,
        report: SelfCheck,
    ) -> None:
        self.model = model
        self.hf_config: object = getattr(model, "config", None)
        self.config = config
        self.hidden_size = hidden_size
        self.delay = delay
        self.self_check = report.enabled
        self.report = report
        self.random: list[RandomModule] = []
        self.hint = partial(config_hint, self.hf_config)

    def plan(self, layers: Sequence[nn.Module], probe: Probe) -> list[LayerPlan]:
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
                )
                seen[key] = (plan, [i])
                plans.append(plan)
            prefix = f"{model_name}.{names[id(layer)]}"
            self.random += random_modules(prefix, layer, sorted(plan.quiet))
        for plan, where in seen.values():
            self.report.structures.append((type(layers[where[0]]).__name__, where, plan.describe()))
        self.report.seconds = time.perf_counter() - start
        return plans

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
        return traced, out, trace, random_of(draws, x.device, self.hf_config)

    def _plan_one(
        self,
        layer: nn.Module,
        index: int,
        x: Tensor,
        call: LayerCall,
        *,
        top_k: int | None,
        mult: float | None,
    ) -> LayerPlan:
        where = f"{type(layer).__name__} (layer {index})"
        calls: Callable[[ChunkState, int], LayerCall] = lambda cs, i: call  # noqa: E731
        traced, out, trace, drawn = self._trace(layer, x, call, where, frozenset())
        quiet = frozenset(drawn)
        if quiet:
            # Accepted only in eval mode (checked again at every plan build), and then only
            # if it draws nothing there: traced again so.
            prefix = f"{type(self.model).__name__}.{self._path(layer)}"
            check_quiet(random_modules(prefix, layer, sorted(quiet)), self.hint)
            traced, out, trace, again = self._trace(layer, x, call, where, quiet)
            refuse_eval_draws(random_modules(prefix, layer, again), self.hf_config)
        # A linear may delay its weight gradient if the forward calls it once and its weight
        # gets a gradient at all (an indexer's projection, say, gets none).
        torch.autograd.backward(out.sum())
        delayable = frozenset(
            n
            for n in trace.delayable()
            if traced.get_submodule(n).get_parameter("weight").grad is not None
        )
        if block_of(layer) is None:
            if self.self_check and self.delay:
                ref = float32_copy(layer, immediate=True, quiet=quiet)
                cand = float32_copy(layer, quiet=quiet)
                dense = HFDenseLayer(
                    cand, index, self.config, calls, delay_wgrad=True, delayable=delayable
                )
                mismatch = compare_layer(
                    ref, dense.run_plain, cand, partial(delayed_wgrad, dense), x, call, seed=index
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
        if not self.self_check:
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
                delay_wgrad=self.delay,
                hidden_size=self.hidden_size,
                aux=None,
                router_logits=None,
                delayable=delayable,
            )
            try:
                mismatch = compare_layer(
                    ref,
                    adapted.run_plain,
                    cand,
                    partial(delayed_wgrad, adapted),
                    x,
                    call,
                    seed=index,
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

    def _path(self, module: nn.Module) -> str:
        """``module``'s qualified name in the model."""
        named = cast("Iterator[tuple[str, nn.Module]]", self.model.named_modules())
        return next(n for n, m in named if m is module)
