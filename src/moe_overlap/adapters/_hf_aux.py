"""transformers' router load-balancing loss, computed layer by layer inside the schedule.

Legend: ``T`` tokens of the microbatch, ``E`` experts, ``K`` top-k.

transformers' ``load_balancing_loss_func`` couples all layers::

    aux = E * sum_e (C_e / R) * (S_e / R)

with ``C_e`` the top-k assignments to expert ``e`` and ``S_e`` the softmax router
probabilities summed over every MoE layer and token (weighted by the 2-D attention mask
when one is given), and ``R`` the rows counted (``T`` per layer, or the mask's sum). Its
gradient reaches layer ``l``'s probabilities as ``dL/dS_e`` (the same for every layer and
token), which is only known once every layer has run forward. So each layer adds its
``C`` and ``S`` to the microbatch's :class:`AuxBatch` and attaches an identity on its
routing weights whose backward gives its probabilities ``dL/dS`` (times the mask); the
post-process computes ``aux`` from a leaf holding ``S``, and the post-process backward
fills that leaf's ``grad`` before any layer's backward runs.

Forwards of different microbatches never interleave in :func:`~moe_overlap.combined_1f1b`
(``F(i+1)`` runs beside ``B(i)``), so one open batch at a time is enough.

Which loss a model adds is found by running its own ``forward`` (:func:`model_aux_loss`),
never by reading its source.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import Tensor, nn

from moe_overlap import ConfigError, IntegrationError
from moe_overlap.adapters._hf_calls import router_flag, swap_child
from moe_overlap.adapters._hf_probe import failing_module, probe_ids
from moe_overlap.adapters._hf_structure import ExpertsStandIn, block_of

__all__ = ["AuxBatch", "RouterAuxLoss", "aux_top_k", "model_aux_loss", "router_logits_source"]

_STANDARD = "the adapter adds transformers' standard load_balancing_loss_func"
_ADVICE = "pass router_aux_loss=False to train without it"


@dataclass(kw_only=True)
class AuxBatch:
    """One microbatch's running sums; ``leaf`` is set by :meth:`RouterAuxLoss.finish`."""

    counts_E: Tensor
    probs_E: Tensor
    rows: Tensor | float = 0.0
    leaf: Tensor | None = None
    layers: list[int] = field(default_factory=list[int])


class _AttachAux(torch.autograd.Function):
    """Identity on the routing weights; backward gives the probabilities ``dL/dS``."""

    @staticmethod
    def forward(
        ctx: Any,  # torch's FunctionCtx declares no fields; we add our own
        weights_TK: Tensor,
        probs_TE: Tensor,
        batch: AuxBatch,
        mask_T: Tensor | None,
    ) -> Tensor:
        ctx.batch = batch
        ctx.mask_T = mask_T
        ctx.shape = probs_TE.shape
        ctx.dtype = probs_TE.dtype
        return weights_TK.view_as(weights_TK)

    @staticmethod
    def backward(
        ctx: Any,  # see forward
        *grad_outputs: Tensor,
    ) -> tuple[Tensor, Tensor | None, None, None]:
        (grad_TK,) = grad_outputs
        batch: AuxBatch = ctx.batch
        leaf = batch.leaf
        if leaf is None or leaf.grad is None:
            return grad_TK, None, None, None
        g_E = leaf.grad
        mask_T: Tensor | None = ctx.mask_T
        if mask_T is None:
            g_TE = g_E.unsqueeze(0).expand(ctx.shape)
        else:
            g_TE = g_E.unsqueeze(0) * mask_T.unsqueeze(-1)
        return grad_TK, g_TE.to(ctx.dtype).contiguous(), None, None


# Function.apply is untyped; give it its signature once, here.
_attach_aux = cast(
    "Callable[[Tensor, Tensor, AuxBatch, Tensor | None], Tensor]",
    _AttachAux.apply,  # pyright: ignore[reportUnknownMemberType]
)


