"""What a node raises itself: ``mark_non_differentiable``'s argument check.

The checks a node's path runs on what it computed are guards (``engine/_node_checks.py``,
attached at the core's hooks), as is the rewording of torch's "backward through the graph
a second time" a layer node's backward caught; this one belongs to the node: it checks its
own method's arguments.
"""

from __future__ import annotations

from typing import cast

from torch import Tensor

from moe_overlap.errors import IntegrationError

__all__ = ["check_marked"]


def check_marked(tensors: tuple[object, ...], *, node: str = "", where: str = "") -> None:
    """``mark_non_differentiable``'s arguments: tensors, each its own argument (one
    ``isinstance`` per argument). A tuple or list of them is named as such. The message
    names ``node`` (a node's name) or ``where``."""
    for i, t in enumerate(tensors):
        if isinstance(t, Tensor):
            continue
        who = f"node {node!r}" if node else where
        if isinstance(t, (tuple, list)):
            items = cast("tuple[object, ...] | list[object]", t)
            kinds = ", ".join(sorted({type(v).__name__ for v in items})) or "empty"
            raise IntegrationError(
                f"{who}: mark_non_differentiable: expected tensors as separate arguments, "
                f"received a {type(items).__name__} of {len(items)} items ({kinds}) as "
                f"argument {i}; call mark_non_differentiable(*tensors)"
            )
        raise IntegrationError(
            f"{who}: mark_non_differentiable: expected tensors (the ones that carry no "
            f"gradient on purpose), received {type(t).__name__} as argument {i}"
        )
