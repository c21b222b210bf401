"""Top-k router (softmax or sigmoid scores, selection bias, group-limited selection) with an
optional load-balancing auxiliary loss.

Legend: ``T`` tokens, ``D`` hidden, ``X`` experts (global), ``K`` top-k.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe_overlap import ConfigError
from moe_overlap.args import (
    BOOL,
    FLOAT_DTYPE,
    OPT_DEVICE,
    POSITIVE,
    TENSOR,
    Int,
    OneOf,
    Real,
    check_arg,
    refuse,
)

__all__ = ["ScoreFunction", "TopKRouter", "attach_aux_loss"]


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
    """Return ``probs`` unchanged, with ``coeff * aux_loss`` added to the backward pass.

    ``aux_loss`` is a one-element tensor, ``coeff`` a finite real number (the arguments are
    checked; :class:`TopKRouter` calls the unchecked op).
    """
    w = "attach_aux_loss"
    check_arg(w, "probs", probs, TENSOR)
    check_arg(w, "aux_loss", aux_loss, TENSOR)
    if aux_loss.numel() != 1:
        raise refuse(f"{w}: aux_loss", "a one-element tensor (the loss)", aux_loss)
    coeff = check_arg(w, "coeff", coeff, Real())
    return _inject_aux_loss(probs, aux_loss, coeff)


ScoreFunction = Literal["softmax", "sigmoid"]
"""How logits become expert scores: Mixtral/Qwen-style ``softmax``, DeepSeek-V3-style
``sigmoid``."""


class TopKRouter(nn.Module):
    """Expert scores of ``x @ W^T`` in float32, then the top ``k`` experts per token.

    ``score``: ``softmax`` over experts (the default) or an independent ``sigmoid``.
    ``expert_bias`` (a buffer, zeros by default) is added to the scores for *selection
    only* (DeepSeek-V3's aux-free score-correction bias); tests also use it to starve
    experts. With ``num_groups > 1`` selection is group-limited (DeepSeek-V3,
    Megatron-Core's ``group_limited_topk``): experts are split into ``num_groups`` equal
    groups, each group is scored by the sum of its best ``topk // topk_groups`` selection
    scores, and the ``k`` experts are taken from the best ``topk_groups`` groups only. The
    returned probabilities are the chosen experts' scores, renormalized to sum to one when
    ``normalize`` (as DeepSeek-V3 does with sigmoid scores), times ``scaling``.

    The switch-style auxiliary loss ``X * sum_x f_x * P_x`` is attached to the scores
    when ``aux_loss_coeff > 0`` (sigmoid scores normalized over experts first); its
    gradient is ``aux_loss_coeff * aux_loss_scale``, where ``aux_loss_scale`` (1 by
    default) should equal the scale applied to the language-model loss
    (``combined_1f1b(..., loss_scale=...)``), as Megatron-Core's
    ``MoEAuxLossAutoScaler.set_loss_scale`` does. ``forward(x, padding_T)`` leaves padded
    tokens out of that loss (Megatron-Core's ``padding_mask``); they are still routed.
    """

    expert_bias: Tensor

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        topk: int,
        *,
        aux_loss_coeff: float,
        score: ScoreFunction = "softmax",
        num_groups: int = 1,
        topk_groups: int = 1,
        normalize: bool = False,
        scaling: float = 1.0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        w = "TopKRouter"
        hidden = check_arg(w, "hidden", hidden, POSITIVE)
        num_experts = check_arg(w, "num_experts", num_experts, POSITIVE)
        topk = check_arg(w, "topk", topk, Int(1, num_experts, max_name="num_experts"))
        aux_loss_coeff = check_arg(w, "aux_loss_coeff", aux_loss_coeff, _COEFF)
        score = check_arg(w, "score", score, _SCORE)
        num_groups = check_arg(w, "num_groups", num_groups, POSITIVE)
        topk_groups = check_arg(w, "topk_groups", topk_groups, POSITIVE)
        normalize = check_arg(w, "normalize", normalize, BOOL)
        scaling = check_arg(w, "scaling", scaling, Real(above=0))
        dtype = check_arg(w, "dtype", dtype, FLOAT_DTYPE)
        device = check_arg(w, "device", device, OPT_DEVICE)
        _check_routing(num_experts, topk, num_groups, topk_groups)
        self.topk = topk
        self.num_experts = num_experts
        self.score: ScoreFunction = score
        self.num_groups = num_groups
        self.topk_groups = topk_groups
        self.normalize = normalize
        self.scaling = scaling
        self.aux_loss_coeff = aux_loss_coeff
        self.aux_loss_scale = 1.0
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype, device=device))
        self.register_buffer(
            "expert_bias", torch.zeros(num_experts, dtype=torch.float32, device=device)
        )

    def forward(self, x_TD: Tensor, padding_T: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Return ``(probs_TK float32, experts_TK int64)``.

        ``padding_T`` (bool ``[T]``, ``True`` at padding tokens, Megatron-Core's
        ``padding_mask`` flattened): padded tokens are routed like the others, but left out
        of the auxiliary loss (its expert loads, mean scores and token count).
        """
        logits_TX = F.linear(x_TD, self.weight).float()
        if self.score == "softmax":
            scores_TX = torch.softmax(logits_TX, dim=-1)
        else:
            scores_TX = torch.sigmoid(logits_TX)
        if self.aux_loss_coeff > 0:
            coeff = self.aux_loss_coeff * self.aux_loss_scale
            aux = self._aux_loss(scores_TX, padding_T)
            scores_TX = _inject_aux_loss(scores_TX, aux, coeff)
        experts_TK = self._select(scores_TX.detach())
        probs_TK = scores_TX.gather(1, experts_TK)
        if self.normalize:
            probs_TK = probs_TK / (probs_TK.sum(dim=-1, keepdim=True) + 1e-20)
        if self.scaling != 1.0:
            probs_TK = probs_TK * self.scaling
        return probs_TK, experts_TK

    def graph_key(self) -> tuple[float, float]:
        """The Python values a CUDA graph of :meth:`forward` bakes in (aux loss coefficient
        and scale); :class:`~moe_overlap.blocks.GraphedBlock` refuses to replay when they
        change."""
        return (self.aux_loss_coeff, self.aux_loss_scale)

    def _select(self, scores_TX: Tensor) -> Tensor:
        """The top-``k`` experts by selection score (bias added), group-limited if asked."""
        sel_TX = scores_TX + self.expert_bias
        if self.num_groups > 1:
            T, G = sel_TX.shape[0], self.num_groups
            per_group = sel_TX.view(T, G, -1)
            best = self.topk // self.topk_groups
            group_TG = per_group.topk(best, dim=-1).values.sum(dim=-1)
            keep_TG = torch.zeros_like(group_TG, dtype=torch.bool)
            keep_TG.scatter_(1, group_TG.topk(self.topk_groups, dim=-1).indices, True)
            sel_TX = per_group.masked_fill(~keep_TG.unsqueeze(-1), float("-inf")).view(T, -1)
        _, experts_TK = torch.topk(sel_TX, self.topk, dim=-1)
        return experts_TK

    def _aux_loss(self, scores_TX: Tensor, padding_T: Tensor | None = None) -> Tensor:
        experts_TK = self._select(scores_TX.detach())
        if self.score == "sigmoid":
            scores_TX = scores_TX / (scores_TX.sum(dim=-1, keepdim=True) + 1e-20)
        # One-hot sum, not bincount: bincount has no deterministic CUDA kernel.
        experts_X = torch.arange(self.num_experts, device=experts_TK.device)
        hits_TKX = experts_TK.unsqueeze(-1) == experts_X
        if padding_T is None:
            counts_X = hits_TKX.sum((0, 1))
            frac_X = counts_X.to(torch.float32) / max(experts_TK.numel(), 1)
            return self.num_experts * (frac_X * scores_TX.mean(0)).sum()
        # Only the real tokens count (Megatron-Core's masked aux loss); no host sync.
        real_T = ~padding_T
        counts_X = (hits_TKX & real_T[:, None, None]).sum((0, 1))
        n_real = real_T.sum().to(torch.float32).clamp(min=1.0)
        frac_X = counts_X.to(torch.float32) / (n_real * self.topk)
        mean_X = (scores_TX * real_T.unsqueeze(-1)).sum(0) / n_real
        return self.num_experts * (frac_X * mean_X).sum()


_SCORE: OneOf[ScoreFunction] = OneOf(("softmax", "sigmoid"), expects="'softmax' or 'sigmoid'")
_COEFF = Real(min=0, hint="0 turns the load-balancing loss off")


def _check_routing(num_experts: int, topk: int, num_groups: int, topk_groups: int) -> None:
    """What the specs of the single arguments cannot say: the group-limited selection."""
    if num_experts % num_groups:
        raise ConfigError(
            f"TopKRouter: num_groups must divide num_experts={num_experts}, received {num_groups}"
        )
    if num_groups > 1 and not (1 <= topk_groups <= num_groups and topk % topk_groups == 0):
        raise ConfigError(
            f"TopKRouter: with num_groups={num_groups}, expected 1 <= topk_groups <= "
            f"num_groups dividing topk={topk}, received topk_groups={topk_groups}"
        )
    if num_groups > 1 and topk // topk_groups > num_experts // num_groups:
        raise ConfigError(
            f"TopKRouter: each kept group holds {num_experts // num_groups} experts, fewer than "
            f"topk // topk_groups = {topk // topk_groups}"
        )