class RouterAuxLoss:
    """The load-balancing loss of one model, as transformers computes it (see module doc)."""

    def __init__(self, *, num_experts: int, top_k: int, coef: float) -> None:
        self.num_experts = num_experts
        self.top_k = top_k
        self.coef = coef
        self.open: AuxBatch | None = None

    def begin(self, device: torch.device) -> None:
        """Open a microbatch (in ``_preprocess``); a batch left open by a failed step is dropped."""
        zeros = torch.zeros(self.num_experts, dtype=torch.float32, device=device)
        self.open = AuxBatch(counts_E=zeros, probs_E=zeros.clone())

    def attach(
        self, layer: int, weights_TK: Tensor, logits_TE: Tensor, mask_BS: Tensor | None
    ) -> Tensor:
        """Add this layer's counts and probabilities; return ``weights_TK`` carrying the grad."""
        batch = self.open
        if batch is None:
            raise IntegrationError(
                f"RouterAuxLoss: layer {layer} ran forward outside a microbatch; expected "
                "_preprocess to open one (combined_1f1b does), received none open"
            )
        E, K = self.num_experts, self.top_k
        # The same operations, in the same order, as transformers' load_balancing_loss_func.
        probs_TE = torch.nn.functional.softmax(logits_TE, dim=-1)
        _, selected_TK = torch.topk(probs_TE, K, dim=-1)
        mask_T: Tensor | None = None
        with torch.no_grad():
            if mask_BS is None:
                device = probs_TE.device
                histc_dtype = torch.float32 if device.type in ("cpu", "mps") else torch.int32
                batch.counts_E = batch.counts_E + torch.histc(
                    selected_TK.reshape(-1).to(histc_dtype), bins=E, min=0, max=E
                )
                batch.probs_E = batch.probs_E + probs_TE.float().sum(dim=0)
                batch.rows = batch.rows + probs_TE.shape[0]
            else:
                mask_T = mask_BS.reshape(-1).to(device=probs_TE.device, dtype=torch.float32)
                batch.counts_E = batch.counts_E + torch.zeros(
                    E, dtype=torch.float32, device=probs_TE.device
                ).scatter_add_(0, selected_TK.reshape(-1), mask_T.repeat_interleave(K))
                batch.probs_E = batch.probs_E + (probs_TE.float() * mask_T.unsqueeze(-1)).sum(0)
                batch.rows = batch.rows + mask_T.sum()
        batch.layers.append(layer)
        return _attach_aux(weights_TK, probs_TE, batch, mask_T)

    def attach_again(
        self, batch: AuxBatch, weights_TK: Tensor, logits_TE: Tensor, mask_BS: Tensor | None
    ) -> Tensor:
        """:meth:`attach` for a recomputed layer: ``weights_TK`` carrying the grad of
        ``batch`` (the one its forward added to), whose sums are left as they are."""
        probs_TE = torch.nn.functional.softmax(logits_TE, dim=-1)
        mask_T = (
            None
            if mask_BS is None
            else mask_BS.reshape(-1).to(device=probs_TE.device, dtype=torch.float32)
        )
        return _attach_aux(weights_TK, probs_TE, batch, mask_T)

    def finish(self) -> Tensor | None:
        """Close the microbatch; return ``aux`` (``None`` when no MoE layer ran)."""
        batch, self.open = self.open, None
        if batch is None or not batch.layers:
            return None
        leaf = batch.probs_E.detach().requires_grad_()
        batch.leaf = leaf
        tokens_per_expert_E = batch.counts_E / batch.rows
        router_prob_per_expert_E = leaf / batch.rows
        overall = torch.sum(tokens_per_expert_E * router_prob_per_expert_E.unsqueeze(0))
        return overall * self.num_experts


# --- which loss the model's own forward adds ------------------------------------------------
def router_logits_source(base: nn.Module) -> tuple[type[nn.Module], int] | None:
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


def aux_top_k(model: nn.Module, top_ks: Sequence[int]) -> int:
    """The top-k of transformers' load-balancing loss: the config's, or the layers' one."""
    value: object = getattr(getattr(model, "config", None), "num_experts_per_tok", None)
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if len(top_ks) != 1:
        raise ConfigError(
            f"{type(model).__name__}: router_aux_loss: transformers' "
            "load_balancing_loss_func takes one top-k for every layer; expected one, "
            f"received per-layer top-k {list(top_ks)} (pass router_aux_loss=False to "
            "train without it)"
        )
    return top_ks[0]


