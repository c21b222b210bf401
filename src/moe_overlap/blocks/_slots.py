"""What a slot sees of its node, and the plain path's stand-in for it."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import Tensor

from moe_overlap import ChunkState, IntegrationError, LayerState

__all__ = ["PlainContext", "SlotContext", "single_input"]


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
