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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import Tensor

from moe_overlap import IntegrationError

__all__ = ["AuxBatch", "RouterAuxLoss"]


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