def model_aux_loss(
    model: nn.Module,
    layers: Sequence[nn.Module],
    *,
    num_experts: int,
    top_k: int,
    explicit: bool,
    recorded: bool,
    accepts_router_flag: bool,
) -> RouterAuxLoss | None:
    """The load-balancing loss the model's own ``forward`` adds, if it is transformers'
    standard one; ``None`` when it adds none (refused if ``explicit``ly asked for).

    Found by running the forward (its routed experts stood in for: the loss depends on
    the router logits only) on a padded probe with ``output_router_logits`` on and off:
    the loss it adds is compared with ``load_balancing_loss_func`` on the router logits
    it returns, times ``router_aux_loss_coef``. Never read off its source. ``recorded``:
    whether transformers records the router logits (:func:`router_logits_source`).
    """
    name = type(model).__name__
    coef = _coefficient(getattr(model, "config", None))
    p0 = next(model.parameters())
    ids = probe_ids(getattr(model, "config", None), p0.device)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    on, off = _runs(model, layers, ids, mask, accepts_router_flag)
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
                f"{name}: router_aux_loss: {_STANDARD}; this model's forward computes no "
                "such loss (with output_router_logits=True it adds nothing to the loss "
                "and returns no aux_loss); expected router_aux_loss=None (follow the "
                f"model) or False, received True"
            )
        return None
    items = list(cast("Sequence[object]", logits)) if isinstance(logits, (tuple, list)) else []
    if not recorded or not items or not all(isinstance(t, Tensor) for t in items):
        raise ConfigError(
            f"{name}: router_aux_loss: {_STANDARD}; this model's forward adds "
            f"{added:.6g} to the loss but the router logits it is computed from are not "
            f"where transformers records them ({_ADVICE})"
        )
    ours = RouterAuxLoss(num_experts=num_experts, top_k=top_k, coef=coef)
    std, dtype = _standard(ours, cast("list[Tensor]", items), mask)
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
            f"{name}: router_aux_loss: {_STANDARD}; this model's forward computes another "
            f"one ({'; '.join(problems)}, on a padded probe) ({_ADVICE})"
        )
    return RouterAuxLoss(num_experts=num_experts, top_k=top_k, coef=coef)


def _coefficient(config: object) -> float:
    """The config's ``router_aux_loss_coef`` (0 when it has none)."""
    value: object = getattr(config, "router_aux_loss_coef", 0.0)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return 0.0


def _runs(
    model: nn.Module,
    layers: Sequence[nn.Module],
    ids: Tensor,
    mask: Tensor,
    accepts_router_flag: bool,
) -> tuple[object, object]:
    """The model's own forward on the padded probe, its routed experts stood in for, with
    ``output_router_logits`` on, then off."""
    cfg: object = getattr(model, "config", None)
    labels = ids.masked_fill(mask == 0, -100)
    runs: dict[bool, object] = {}
    try:
        with torch.no_grad(), contextlib.ExitStack() as stack:
            for layer in layers:
                found = block_of(layer)
                if found is not None:
                    experts = found[1].get_submodule("experts")
                    stack.enter_context(swap_child(found[1], "experts", ExpertsStandIn(experts)))
            for flag in (True, False):
                with router_flag(cfg, flag, accepts_router_flag) as kwargs:
                    runs[flag] = model(input_ids=ids, attention_mask=mask, labels=labels, **kwargs)
    except Exception as exc:
        raise ConfigError(
            f"{type(model).__name__}: router_aux_loss: {_STANDARD}, read off the model's own "
            "forward with output_router_logits=True; that forward (on a probe, its routed "
            f"experts stood in for) raised in {failing_module(exc, model)} "
            f"{type(exc).__name__}: {exc} ({_ADVICE})"
        ) from exc
    return runs[True], runs[False]


def _standard(
    ours: RouterAuxLoss, logits: Sequence[Tensor], mask: Tensor
) -> tuple[float, torch.dtype]:
    """transformers' standard loss (not times the coefficient) on the router ``logits``
    the forward returned, as the adapter computes it; and the logits' dtype."""
    ours.begin(mask.device)
    dtype = torch.float32
    with torch.no_grad():
        for i, t in enumerate(logits):
            logits_TE = t.reshape(-1, t.shape[-1])
            dtype = logits_TE.dtype
            weights = torch.zeros(logits_TE.shape[0], ours.top_k, device=logits_TE.device)
            ours.attach(i, weights, logits_TE, mask)
        value = ours.finish()
    return (float(value) if value is not None else 0.0), dtype
