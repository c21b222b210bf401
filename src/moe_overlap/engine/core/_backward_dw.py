"""Delayed weight gradients of the pre-dispatch slot (its parts are
:class:`~moe_overlap.WgradScope` s, defined with the Protocols)."""

from collections.abc import Iterator

from torch.nn import Parameter

from moe_overlap.protocols import GraphedWgradLayer, SchedulableLayer, WgradScope

from ._free_input import graph_module_names
from ._hooks import on_pre_dispatch_wgrad_listed
from ._options import Hook

__all__ = ["BackwardDWWrapper"]


class BackwardDWWrapper:
    """Delayed weight gradients of a layer's pre-dispatch slot (attention, shared expert, ...).

    Runs each part's ``backward_dw`` in order, skipping the parts whose scope a graphed
    replay covers once :meth:`~moe_overlap.BackwardDWWrapper.set_graphed_backward_dw_callable` has plugged one in, then
    the replay itself. A :class:`~moe_overlap.WgradLayer`.
    """

    def __init__(self, layer: SchedulableLayer) -> None:
        parts = layer.pre_dispatch_wgrad()
        if not isinstance(parts, (list, tuple)) or parts:  # nothing delayed: nothing to check
            for guard in on_pre_dispatch_wgrad_listed:  # WgradScopes (moe_overlap.engine._guards)
                guard.pre_dispatch_wgrad_listed(
                    layer, parts, lambda: f"{type(layer).__name__}.pre_dispatch_wgrad()"
                )
        self.parts: tuple[WgradScope, ...] = tuple(parts)
        self.graphed_modules = graph_module_names(layer.config.cuda_graph_modules)
        self.graphed_backward_dw_callable: Hook | None = None
        if self.parts and isinstance(layer, GraphedWgradLayer):
            replay = layer.graphed_backward_dw_callable()
            if replay is not None:
                self.set_graphed_backward_dw_callable(replay)

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
