"""The layer Protocol: what makes any layer schedulable.

A layer is cut into four slots that run, in forward order::

    pre_dispatch (compute) -> dispatch (comm) -> mlp (compute) -> combine (comm)

Each slot is a method ``slot_*(node, inputs) -> outputs``: ``node`` is the
:class:`~moe_overlap.TransformerLayerNode` running it (read ``node.chunk_state`` for the
attention mask and rotary embeddings, keep per-microbatch values in ``node.layer_state``,
and pass a tensor to a later slot with ``node.detach(t)``); ``inputs`` are the previous
slot's outputs. Dense layers (``is_moe`` false) have no dispatch/combine: their
pre-dispatch output goes straight to ``slot_mlp``, whose output is the layer's output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from torch import Tensor

from ._free_input import FreeInputConfig
from ._layer_node import TransformerLayerNode, WgradScope
from ._protocols import WgradLayer

__all__ = ["MtpSchedulableLayer", "SchedulableLayer"]


@runtime_checkable
class SchedulableLayer(Protocol):
    """A layer the schedule can split into slots.

    Members:
        config: the layer's free-input configuration.
        is_moe: true for MoE layers (dispatch/combine run on the comm stream).
        num_local_experts: experts held on this rank; ``None`` for dense layers.
        slot_*: the four slot functions (see the module docstring).
        pre_dispatch_wgrad: modules whose weight gradients the pre-dispatch slot delays,
            each tagged with the CUDA-graph scope that covers it (attention first, then
            anything else, e.g. a shared expert); empty when nothing is delayed.
        mlp_wgrad: modules whose weight gradients the mlp slot delays (routed experts).
    """

    @property
    def config(self) -> FreeInputConfig: ...
    @property
    def is_moe(self) -> bool: ...
    @property
    def num_local_experts(self) -> int | None: ...

    def slot_pre_dispatch(
        self, node: TransformerLayerNode, inputs: tuple[Tensor, ...], /
    ) -> Tensor | tuple[Tensor, ...]: ...
    def slot_dispatch(
        self, node: TransformerLayerNode, inputs: tuple[Tensor, ...], /
    ) -> Tensor | tuple[Tensor, ...]: ...
    def slot_mlp(
        self, node: TransformerLayerNode, inputs: tuple[Tensor, ...], /
    ) -> Tensor | tuple[Tensor, ...]: ...
    def slot_combine(
        self, node: TransformerLayerNode, inputs: tuple[Tensor, ...], /
    ) -> Tensor | tuple[Tensor, ...]: ...
    def pre_dispatch_wgrad(self) -> Sequence[WgradScope]: ...
    def mlp_wgrad(self) -> Sequence[WgradLayer]: ...


@runtime_checkable
class MtpSchedulableLayer(SchedulableLayer, Protocol):
    """A multi-token-prediction layer: a schedulable layer with a post-process slot."""

    def slot_mtp_post_process(
        self, node: TransformerLayerNode, inputs: tuple[Tensor, ...], /
    ) -> Tensor | tuple[Tensor, ...]: ...
