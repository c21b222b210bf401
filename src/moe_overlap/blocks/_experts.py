"""Routed experts: one SwiGLU per local expert, computed grouped.

Legend: ``N`` rows (token copies) grouped by local expert, ``D`` hidden, ``F`` expert
hidden, ``L`` local experts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from moe_overlap.blocks._recompute import recompute
from moe_overlap.blocks._transformer import swiglu
from moe_overlap.blocks._wgrad import DelayedWgradGroupedLinear

__all__ = ["GroupedExperts"]


class GroupedExperts(nn.Module):
    """``L`` SwiGLU experts; rows arrive grouped by expert, any group possibly empty.

    ``fc1.weight`` is ``[L, 2F, D]`` (gate and up), ``fc2.weight`` is ``[L, D, F]``; this
    rank holds global experts ``expert_offset .. expert_offset+L-1``. A
    :class:`~moe_overlap.WgradLayer`. ``recompute_activation``: the SwiGLU product
    recomputed in backward.
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
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.recompute_activation = recompute_activation
        self.local_experts = local_experts
        self.expert_offset = expert_offset
        self.fc1 = DelayedWgradGroupedLinear(
            local_experts, hidden, 2 * ffn, delay_wgrad=delay_wgrad, dtype=dtype, device=device
        )
        self.fc2 = DelayedWgradGroupedLinear(
            local_experts, ffn, hidden, delay_wgrad=delay_wgrad, dtype=dtype, device=device
        )

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
