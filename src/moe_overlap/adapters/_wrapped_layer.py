"""What the adapters' wrapped layers share, whatever library the model comes from.

An adapter wraps each layer of a model as a :class:`~moe_overlap.SchedulableLayer`:
:class:`WrappedLayer` holds the layer, its index and the free-input config, names the layer
and slot in error messages (:meth:`~WrappedLayer.where`, each adapter's own format), counts
and drops the delayed modules' pending weight gradients, and hands combine the residual
pre-dispatch kept. :class:`WrappedDenseLayer` is a layer without routed experts: its
``forward``, whole, in pre-dispatch; the other three slots pass their inputs through.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from moe_overlap import CudaGraphModule, IntegrationError, WgradLayer, WgradScope
from moe_overlap.adapters._hf_experts import WgradGroup
from moe_overlap.blocks import DelayedWgradModule, DenseSlots, SlotContext, single_input
from moe_overlap.engine import ChunkState
from moe_overlap.protocols import FreeInputConfig

__all__ = ["WrappedDenseLayer", "WrappedLayer", "wgrad_scopes"]


class WrappedLayer:
    """A model's layer as the schedule's slots see it: identity and wgrad bookkeeping."""

    is_moe: bool

    def __init__(self, layer: nn.Module, index: int, config: FreeInputConfig) -> None:
        self.layer = layer
        self.index = index
        self.config = config

    def where(self, slot: str) -> str:
        """The layer and slot, as error messages name them."""
        raise NotImplementedError

    def delayed_modules(self) -> tuple[DelayedWgradModule, ...]:
        """Every delayable module of the layer (what ``pending_wgrad`` counts)."""
        raise NotImplementedError

    @property
    def pending_wgrad(self) -> int:
        """Weight gradients the layer's delayed modules still owe (a
        :class:`~moe_overlap.PendingWgrad`)."""
        return sum(m.pending_wgrad for m in self.delayed_modules())

    def discard_wgrad(self) -> None:
        """Drop the pending weight gradients of every delayed module (after a failed step)."""
        for module in self.delayed_modules():
            module.discard_wgrad()

    def take_residual(self, ctx: SlotContext) -> Tensor:
        """The residual pre-dispatch kept for combine, dropped from the layer state; an
        :class:`~moe_overlap.IntegrationError` naming the layer when there is none."""
        state = ctx.layer_state
        residual = state.residual
        if residual is None:
            raise IntegrationError(
                f"{self.where('combine')}: expected the residual from pre_dispatch, received None"
            )
        state.residual = None
        return residual


class WrappedDenseLayer(DenseSlots, WrappedLayer):
    """A layer without routed experts: :meth:`forward`, whole, in pre-dispatch; its
    delayed modules, one group, are the attention's wgrad scope."""

    group: WgradGroup

    def forward(self, x: Tensor, chunk_state: ChunkState, /) -> Tensor:
        """The model's own layer on ``x`` with the microbatch's arguments."""
        raise NotImplementedError

    def slot_pre_dispatch(self, node: SlotContext, inputs: tuple[Tensor, ...], /) -> Tensor:
        return self.forward(single_input(inputs, self.where("pre_dispatch")), node.chunk_state)

    def slot_mlp(self, node: SlotContext, inputs: tuple[Tensor, ...], /) -> tuple[Tensor, ...]:
        del node
        return inputs

    def run_plain(self, x: Tensor, chunk_state: ChunkState) -> Tensor:
        return self.forward(x, chunk_state)

    def pre_dispatch_wgrad(self) -> Sequence[WgradScope]:
        return wgrad_scopes((CudaGraphModule.attn, self.group))

    def mlp_wgrad(self) -> Sequence[WgradLayer]:
        return []

    def delayed_modules(self) -> tuple[DelayedWgradModule, ...]:
        return self.group.modules


def wgrad_scopes(*groups: tuple[CudaGraphModule, WgradGroup]) -> list[WgradScope]:
    """A scope for each group that holds delayed modules, in the order given."""
    return [WgradScope(part, group) for part, group in groups if group.modules]
