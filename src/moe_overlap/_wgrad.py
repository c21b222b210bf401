"""Delayed weight gradients of the pre-dispatch slot, and what covers them.

No ``from __future__ import annotations`` here: the NamedTuple's field types must be real
objects at run time for debug mode's checks.
"""

from collections.abc import Iterator
from typing import NamedTuple

from torch.nn import Parameter

from ._free_input import CudaGraphModule, graph_module_names
from ._options import Hook
from ._protocols import SchedulableLayer, WgradLayer

__all__ = ["BackwardDWWrapper", "WgradScope", "_BackwardDWWrapper"]


class WgradScope(NamedTuple):
    """A pre-dispatch wgrad module and the CUDA-graph scope that covers it."""

    scope: CudaGraphModule
    module: WgradLayer


class BackwardDWWrapper:
    """Delayed weight gradients of a layer's pre-dispatch slot (attention, shared expert, ...).

    Runs each part's ``backward_dw`` in order, skipping the parts whose scope a graphed
    replay covers once :meth:`~moe_overlap.BackwardDWWrapper.set_graphed_backward_dw_callable` has plugged one in, then
    the replay itself. A :class:`~moe_overlap.WgradLayer`.
    """

    def __init__(self, layer: SchedulableLayer) -> None:
        self.parts = tuple(layer.pre_dispatch_wgrad())
        self.graphed_modules = graph_module_names(layer.config.cuda_graph_modules)
        self.graphed_backward_dw_callable: Hook | None = None

    def backward_dw(self) -> None:
        """Run eager wgrad for the parts the graph does not cover, then the graph's."""
        replay = self.graphed_backward_dw_callable
        for part in self.parts:
            if replay is None or part.scope.name not in self.graphed_modules:
                part.module.backward_dw()
        if replay is not None:
            replay()

    def set_graphed_backward_dw_callable(self, graphed_backward_dw_callable: Hook) -> None:
        """Plug in the CUDA-graph wgrad replay."""
        self.graphed_backward_dw_callable = graphed_backward_dw_callable

    def parameters(self) -> Iterator[Parameter]:
        """The parameters of every part (so post-wgrad hooks can be collected)."""
        for part in self.parts:
            yield from part.module.parameters()


_BackwardDWWrapper = BackwardDWWrapper
