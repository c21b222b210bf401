"""Delayed weight gradients for a transformers model's projections and experts.

Legend: ``N`` rows grouped by local expert, ``D`` hidden, ``F`` expert hidden.

Built on :class:`~moe_overlap.blocks.DelayedWgradLinear` and
:class:`~moe_overlap.blocks.DelayedWgradGroupedLinear`, pointed at the transformers
model's own parameters (no copy), so ``state_dict`` keys and checkpoints stay the
transformers ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

from moe_overlap.blocks import (
    DelayedWgradGroupedLinear,
    DelayedWgradLinear,
    DelayedWgradModule,
)

__all__ = [
    "DelayedLinear",
    "ExpertWeights",
    "WgradGroup",
    "delay_linears",
    "delay_linears_in",
]

_META = torch.device("meta")


class DelayedLinear(DelayedWgradLinear):
    """An ``nn.Linear`` replacement sharing its ``weight`` (and ``bias``) parameters.

    Same ``state_dict`` keys as the ``nn.Linear`` it replaces. The bias gradient is
    computed in backward as usual; only the weight gradient is delayed.
    """

    bias: nn.Parameter | None

    def __init__(self, linear: nn.Linear, *, delay_wgrad: bool) -> None:
        super().__init__(
            linear.in_features, linear.out_features, delay_wgrad=delay_wgrad, device=_META
        )
        weight: object = linear.weight
        bias: object = linear.bias
        # torch types both as Tensor; an nn.Linear holds Parameters (bias may be None).
        assert isinstance(weight, nn.Parameter)
        assert bias is None or isinstance(bias, nn.Parameter)
        self.weight = weight
        self.register_parameter("bias", bias)

    def forward(self, x: Tensor) -> Tensor:
        y = super().forward(x)
        return y + self.bias if self.bias is not None else y


def delay_linears(parent: nn.Module, name: str, *, delay_wgrad: bool) -> list[DelayedLinear]:
    """Swap every ``nn.Linear`` at or under ``parent.name`` for a :class:`DelayedLinear`.

    With ``delay_wgrad`` false nothing is swapped; linears swapped by an earlier adapter
    get the new setting. Returns the delayed linears found or made.
    """
    module: object = getattr(parent, name)
    if isinstance(module, DelayedLinear):
        module.delay_wgrad = delay_wgrad
        return [module]
    if isinstance(module, nn.Linear):
        if not delay_wgrad:
            return []
        swapped = DelayedLinear(module, delay_wgrad=True)
        setattr(parent, name, swapped)
        return [swapped]
    if not isinstance(module, nn.Module):
        return []
    return delay_linears_in(module, delay_wgrad=delay_wgrad)


def delay_linears_in(module: nn.Module, *, delay_wgrad: bool) -> list[DelayedLinear]:
    """:func:`delay_linears` for every child of ``module``."""
    found: list[DelayedLinear] = []
    for child_name, _ in list(module.named_children()):
        found += delay_linears(module, child_name, delay_wgrad=delay_wgrad)
    return found


class WgradGroup:
    """Several delayed modules behind one ``backward_dw`` (a :class:`~moe_overlap.WgradLayer`)."""

    def __init__(self, modules: Sequence[DelayedWgradModule]) -> None:
        self.modules = tuple(modules)

    @property
    def pending_wgrad(self) -> int:
        """Weight gradients the group still owes (a :class:`~moe_overlap.PendingWgrad`)."""
        return sum(m.pending_wgrad for m in self.modules)

    def backward_dw(self) -> None:
        """Each module's oldest pending weight gradient, last module first."""
        for module in reversed(self.modules):
            module.backward_dw()

    def parameters(self) -> Iterator[nn.Parameter]:
        for module in self.modules:
            yield from module.parameters()


def _grouped(weight: nn.Parameter, *, delay_wgrad: bool) -> DelayedWgradGroupedLinear:
    groups, out_features, in_features = weight.shape
    lin = DelayedWgradGroupedLinear(
        groups, in_features, out_features, delay_wgrad=delay_wgrad, device=_META
    )
    lin.weight = weight
    return lin


class ExpertWeights:
    """The local experts' SwiGLU on transformers' fused 3-D weights, one GEMM per expert.

    ``gate_up_proj`` is ``[L, 2F, D]`` (gate rows, then up rows) and ``down_proj``
    ``[L, D, F]``, exactly transformers' layout. A :class:`~moe_overlap.WgradLayer`.
    """

    def __init__(
        self,
        gate_up_proj: nn.Parameter,
        down_proj: nn.Parameter,
        act_fn: Callable[[Tensor], Tensor],
        *,
        delay_wgrad: bool,
    ) -> None:
        self.gate_up = _grouped(gate_up_proj, delay_wgrad=delay_wgrad)
        self.down = _grouped(down_proj, delay_wgrad=delay_wgrad)
        self.act_fn = act_fn
        self.local_experts = gate_up_proj.shape[0]

    def __call__(self, x_ND: Tensor, sizes: Sequence[int]) -> Tensor:
        """``sizes[l]`` rows of ``x_ND`` go to local expert ``l``, in order."""
        gate_NF, up_NF = self.gate_up(x_ND, sizes).chunk(2, dim=-1)
        out: Tensor = self.down(self.act_fn(gate_NF) * up_NF, sizes)
        return out

    @property
    def pending_wgrad(self) -> int:
        """Weight gradients the experts still owe (a :class:`~moe_overlap.PendingWgrad`)."""
        return self.down.pending_wgrad + self.gate_up.pending_wgrad

    def backward_dw(self) -> None:
        """Delayed weight gradients of ``down_proj``, then ``gate_up_proj``."""
        self.down.backward_dw()
        self.gate_up.backward_dw()

    def parameters(self) -> Iterator[nn.Parameter]:
        yield self.gate_up.weight
        yield self.down.weight

    def modules(self) -> tuple[DelayedWgradModule, ...]:
        """The two delayable grouped linears (``down_proj`` first, as wgrad runs)."""
        return (self.down, self.gate_up)
