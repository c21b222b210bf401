"""Delayed weight gradients for a transformers model's projections and routed experts.

Legend: ``N`` rows grouped by local expert, ``D`` hidden, ``F`` expert hidden.

Only an exact ``nn.Linear`` is swapped (a subclass may have its own ``forward``): a
:class:`DelayedLinear` reproduces its forward. :class:`ExpertWeights` computes a
transformers experts module's forward from the layout flags that transformers'
``use_experts_implementation`` declares (and the module's own ``_apply_gate``, activation
and post-expert norm); the adapter's self-check compares it with the module's own forward.

Built on :class:`~moe_overlap.blocks.DelayedWgradLinear` and
:class:`~moe_overlap.blocks.DelayedWgradGroupedLinear`, pointed at the transformers
model's own parameters (no copy), so ``state_dict`` keys and checkpoints stay the
transformers ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor, nn

from moe_overlap import ConfigError, IntegrationError
from moe_overlap.args import Instance, check_arg
from moe_overlap.blocks import (
    DelayedWgradGroupedLinear,
    DelayedWgradLinear,
    DelayedWgradModule,
    GroupSizes,
)

__all__ = [
    "DelayedLinear",
    "ExpertLayout",
    "ExpertWeights",
    "WgradGroup",
    "common_label",
    "delay_linears",
    "delay_linears_in",
]

_META = torch.device("meta")


_LINEAR = Instance(nn.Linear, "an nn.Linear (whose parameters it shares)", error=IntegrationError)


class DelayedLinear(DelayedWgradLinear):
    """An ``nn.Linear`` replacement sharing its ``weight`` (and ``bias``) parameters.

    Same ``state_dict`` keys as the ``nn.Linear`` it replaces. The bias gradient is
    computed in backward as usual; only the weight gradient is delayed. :attr:`replaced`
    is the linear it stands for (an adapter built before the swap saw that one).
    """

    bias: nn.Parameter | None

    def __init__(self, linear: nn.Linear, *, delay_wgrad: bool) -> None:
        check_arg("DelayedLinear", "linear", linear, _LINEAR)
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
        self._replaced = (linear,)  # in a tuple: not a submodule (no state_dict keys)

    @property
    def replaced(self) -> nn.Linear:
        """The ``nn.Linear`` this module replaced (sharing its parameters)."""
        return self._replaced[0]

    def forward(self, x: Tensor) -> Tensor:
        y = super().forward(x)
        return y + self.bias if self.bias is not None else y


def delay_linears(parent: nn.Module, name: str, *, delay_wgrad: bool) -> list[DelayedLinear]:
    """Swap every ``nn.Linear`` at or under ``parent.name`` for a :class:`DelayedLinear`.

    With ``delay_wgrad`` false nothing is swapped. A linear swapped by an earlier adapter is
    kept as it is: it delays only for a schedule that claims it (its own adapter's), and
    computes its weight gradient at once for any other (this adapter's, without delay).
    Returns the delayed linears found or made.
    """
    module: object = getattr(parent, name)
    if isinstance(module, DelayedLinear):
        return [module]
    if type(module) is nn.Linear:
        if not delay_wgrad:
            return []
        swapped = DelayedLinear(module, delay_wgrad=True)
        setattr(parent, name, swapped)
        return [swapped]
    if not isinstance(module, nn.Module):
        return []
    return delay_linears_in(module, delay_wgrad=delay_wgrad)


def delay_linears_in(
    module: nn.Module,
    *,
    delay_wgrad: bool,
    skip: tuple[nn.Module, ...] = (),
    only: frozenset[int] | None = None,
) -> list[DelayedLinear]:
    """:func:`delay_linears` for every child of ``module`` (not under ``skip``; with
    ``only``, just the linears whose ``id`` it holds)."""
    found: list[DelayedLinear] = []
    for child_name, child in list(module.named_children()):
        if any(child is s for s in skip):
            continue
        if type(child) is nn.Linear or isinstance(child, DelayedLinear):
            if only is None or id(child) in only:
                found += delay_linears(module, child_name, delay_wgrad=delay_wgrad)
        else:
            found += delay_linears_in(child, delay_wgrad=delay_wgrad, skip=skip, only=only)
    return found


class WgradGroup:
    """Several delayed modules behind one ``backward_dw`` (a :class:`~moe_overlap.WgradLayer`)."""

    def __init__(self, modules: Sequence[DelayedWgradModule]) -> None:
        self.modules = tuple(modules)

    @property
    def label(self) -> str:
        """The modules' common place in the model (their labels' common prefix)."""
        return common_label(self.modules)

    @property
    def pending_wgrad(self) -> int:
        """Weight gradients the group still owes (a :class:`~moe_overlap.PendingWgrad`)."""
        return sum(m.pending_wgrad for m in self.modules)

    def backward_dw(self) -> None:
        """Each module's oldest pending weight gradient, last module first."""
        for module in reversed(self.modules):
            module.backward_dw()

    def delayed_modules(self) -> tuple[DelayedWgradModule, ...]:
        """The modules (a :class:`~moe_overlap.wgrad.HoldsDelayedModules`: a schedule
        listing the group claims them)."""
        return self.modules

    def parameters(self) -> Iterator[nn.Parameter]:
        for module in self.modules:
            yield from module.parameters()


def common_label(modules: Sequence[DelayedWgradModule]) -> str:
    """The longest dotted prefix of the modules' labels (the one label for one module)."""
    labels = [m.label.split(".") for m in modules]
    if not labels:
        return ""
    if len(labels) == 1:
        return ".".join(labels[0])
    common: list[str] = []
    for parts in zip(*labels, strict=False):
        if any(p != parts[0] for p in parts):
            break
        common.append(parts[0])
    return ".".join(common)


def _grouped(
    weight: nn.Parameter, *, delay_wgrad: bool, transposed: bool
) -> DelayedWgradGroupedLinear:
    groups, a, b = weight.shape
    in_features, out_features = (a, b) if transposed else (b, a)
    lin = DelayedWgradGroupedLinear(
        groups,
        in_features,
        out_features,
        delay_wgrad=delay_wgrad,
        transposed=transposed,
        device=_META,
    )
    lin.weight = weight
    return lin


def _param(module: nn.Module, name: str) -> nn.Parameter | None:
    value: object = getattr(module, name, None)
    return value if isinstance(value, nn.Parameter) else None


@dataclass(frozen=True, slots=True)
class ExpertLayout:
    """How a transformers experts module stores and applies its weights.

    The fields are the flags of transformers' ``use_experts_implementation``; a module
    without them gets them from its parameters (:meth:`of`).
    """

    has_gate: bool
    has_bias: bool
    is_transposed: bool
    has_post_expert_norm: bool

    @staticmethod
    def of(experts: nn.Module, hidden_size: int, where: str) -> ExpertLayout:
        """The module's declared flags, or flags read off its parameter shapes."""
        names = ("has_gate", "has_bias", "is_transposed", "has_post_expert_norm")
        flags: dict[str, object] = {k: getattr(experts, k, None) for k in names}
        up = _param(experts, "gate_up_proj")
        up = up if up is not None else _param(experts, "up_proj")
        down = _param(experts, "down_proj")
        if up is None or down is None or up.dim() != 3 or down.dim() != 3:
            raise ConfigError(
                f"{where}: expected 3-D gate_up_proj (or up_proj) and down_proj expert "
                "weights, received "
                + ", ".join(f"{n} {tuple(p.shape)}" for n, p in experts.named_parameters())
            )
        if all(isinstance(v, bool) for v in flags.values()):
            return ExpertLayout(**cast("dict[str, bool]", flags))
        return ExpertLayout(
            has_gate=_param(experts, "gate_up_proj") is not None,
            has_bias=_param(experts, "down_proj_bias") is not None,
            is_transposed=up.shape[1] == hidden_size and down.shape[2] == hidden_size,
            has_post_expert_norm=isinstance(getattr(experts, "post_expert_norm", None), nn.Module),
        )


def _act(experts: nn.Module) -> Callable[[Tensor], Tensor]:
    act: object = getattr(experts, "act_fn", None)
    if not callable(act):
        raise ConfigError(
            f"{type(experts).__name__}.act_fn: expected a callable, received {type(act).__name__}"
        )
    return cast("Callable[[Tensor], Tensor]", act)


class ExpertWeights:
    """A transformers experts module's forward, one GEMM per local expert, delayable wgrad.

    Rows arrive grouped by local expert (``sizes``, a :class:`~moe_overlap.blocks.GroupSizes`
    from the dispatcher); the output is each row's expert output, unweighted: up (or fused
    gate-up) projection, the module's own ``_apply_gate`` (or activation), down projection,
    per-expert biases and the module's post-expert norm, as the :class:`ExpertLayout` says.
    The weights are the module's own parameters. A :class:`~moe_overlap.WgradLayer`.
    """

    def __init__(self, experts: nn.Module, layout: ExpertLayout, *, delay_wgrad: bool) -> None:
        self.module = experts
        self.layout = layout
        up_name = "gate_up_proj" if layout.has_gate else "up_proj"
        up, down = _param(experts, up_name), _param(experts, "down_proj")
        assert up is not None  # ExpertLayout.of checked both
        assert down is not None
        t = layout.is_transposed
        self.gate_up = _grouped(up, delay_wgrad=delay_wgrad, transposed=t)
        self.down = _grouped(down, delay_wgrad=delay_wgrad, transposed=t)
        self.up_bias = _param(experts, f"{up_name}_bias") if layout.has_bias else None
        self.down_bias = _param(experts, "down_proj_bias") if layout.has_bias else None
        self.act = None if layout.has_gate and hasattr(experts, "_apply_gate") else _act(experts)
        self.local_experts = up.shape[0]

    def __call__(self, x_ND: Tensor, sizes: Sequence[int]) -> Tensor:
        """``sizes[l]`` rows of ``x_ND`` go to local expert ``l``, in order."""
        lay, experts = self.layout, self.module
        groups = sizes if isinstance(sizes, GroupSizes) else GroupSizes(sizes)
        h = self.gate_up(x_ND, groups)
        if self.up_bias is not None:
            h = h + self.up_bias.index_select(0, groups.group_ids(x_ND.device))
        if lay.has_gate and self.act is None:
            apply_gate = cast("Callable[[Tensor], Tensor]", getattr(experts, "_apply_gate"))  # noqa: B009
            h = apply_gate(h)
        elif lay.has_gate:
            assert self.act is not None
            gate_NF, up_NF = h.chunk(2, dim=-1)
            h = self.act(gate_NF) * up_NF
        else:
            assert self.act is not None
            h = self.act(h)
        out: Tensor = self.down(h, groups)
        if self.down_bias is not None:
            out = out + self.down_bias.index_select(0, groups.group_ids(x_ND.device))
        if lay.has_post_expert_norm:
            norm = cast("Callable[[Tensor], Tensor]", getattr(experts, "post_expert_norm"))  # noqa: B009
            out = norm(out)
        return out

    @property
    def label(self) -> str:
        """The experts module's place in the model (for error messages)."""
        return common_label(self.modules())

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

    def delayed_modules(self) -> tuple[DelayedWgradModule, ...]:
        """:meth:`modules` (a :class:`~moe_overlap.wgrad.HoldsDelayedModules`: a schedule
        listing the experts claims them)."""
        return (self.down, self.gate_up)
