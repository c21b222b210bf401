"""Delayed weight gradients of the pre-dispatch slot (its parts are
:class:`~moe_overlap.WgradScope` s, defined with the Protocols)."""

from collections.abc import Callable, Iterator, Sequence
from typing import cast

from torch.nn import Parameter

from moe_overlap.engine._conformance import Indexed, already_checked, check_wgrad_layer, named
from moe_overlap.engine.contracts import WGRAD_LAYER

from ._errors import IntegrationError
from ._free_input import graph_module_names
from ._options import Hook
from ._protocols import CudaGraphModule, GraphedWgradLayer, SchedulableLayer, WgradScope

__all__ = ["BackwardDWWrapper", "_BackwardDWWrapper", "check_wgrad_scopes"]


class BackwardDWWrapper:
    """Delayed weight gradients of a layer's pre-dispatch slot (attention, shared expert, ...).

    Runs each part's ``backward_dw`` in order, skipping the parts whose scope a graphed
    replay covers once :meth:`~moe_overlap.BackwardDWWrapper.set_graphed_backward_dw_callable` has plugged one in, then
    the replay itself. A :class:`~moe_overlap.WgradLayer`.
    """

    def __init__(self, layer: SchedulableLayer) -> None:
        parts = layer.pre_dispatch_wgrad()
        self.parts: tuple[WgradScope, ...] = (
            ()
            if isinstance(parts, (list, tuple)) and not parts  # nothing delayed: nothing to check
            else check_wgrad_scopes(parts, lambda: f"{type(layer).__name__}.pre_dispatch_wgrad()")
        )
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


def check_wgrad_scopes(parts: object, where: str | Callable[[], str]) -> tuple[WgradScope, ...]:
    """``parts`` as a tuple of :class:`~moe_overlap.WgradScope` s, or raise naming the bad one.

    ``where`` names the list in errors (a callable is called only then).
    """
    if isinstance(parts, (list, tuple)) or (
        isinstance(parts, Sequence) and not isinstance(parts, (str, bytes))
    ):
        items = tuple(cast("Sequence[object]", parts))
    else:
        raise IntegrationError(
            f"{named(where)}: expected a sequence of WgradScope(scope, module), "
            f"received {type(parts).__name__}"
        )
    for i, part in enumerate(items):
        if not isinstance(part, WgradScope):
            raise IntegrationError(
                f"{named(where)}[{i}]: expected a WgradScope(scope, module) naming the "
                f"CUDA-graph scope that covers the module, received {type(part).__name__}; "
                "wrap it: WgradScope(CudaGraphModule.attn, module)"
            )
        if not isinstance(part.scope, CudaGraphModule):  # pyright: ignore[reportUnnecessaryIsInstance]
            raise IntegrationError(
                f"{named(where)}[{i}].scope: expected a CudaGraphModule, "
                f"received {type(part.scope).__name__} {part.scope!r}"
            )
        if not already_checked(part.module, WGRAD_LAYER):
            check_wgrad_layer(part.module, Indexed(lambda: named(where), i, ".module"))
    return cast("tuple[WgradScope, ...]", items)


_BackwardDWWrapper = BackwardDWWrapper
