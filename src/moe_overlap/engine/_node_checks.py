"""Checks a node runs on what its forward returned: still in the graph, not freed early.

Cheap ones run on every forward (a few attribute reads per tensor). The saved-tensor
check walks the autograd graph around a freeing node and runs in debug mode only
(``docs/debug.md``); it must run at forward, since a backward that reads released memory
crashes the process instead of raising.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import cast

import torch
from torch import Tensor

from ._errors import IntegrationError

__all__ = [
    "FREED_MEMORY_HINT",
    "METADATA_ONLY_SAVES",
    "check_in_graph",
    "check_kept_in_graph",
    "check_no_alias",
    "check_not_saved",
    "check_own_leaves",
    "freed_memory_hint",
    "graph_saves",
    "walk_graph",
]

FREED_MEMORY_HINT = (
    "hint: a tensor released by the free-input policy was read again (a slot returned or "
    "kept its input, or autograd saved it for backward); rerun with MOE_OVERLAP_DEBUG=1 to "
    "find the slot at forward, see the free-input rules in docs/integrate.md, or pass "
    "ScheduleOptions(free_input=False)"
)

# What torch says when a kernel touches a storage that ``resize_(0)`` emptied.
_FREED_MESSAGES = ("data is not allocated yet", "setStorage", "out of bounds for storage")


def freed_memory_hint(exc: BaseException) -> str:
    """:data:`FREED_MEMORY_HINT` when ``exc`` looks like a read of freed input memory."""
    text = str(exc)
    return FREED_MEMORY_HINT if any(m in text for m in _FREED_MESSAGES) else ""


def _describe(t: Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def check_in_graph(
    name: str,
    inputs: Sequence[Tensor | None],
    outputs: Sequence[Tensor],
    allowed: Sequence[Tensor],
) -> None:
    """Raise if a floating output does not require grad while an input does.

    Called only when some output does not require grad (the hot path reads one flag per
    output). ``allowed`` holds outputs marked non-differentiable, compared by identity.
    """
    if not any(t is not None and t.requires_grad for t in inputs):
        return
    for i, out in enumerate(outputs):
        if out.requires_grad or not (out.is_floating_point() or out.is_complex()):
            continue
        if any(out is t for t in allowed):
            continue
        raise IntegrationError(
            f"node {name!r}: output {i} ({_describe(out)}) does not require grad although "
            "the node's inputs do, so backward would silently give nothing through it; "
            "expected it to stay in the autograd graph (was it made under torch.no_grad(), "
            "with .detach() or .data?). If it carries no gradient on purpose, call "
            "node.mark_non_differentiable(t) on it in the slot"
        )


def check_kept_in_graph(
    name: str,
    inputs: Sequence[Tensor | None],
    kept: Sequence[tuple[str, Tensor]],
    allowed: Sequence[Tensor],
) -> None:
    """Raise if the slot kept a float tensor without grad for a later slot while its inputs
    need grad: the gradient that slot sends back through it would be silently lost."""
    if not any(t is not None and t.requires_grad for t in inputs):
        return
    for where, t in kept:
        if any(t is a for a in allowed):
            continue
        raise IntegrationError(
            f"node {name!r}: layer_state.{where} ({_describe(t)}) does not require grad "
            "although the node's inputs do, so the gradient a later slot sends back through "
            "it would silently be lost; expected a tensor still in the autograd graph, handed "
            "on with node.detach(t) (not t.detach() or torch.no_grad()). If it carries no "
            "gradient on purpose, call node.mark_non_differentiable(t) on it in the slot"
        )


def check_no_alias(
    name: str,
    storages: Sequence[torch.UntypedStorage],
    outputs: Sequence[Tensor],
    handed_on: Sequence[Tensor | None],
) -> None:
    """Raise if an output or a handed-on tensor lives in an input storage about to be freed."""
    freed = {s.data_ptr(): i for i, s in enumerate(storages)}
    freed.pop(0, None)  # empty storages have no memory to lose
    if not freed:
        return
    for kind, tensors in (("output", outputs), ("tensor kept for a later slot", handed_on)):
        for i, t in enumerate(tensors):
            if t is None:
                continue
            j = freed.get(t.untyped_storage().data_ptr())
            if j is not None:
                raise IntegrationError(
                    f"node {name!r}: {kind} {i} ({_describe(t)}) shares storage with input "
                    f"{j}, which the free-input policy releases right after this slot "
                    f"(should_free_input is true for {name!r}); expected a fresh buffer: "
                    "return or keep a copy (e.g. .clone(), or the all-to-all's receive "
                    "buffer), or pass ScheduleOptions(free_input=False)"
                )


# (autograd node, saved attribute) pairs whose backward reads only the tensor's metadata
# (sizes), which outlives the release: index_add and index_copy keep their source for
# ``expand_as``.
METADATA_ONLY_SAVES = frozenset(
    {("IndexAddBackward0", "_saved_source"), ("IndexCopyBackward0", "_saved_source")}
)


def graph_saves(roots: Sequence[object], pointers: set[int]) -> list[str]:
    """Where the autograd graph below ``roots`` saved a tensor living in ``pointers``.

    Walks ``grad_fn`` nodes through ``next_functions`` and reads their saved tensors
    (``_saved_*`` of built-in nodes, ``saved_tensors`` of custom Functions); returns
    ``"NodeName.field"`` for each hit, except :data:`METADATA_ONLY_SAVES`. A saved tensor
    behind an unpack hook (activation checkpointing, offloading) is not read: unpacking it
    would recompute (or consume) it. A region's own inputs are guarded instead where it is
    made with :func:`moe_overlap.blocks.recompute` (a freeing node refuses to release
    them); one made with ``torch.utils.checkpoint`` directly is not. Debug mode only: it
    touches every node of the graph.
    """
    found: list[str] = []
    for fn in walk_graph(roots):
        kind = type(fn).__name__
        for attr in dir(fn):
            if not (attr.startswith("_saved_") or attr == "saved_tensors"):
                continue
            if (kind, attr) in METADATA_ONLY_SAVES or _behind_hooks(fn, attr):
                continue
            try:
                value: object = getattr(fn, attr)
            except RuntimeError:  # saved tensors already released
                continue
            values = (
                cast("tuple[object, ...]", value) if isinstance(value, (tuple, list)) else (value,)
            )
            for t in values:
                if isinstance(t, Tensor) and t.untyped_storage().data_ptr() in pointers:
                    found.append(f"{kind}.{attr.removeprefix('_saved_')}")
    return found


def _behind_hooks(fn: object, attr: str) -> bool:
    """Whether the saved tensor(s) ``attr`` of ``fn`` unpack through a saved-tensor hook."""
    raw_name = "_raw_saved_tensors" if attr == "saved_tensors" else f"_raw{attr}"
    try:
        raw: object = getattr(fn, raw_name, None)
    except RuntimeError:  # released
        return False
    items = cast("tuple[object, ...]", raw) if isinstance(raw, (tuple, list)) else (raw,)
    return any(getattr(r, "unpack_hook", None) is not None for r in items)


def check_not_saved(
    name: str,
    storages: Sequence[torch.UntypedStorage],
    inputs: Sequence[Tensor | None],
    graph_roots: Sequence[object],
) -> None:
    """Debug mode: raise if autograd saved (a view of) an input the node is about to free.

    Looks at the graph that produced the inputs (the previous node's) and at this node's
    own (``graph_roots``: its outputs' and handed-on tensors' ``grad_fn``). Backward would
    read freed memory there, which crashes the process (a segfault on CPU, an illegal
    memory access on CUDA) rather than raising.
    """
    pointers = {s.data_ptr() for s in storages} - {0}
    if not pointers:
        return
    producer = [t.grad_fn for t in inputs if t is not None]
    hits = graph_saves([*producer, *graph_roots], pointers)
    if hits:
        raise IntegrationError(
            f"node {name!r}: the free-input policy releases this node's inputs after forward, "
            f"but autograd saved one of them (or a view) for backward: {sorted(set(hits))}; "
            "backward would read freed memory. Expected the tensors a freeing slot receives "
            "to be needed by no backward: have the previous slot hand over a fresh tensor "
            "(e.g. .clone(), or the all-to-all's receive buffer) and compute this slot on a "
            "copy (e.g. the experts on a permuted copy), or pass "
            "ScheduleOptions(free_input=False) (checked in debug mode)"
        )


def check_own_leaves(name: str, roots: Sequence[object], allowed: Sequence[Tensor]) -> None:
    """Debug mode: raise if a slot's graph reaches a leaf that is neither a parameter, nor
    the slot's own input, nor a tensor some slot of the layer handed on with ``node.detach``.

    Such a leaf is another node's input, reached through a tensor passed between slots
    without ``node.detach``: its gradient would then be accumulated by two backward passes
    in another order than plain ``backward()`` (or the shared graph run twice).
    """
    ok = {id(t) for t in allowed}
    for fn in walk_graph(roots):
        leaf: object = getattr(fn, "variable", None)
        if not (isinstance(leaf, Tensor) and type(fn).__name__ == "AccumulateGrad"):
            continue
        if isinstance(leaf, torch.nn.Parameter) or id(leaf) in ok:
            continue
        raise IntegrationError(
            f"node {name!r}: its outputs depend on a tensor ({_describe(leaf)}) that is "
            "not a parameter, not one of its inputs and not handed on with node.detach: "
            "a tensor from another slot (or another microbatch) used as it is, so its "
            "gradient would not be computed as plain backward() computes it; expected "
            "tensors passed between slots to go through node.detach(t) (checked in "
            "debug mode)"
        )


def walk_graph(roots: Sequence[object]) -> Iterator[object]:
    """Every autograd node below ``roots`` (through ``next_functions``), each once.

    Holds the nodes it has visited: torch may build a node's Python object on each access
    and drop it after, so an ``id()`` is only unique (and a revisit recognised) while it
    lives.
    """
    seen: dict[int, object] = {}
    stack = [r for r in roots if r is not None]
    while stack:
        fn = stack.pop()
        if id(fn) in seen:
            continue
        seen[id(fn)] = fn
        yield fn
        nexts = cast("tuple[tuple[object, int], ...]", getattr(fn, "next_functions", ()))
        stack += [nxt for nxt, _ in nexts if nxt is not None]
