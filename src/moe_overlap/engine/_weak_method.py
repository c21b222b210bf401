"""A bound method held weakly (:func:`weak_method`): what a node stores as its work without a
reference cycle through its owner."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import ParamSpec, TypeVar, cast

from moe_overlap.errors import IntegrationError, NodeStateError

__all__ = ["weak_method"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


def weak_method(method: Callable[_P, _R]) -> Callable[_P, _R]:
    """Wrap a bound method so that the wrapper holds its owner weakly.

    A node that stores its own bound ``forward_impl`` would form a reference cycle
    (node -> bound method -> node) that only the cyclic garbage collector can break; with
    this wrapper the node, its layer plan and the model chunk behind it die by reference
    counting as soon as the schedule drops them.
    """
    if getattr(method, "__self__", None) is None or getattr(method, "__func__", None) is None:
        raise IntegrationError(
            f"weak_method: expected a bound method, received {method!r} "
            f"of type {type(method).__name__}"
        )
    # Typed as forwarding anything: the wrapper passes on exactly what it receives. The
    # casts are string-typed so no typing object is built per call (this is per node).
    ref = cast("weakref.WeakMethod[Callable[..., object]]", weakref.WeakMethod(method))
    name: str = getattr(method, "__qualname__", None) or type(method).__name__

    def call(*args: object, **kwargs: object) -> object:
        bound = ref()
        if bound is None:
            raise NodeStateError(f"weak_method: the owner of {name} was garbage-collected")
        return bound(*args, **kwargs)

    call.__qualname__ = f"weak_method({name})"
    return cast("Callable[_P, _R]", call)
