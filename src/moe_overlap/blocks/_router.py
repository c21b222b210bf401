"""Top-k softmax router with an optional load-balancing auxiliary loss.

Legend: ``T`` tokens, ``D`` hidden, ``X`` experts (global), ``K`` top-k.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["TopKRouter", "attach_aux_loss"]


class _AuxLossInjector(torch.autograd.Function):
    """Identity on ``probs``; backward gives ``aux_loss`` the gradient ``coeff``.

    Megatron-Core's ``MoEAuxLossAutoScaler`` pattern: the auxiliary loss joins the backward
    pass without being added to the returned loss, so the loss value stays the language
    model loss and the plain and scheduled paths build the same graph.
    """

    @staticmethod
    def forward(
        ctx: Any,  # torch's FunctionCtx declares no fields; we add our own
        probs: Tensor,
        aux_loss: Tensor,
        coeff: float,
    ) -> Tensor:
        ctx.save_for_backward(aux_loss)
        ctx.coeff = coeff
        return probs.view_as(probs)

    @staticmethod
    def backward(
        ctx: Any,  # see forward
        *grad_outputs: Tensor,
    ) -> tuple[Tensor, Tensor, None]:
        (grad,) = grad_outputs
        (aux_loss,) = ctx.saved_tensors
        coeff: float = ctx.coeff
        return grad, torch.full_like(aux_loss, coeff), None


# Function.apply is untyped; give it its signature once, here.
_inject_aux_loss = cast(
    "Callable[[Tensor, Tensor, float], Tensor]",
    _AuxLossInjector.apply,  # pyright: ignore[reportUnknownMemberType]
)


def attach_aux_loss(probs: Tensor, aux_loss: Tensor, coeff: float) -> Tensor:
    """Return ``probs`` unchanged, with ``coeff * aux_loss`` added to the backward pass."""
    return _inject_aux_loss(probs, aux_loss, coeff)


class TopKRouter(nn.Module):
    """``softmax(x @ W^T)`` over experts in float32, then the top ``k``.

    ``expert_bias`` (a buffer, zeros by default) is added to the scores for *selection
    only*, as in DeepSeek-V3's aux-free balancing; tests use it to starve experts.
    The switch-style auxiliary loss ``X * sum_x f_x * P_x`` is attached to the probs
    when ``aux_loss_coeff > 0``; its gradient is ``aux_loss_coeff * aux_loss_scale``, where
    ``aux_loss_scale`` (1 by default) should equal the scale applied to the language-model
    loss (``combined_1f1b(..., loss_scale=...)``), as Megatron-Core's
    ``MoEAuxLossAutoScaler.set_loss_scale`` does.
    """

    expert_bias: Tensor

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        topk: int,
        *,
        aux_loss_coeff: float,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.topk = topk
        self.num_experts = num_experts
        self.aux_loss_coeff = aux_loss_coeff
        self.aux_loss_scale = 1.0
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype, device=device))
        self.register_buffer(
            "expert_bias", torch.zeros(num_experts, dtype=torch.float32, device=device)
        )

    def forward(self, x_TD: Tensor) -> tuple[Tensor, Tensor]:
        """Return ``(probs_TK float32, experts_TK int64)``."""
        logits_TX = F.linear(x_TD, self.weight).float()
        scores_TX = torch.softmax(logits_TX, dim=-1)
        if self.aux_loss_coeff > 0:
            coeff = self.aux_loss_coeff * self.aux_loss_scale
            scores_TX = attach_aux_loss(scores_TX, self._aux_loss(scores_TX), coeff)
        _, experts_TK = torch.topk(scores_TX.detach() + self.expert_bias, self.topk, dim=-1)
        probs_TK = scores_TX.gather(1, experts_TK)
        return probs_TK, experts_TK

    def _aux_loss(self, scores_TX: Tensor) -> Tensor:
        _, experts_TK = torch.topk(scores_TX.detach() + self.expert_bias, self.topk, dim=-1)
        # One-hot sum, not bincount: bincount has no deterministic CUDA kernel.
        experts_X = torch.arange(self.num_experts, device=experts_TK.device)
        counts_X = (experts_TK.reshape(-1, 1) == experts_X).sum(0)
        frac_X = counts_X.to(torch.float32) / max(experts_TK.numel(), 1)
        return self.num_experts * (frac_X * scores_TX.mean(0)).sum()
