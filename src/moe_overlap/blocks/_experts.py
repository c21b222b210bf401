"""Routed experts: one SwiGLU per local expert, computed grouped.

Legend: ``N`` rows (token copies) grouped by local expert, ``D`` hidden, ``F`` expert
hidden, ``L`` local experts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from moe_overlap.args import (
    BOOL,
    FLOAT_DTYPE,
    NON_NEGATIVE,
    OPT_DEVICE,
    POSITIVE,
    check_arg,
)
from moe_overlap.blocks._delayed_linear import DelayedWgradGroupedLinear
from moe_overlap.blocks._recompute import recompute
from moe_overlap.blocks._transformer import swiglu

__all__ = ["GroupedExperts"]


class GroupedExperts(nn.Module):
    """``L`` SwiGLU experts; rows arrive grouped by expert, any group possibly empty.

    ``fc1.weight`` is ``[L, 2F, D]`` (gate and up), ``fc2.weight`` is ``[L, D, F]``; this
    rank holds global experts ``expert_offset .. expert_offset+L-1``. A
    :class:`~moe_overlap.WgradLayer`. ``recompute_activation``: the SwiGLU product
    recomputed in backward. ``calls_per_backward``: how many times the experts run per
    forward pass (a chunked :class:`~moe_overlap.blocks.TokenDispatcher`'s ``chunks``), so
    that delayed weight gradients sum as autograd sums them
    (:attr:`~moe_overlap.blocks.DelayedWgradModule.calls_per_backward`).
    """

    def __init__(
        self,
        local_experts: int,
        hidden: int,
        ffn: int,
        *,
        expert_offset: int,
        delay_wgrad: bool,
        recompute_activation: bool = False,
        calls_per_backward: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        w = "GroupedExperts"
        local_experts = check_arg(w, "local_experts", local_experts, POSITIVE)
        hidden = check_arg(w, "hidden", hidden, POSITIVE)
        ffn = check_arg(w, "ffn", ffn, POSITIVE)
        expert_offset = check_arg(w, "expert_offset", expert_offset, NON_NEGATIVE)
        delay_wgrad = check_arg(w, "delay_wgrad", delay_wgrad, BOOL)
        recompute_activation = check_arg(w, "recompute_activation", recompute_activation, BOOL)
        calls = check_arg(w, "calls_per_backward", calls_per_backward, POSITIVE)
        dtype = check_arg(w, "dtype", dtype, FLOAT_DTYPE)
        device = check_arg(w, "device", device, OPT_DEVICE)
        self.recompute_activation = recompute_activation
        self.local_experts = local_experts
        self.expert_offset = expert_offset
        self.fc1 = DelayedWgradGroupedLinear(
            local_experts, hidden, 2 * ffn, delay_wgrad=delay_wgrad, dtype=dtype, device=device
        )
        self.fc2 = DelayedWgradGroupedLinear(
            local_experts, ffn, hidden, delay_wgrad=delay_wgrad, dtype=dtype, device=device
        )
        self.fc1.calls_per_backward = calls
        self.fc2.calls_per_backward = calls

    def forward(self, x_ND: Tensor, sizes: Sequence[int]) -> Tensor:
        """``sizes[l]`` rows of ``x_ND`` go to local expert ``l``, in order."""
        h = self.fc1(x_ND, sizes)
        act = recompute(swiglu, h) if self.recompute_activation else swiglu(h)
        out: Tensor = self.fc2(act, sizes)
        return out

    def backward_dw(self) -> None:
        """Delayed weight gradients of ``fc2``, then ``fc1``."""
        self.fc2.backward_dw()
        self.fc1.backward_dw()
