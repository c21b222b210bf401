"""What a node raises itself: ``mark_non_differentiable``'s argument check, and torch's
"backward through the graph a second time" said in the library's words.

The checks a node's path runs on what it computed are guards (``engine/_node_checks.py``,
attached at the core's hooks); these two belong to the node: the one checks its own
method's arguments, the other rewords an error its backward caught.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from torch import Tensor

from moe_overlap.errors import IntegrationError

__all__ = ["SECOND_BACKWARD", "check_marked", "describe_tensor", "second_backward_error"]


def describe_tensor(t: Tensor) -> str:
    """A tensor in a message: its dtype and shape (``float32[2, 4]``)."""
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


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


SECOND_BACKWARD = "Trying to backward through the graph a second time"
"""The start of torch's message when a backward runs into graph an earlier one freed."""


def second_backward_error(
    name: str, exc: BaseException, undetached: Sequence[tuple[str, Tensor, object, str]]
) -> IntegrationError | None:
    """The library's error for torch's "backward through the graph a second time" raised
    in node ``name``'s backward (``None`` for any other exception): two nodes' backward
    passes shared one graph, a tensor handed between slots without ``node.detach``."""
    if not isinstance(exc, RuntimeError) or SECOND_BACKWARD not in str(exc):
        return None
    mine = [
        f"{label} ({describe_tensor(t)})"
        for label, t, _, producer in undetached
        if producer == name
    ]
    known = f" This slot kept {', '.join(mine)} with its autograd graph." if mine else ""
    return IntegrationError(
        f"node {name!r}: its backward ran into autograd graph that another backward already "
        f"ran through and freed (torch: {SECOND_BACKWARD}): most likely a tensor was handed "
        "between this slot and another slot (or another microbatch) without node.detach "
        "(kept on a module, in a closure or in a container), so the two slots' backward "
        f"passes share one graph.{known} Expected every tensor a later slot reads to be kept "
        "in layer_state as node.detach(t) by the slot that computed it; MOE_OVERLAP_DEBUG=1 "
        "names the slot that reads it, at its forward"
    )
