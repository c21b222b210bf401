"""What a slot sees of its node, and the plain path's stand-in for it."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import Tensor

from moe_overlap import ChunkState, IntegrationError, LayerState

__all__ = [
    "DenseSlots",
    "PlainContext",
    "SlotContext",
    "add_residual",
    "pair_input",
    "single_input",
]


@runtime_checkable
class SlotContext(Protocol):
    """What a slot reads from its node; :class:`~moe_overlap.TransformerLayerNode` is one.

    Writing a layer's math against this (not the node) lets the plain path run the very
    same code with a :class:`PlainContext`.
    """

    @property
    def layer_state(self) -> LayerState: ...
    @property
    def chunk_state(self) -> ChunkState: ...
    def detach(self, t: Tensor) -> Tensor: ...


class PlainContext:
    """The slot context of the plain (unscheduled) path: ``detach`` keeps the graph whole."""

    def __init__(self, chunk_state: ChunkState) -> None:
        self.layer_state = LayerState()
        self.chunk_state = chunk_state

    def detach(self, t: Tensor) -> Tensor:
        return t


def single_input(inputs: tuple[Tensor, ...], where: str) -> Tensor:
    """The one tensor a slot takes, or an :class:`~moe_overlap.IntegrationError` naming it."""
    if len(inputs) != 1:
        raise IntegrationError(f"{where}: expected 1 input tensor, received {len(inputs)}")
    return inputs[0]


def pair_input(inputs: tuple[Tensor, ...], where: str) -> tuple[Tensor, Tensor]:
    """The ``(tokens, probs)`` a dispatch slot takes, or an :class:`~moe_overlap.IntegrationError`."""
    if len(inputs) != 2:
        raise IntegrationError(
            f"{where}: expected 2 inputs (tokens, probs), received {len(inputs)}"
        )
    return inputs[0], inputs[1]


def add_residual(ctx: SlotContext, moe_TD: Tensor, where: str, *, shared: bool) -> Tensor:
    """Combine's last step: ``residual + (moe + shared_expert_output)``, as ``[B, S, D]``.

    Reads ``layer_state.residual`` (and ``shared_expert_output`` when ``shared``), which
    pre-dispatch kept through ``ctx.detach``, then drops both references. Raises
    :class:`~moe_overlap.IntegrationError` naming ``where`` when one is missing.
    """
    state = ctx.layer_state
    residual = state.residual
    if residual is None:
        raise IntegrationError(f"{where}: expected the residual from pre_dispatch, received None")
    if shared:
        shared_TD = state.shared_expert_output
        if shared_TD is None:
            raise IntegrationError(
                f"{where}: expected the shared expert output from pre_dispatch, received None"
            )
        moe_TD = moe_TD + shared_TD.view(moe_TD.shape)
    state.residual = None
    state.shared_expert_output = None
    return residual + moe_TD.view(residual.shape)


class DenseSlots:
    """Mixin for a dense (non-MoE) layer: dispatch and combine pass their inputs through.

    The layer defines ``slot_pre_dispatch`` and ``slot_mlp``; the schedule still runs the
    four slots, two of them empty.
    """

    is_moe = False
    num_local_experts: int | None = None

    def slot_dispatch(self, node: SlotContext, inputs: tuple[Tensor, ...], /) -> tuple[Tensor, ...]:
        del node
        return inputs

    def slot_combine(self, node: SlotContext, inputs: tuple[Tensor, ...], /) -> tuple[Tensor, ...]:
        del node
        return inputs
