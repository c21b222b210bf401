"""Schedule options and hook types."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from torch import Tensor

from ._arguments import on_arguments
from ._kinds import Slot
from ._order import ScheduleOrder

_MEGATRON_ORDER = ScheduleOrder()

__all__ = [
    "ChunkHooks",
    "Hook",
    "PostBackwardHook",
    "PostForwardHook",
    "PreHook",
    "ScheduleOptions",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleOptions:
    """How a schedule runs.

    Attributes:
        delay_wgrad_compute: ``None`` (the default): follow the layers, which delay the
            weight gradients of exactly the modules their ``pre_dispatch_wgrad()`` /
            ``mlp_wgrad()`` list (Megatron-Core's ``--delay-wgrad-compute``); the schedule
            places those ``backward_dw`` steps to fill communication gaps. ``True`` /
            ``False`` states what every layer must do: a layer that disagrees is a
            :class:`~moe_overlap.ConfigError` at plan construction.
        ep_overlap_early_attn_memory_release: run the pre-dispatch backward before the
            other microbatch's mlp forward, releasing attention activations earlier at the
            price of less overlap.
        free_input: apply the free-input policy (:func:`~moe_overlap.should_free_input`);
            off keeps every input, for comparing peak memory.
        order: the order of the paired runs' steps (:class:`~moe_overlap.steps.ScheduleOrder`;
            the default is Megatron-Core's). Every order it accepts gives the same bits;
            :func:`~moe_overlap.steps.search_order` picks one from measured durations.
        recompute: the layer slots the schedule recomputes, ``Slot.PRE_DISPATCH`` and/or
            ``Slot.MLP`` or their names (``("pre_dispatch", "mlp")``), kept as ``Slot`` s in
            that order; ``()`` (the default) recomputes none. A recomputed slot keeps only
            its inputs (never freed) and what it hands on after its forward, drops its
            autograd graph, and runs again with autograd, on the same random state, before
            its backward: at an ``R`` step where the order lists one (``b.mlp.R``), else at
            the start of its backward. Dispatch and combine are communication and cannot
            be recomputed. The results are bit-identical.
    """

    delay_wgrad_compute: bool | None = None
    ep_overlap_early_attn_memory_release: bool = False
    free_input: bool = True
    order: ScheduleOrder = _MEGATRON_ORDER
    recompute: tuple[Slot | Literal["pre_dispatch", "mlp"], ...] = ()

    def __post_init__(self) -> None:
        for guard in on_arguments:  # its fields (moe_overlap.engine._guards)
            guard.arguments("ScheduleOptions", self)
        given = self.recompute  # kept as Slots, once each, in the layer's order
        object.__setattr__(self, "recompute", tuple(s for s in _RECOMPUTABLE if s in given))


_RECOMPUTABLE = (Slot.PRE_DISPATCH, Slot.MLP)
"""The slots a schedule can recompute, in the order they are stored."""


Hook = Callable[[], None]
"""A layer node's post-forward / post-backward hook, or a graphed wgrad replay."""

PreHook = Callable[["int | None"], None]
"""``pre_forward`` / ``pre_backward``: called with the chunk's virtual-pipeline stage."""

PostForwardHook = Callable[[Tensor, "int | None"], None]
"""``post_forward``: called with the last layer's output (before post-process) and the stage."""

PostBackwardHook = Callable[["Tensor | None", "int | None"], None]
"""``post_backward``: called with the grad of the chunk input (before pre-process backward)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkHooks:
    """The pipeline (p2p) hooks of :meth:`ModelChunkSchedulePlan.run`."""

    pre_forward: PreHook | None = None
    pre_backward: PreHook | None = None
    post_forward: PostForwardHook | None = None
    post_backward: PostBackwardHook | None = None

    def __post_init__(self) -> None:
        for guard in on_arguments:  # each None or callable
            guard.arguments("ChunkHooks", self)
