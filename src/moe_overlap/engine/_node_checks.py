"""Checks a node runs on what its forward returned: still in the graph, not freed early.

Cheap ones run on every forward (a few attribute reads and identity or reference-count
comparisons per tensor). Before a freeing node releases its inputs, the reference counts
of their storage and tensors are compared with the schedule's own references; only when
something else holds one does :func:`check_release` walk the autograd graph around the node
to name it (in debug mode it always does, ``docs/debug.md``). It must run at forward,
since a backward that reads released memory crashes the process instead of raising.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import Tensor

from moe_overlap.errors import IntegrationError

from ._torch_private import storage_cdata, storage_use_count, tensor_use_count
from ._torch_private import tensor_base as _base
from .core._state import LayerState

__all__ = [
    "METADATA_ONLY_SAVES",
    "SECOND_BACKWARD",
    "check_copies_unused",
    "check_handoffs",
    "check_in_graph",
    "check_no_alias",
    "check_not_saved",
    "check_own_leaves",
    "check_release",
    "check_undetached_reads",
    "graph_saves",
    "second_backward_error",
    "storage_use_count",
    "tensor_use_count",
    "walk_graph",
]


def _describe(t: Tensor) -> str:
    """A tensor in a message: its dtype and shape (``float32[2, 4]``)."""
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


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
    mine = [f"{label} ({_describe(t)})" for label, t, _, producer in undetached if producer == name]
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


def _kept_label(key: str, stashed: bool) -> str:
    return f"layer_state.stash({key!r})" if stashed else f"layer_state.{key}"


def check_handoffs(
    name: str,
    inputs: Sequence[Tensor],
    outputs: Sequence[object],
    copies: Sequence[Tensor],
    state: LayerState,
    allowed: Sequence[Tensor],
) -> None:
    """Always on, after a layer slot's forward: what it returns and keeps is handed on right.

    ``copies`` are the ``node.detach`` copies the slot made; ``state.fresh`` lists what it
    kept in the layer state (field or stash key, tensor, stashed), of which what is still
    there is checked. Raises if an output is a copy (or a view of one), if a kept tensor
    that requires grad is one of the slot's inputs or, not a leaf, one of its outputs (or a
    view of either), or if a kept float tensor does not require grad while the inputs do
    (unless in ``allowed``, marked non-differentiable). Kept tensors that are an input or an
    output as they are, without grad, are appended to ``state.kept_as_is`` for a freeing
    slot to check. Identity comparisons only: no allocation.
    """
    if copies:
        for i, out in enumerate(outputs):
            if not isinstance(out, Tensor):
                continue  # the node refuses it right after
            base = _base(out)
            for d in copies:
                if out is d or base is d:
                    raise IntegrationError(
                        f"node {name!r}: output {i} ({_describe(out)}) is a node.detach copy "
                        "this slot made (or a view of one); a copy hands a tensor t to a "
                        "later slot of the layer through layer_state, and the node sends the "
                        "gradient given to the copy back through t when its backward runs, "
                        "which is before that gradient exists for an output: the gradient of "
                        "what consumes the output would stop at the copy and never reach t "
                        "(nor the parameters behind it). Expected the slot to return t itself "
                        "(or what it computes from t) and to keep node.detach(t) only in "
                        "layer_state, for a later slot"
                    )
    fresh = state.fresh
    if not fresh:
        return
    grad_in: bool | None = None
    for key, t, stashed in fresh:
        current: object = state.extras.get(key) if stashed else getattr(state, key, None)
        if current is not t:
            continue  # replaced (or dropped) before the slot ended: not handed on
        if t.requires_grad:
            base = _base(t)
            for j, x in enumerate(inputs):
                if t is x or base is x:
                    label = _kept_label(key, stashed)
                    fix = (
                        f"layer_state.stash({key!r}, node.detach(inputs[{j}]))"
                        if stashed
                        else f"{label} = node.detach(inputs[{j}])"
                    )
                    raise IntegrationError(
                        f"node {name!r}: {label} ({_describe(t)}) is the slot's input {j} (or "
                        "a view of it) kept as it is; a later slot that reads it would send "
                        "its gradient into this node's input outside this node's backward "
                        "(not summed as plain backward() sums it), and a slot that frees its "
                        "inputs releases its memory. Expected tensors handed to a later slot "
                        f"to go through node.detach: {fix}"
                    )
            if not t.is_leaf:
                for i, out in enumerate(outputs):
                    if not isinstance(out, Tensor):
                        continue
                    if t is out or base is out or _base(out) is t:
                        raise IntegrationError(
                            f"node {name!r}: {_kept_label(key, stashed)} ({_describe(t)}) is "
                            f"also the slot's output {i} (or a view of it), kept without "
                            "node.detach: a later slot's backward would run through this "
                            "slot's autograd graph, and this node's backward would run through "
                            "it again (gradients counted twice, or torch's 'backward through "
                            "the graph a second time'). Expected node.detach(t) for what a "
                            "later slot reads"
                        )
                # Computed here from the slot's inputs, not cut with node.detach (shipped
                # layers keep only copies, leaves: this walk runs for the misuse alone, or
                # a view of a copy). A later slot whose outputs depend on it is refused.
                if _reaches_leaf(t.grad_fn, inputs):
                    state.undetached.append((_kept_label(key, stashed), t, t.grad_fn, name))
            continue
        if (t.is_floating_point() or t.is_complex()) and not any(t is a for a in allowed):
            if grad_in is None:
                grad_in = any(x.requires_grad for x in inputs)
            if grad_in:
                raise IntegrationError(
                    f"node {name!r}: {_kept_label(key, stashed)} ({_describe(t)}) does not "
                    "require grad although the node's inputs do, so the gradient a later slot "
                    "sends back through it would silently be lost; expected a tensor still in "
                    "the autograd graph, handed on with node.detach(t) (not t.detach() or "
                    "torch.no_grad()). If it carries no gradient on purpose, call "
                    "node.mark_non_differentiable(t) on it in the slot"
                )
        if any(t is x for x in inputs) or any(t is o for o in outputs):
            state.kept_as_is.append(t)


def _reaches_leaf(root: object, leaves: Sequence[Tensor]) -> bool:
    """Whether the autograd graph below ``root`` accumulates into one of ``leaves``."""
    wanted = [t for t in leaves if t.requires_grad]
    if not wanted:
        return False
    for fn in walk_graph([root]):
        leaf: object = getattr(fn, "variable", None)
        if isinstance(leaf, Tensor) and any(leaf is t for t in wanted):
            return True
    return False


def check_undetached_reads(
    name: str, roots: Sequence[object], undetached: Sequence[tuple[str, Tensor, object, str]]
) -> None:
    """Always on, after a layer slot's forward, when an earlier slot of the layer kept a
    tensor computed from its inputs without ``node.detach`` (``layer_state.undetached``,
    rare: a misuse): raise if this slot's outputs (``roots``: their ``grad_fn`` and those of
    the tensors it detached) depend on one. Walks this slot's graph only then."""
    wanted = {id(fn): (label, t, producer) for label, t, fn, producer in undetached}
    for fn in walk_graph(roots):
        hit = wanted.get(id(fn))
        if hit is None:
            continue
        label, t, producer = hit
        stash = "layer_state.stash("
        fix = (
            f"{label[:-1]}, node.detach(t))"
            if label.startswith(stash)
            else f"{label} = node.detach(t)"
        )
        raise IntegrationError(
            f"node {name!r}: its outputs depend on {label} ({_describe(t)}), which node "
            f"{producer!r} (an earlier slot of the layer) kept with its autograd graph, not "
            "through node.detach: this node's backward would run through that slot's graph, "
            "and that slot's backward through it again (torch's 'Trying to backward through "
            "the graph a second time', or gradients counted twice, in another order than "
            f"plain backward()). Expected node {producer!r} to keep node.detach(t) for what a "
            f"later slot reads: {fix}"
        )


def check_copies_unused(name: str, copies: Sequence[Tensor]) -> None:
    """Always on, after a layer slot's backward: no ``node.detach`` copy it made received a
    gradient from that very backward (their grads were cleared before it ran)."""
    for i, d in enumerate(copies):
        if d.grad is not None:
            raise IntegrationError(
                f"node {name!r}: the node.detach copy {i} this slot made ({_describe(d)}) "
                "received a gradient from the slot's own backward: the slot used the copy "
                "itself (returned it, or computed an output or another copy from it), so "
                "that gradient stopped at the copy and never reached the tensor it was "
                "detached from. Expected node.detach(t) only for what a later slot reads "
                "from layer_state, and the slot's own outputs computed from t; "
                "MOE_OVERLAP_DEBUG=1 names the slot at its forward"
            )


def check_no_alias(
    name: str,
    storages: Sequence[torch.UntypedStorage],
    outputs: Sequence[Tensor],
    handed_on: Sequence[Tensor | None],
    labels: Sequence[str] = (),
) -> None:
    """Raise if an output or a handed-on tensor lives in an input storage about to be freed.

    ``labels`` name the handed-on tensors in the message (``layer_state.residual``, ...)."""
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
                what = f" (it is {labels[i]})" if tensors is handed_on and i < len(labels) else ""
                raise IntegrationError(
                    f"node {name!r}: {kind} {i} ({_describe(t)}) shares storage with input "
                    f"{j}{what}, which the free-input policy releases right after this slot "
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


@dataclass
class _Saves:
    """What a walk of an autograd graph found saved in some storages."""

    hazards: list[str] = field(default_factory=list[str])
    """``"NodeName.field"`` of each saved tensor backward would read there."""
    metadata_only: list[Tensor] = field(default_factory=list[Tensor])
    """Saved tensors there whose backward reads only their sizes, once per save."""
    recomputed: list[Tensor] = field(default_factory=list[Tensor])
    """Inputs of recomputed regions (``torch.utils.checkpoint``) living there: the region
    reruns on them when backward unpacks one of its saved tensors."""


_SAVED_ATTRS: dict[type, tuple[str, ...]] = {}


def _saved_attrs(kind: type) -> tuple[str, ...]:
    """The saved-tensor attributes of an autograd node type, listed once per type."""
    attrs = _SAVED_ATTRS.get(kind)
    if attrs is None:
        attrs = tuple(a for a in dir(kind) if a.startswith("_saved_") or a == "saved_tensors")
        _SAVED_ATTRS[kind] = attrs
    return attrs


def _scan_saves(roots: Sequence[object], pointers: set[int]) -> _Saves:
    found = _Saves()
    frames: dict[int, object] = {}
    for fn in walk_graph(roots):
        kind = type(fn).__name__
        for attr in _saved_attrs(type(fn)):
            hooks = _unpack_hooks(fn, attr)
            if hooks:
                for hook in hooks:
                    for frame in _recompute_frames(hook):
                        frames.setdefault(id(frame), frame)
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
                    if (kind, attr) in METADATA_ONLY_SAVES:
                        found.metadata_only.append(t)
                    else:
                        found.hazards.append(f"{kind}.{attr.removeprefix('_saved_')}")
    for frame in frames.values():
        for t in _frame_inputs(frame):
            if isinstance(t, Tensor) and t.untyped_storage().data_ptr() in pointers:
                found.recomputed.append(t)
    return found


def _unpack_hooks(fn: object, attr: str) -> list[Callable[..., object]]:
    """The unpack hooks the saved tensor(s) ``attr`` of ``fn`` go through (none: plain)."""
    raw_name = "_raw_saved_tensors" if attr == "saved_tensors" else f"_raw{attr}"
    try:
        raw: object = getattr(fn, raw_name, None)
    except RuntimeError:  # released
        return []
    items = cast("tuple[object, ...]", raw) if isinstance(raw, (tuple, list)) else (raw,)
    hooks: list[Callable[..., object]] = []
    for r in items:
        hook: object = getattr(r, "unpack_hook", None)
        if callable(hook):
            hooks.append(hook)
    return hooks


def _recompute_frames(hook: Callable[..., object]) -> list[object]:
    """The recompute state (``torch.utils.checkpoint``'s frame: an object with
    ``get_inputs``) an unpack hook closes over, looking one closure deep."""
    frames: list[object] = []
    pending: list[object] = [hook]
    for _ in range(2):
        nested: list[object] = []
        for f in pending:
            cells = cast("tuple[object, ...] | None", getattr(f, "__closure__", None)) or ()
            for cell in cells:
                try:
                    value: object = getattr(cell, "cell_contents")  # noqa: B009 - untyped cell
                except ValueError:  # an empty cell
                    continue
                if hasattr(value, "recompute_fn") and (
                    hasattr(value, "get_inputs") or hasattr(value, "input_saver")
                ):
                    frames.append(value)
                elif callable(value):
                    nested.append(value)
        pending = nested
    return frames


def _frame_inputs(frame: object) -> list[object]:
    """The inputs a recompute frame reruns on: ``get_inputs()`` (torch 2.13), else the
    tensors its ``input_saver`` node saved (torch 2.11: ``_NoopSaveInputs``)."""
    get_inputs = getattr(frame, "get_inputs", None)
    if callable(get_inputs):
        inputs: object = get_inputs()
        return cast("list[object]", inputs) if isinstance(inputs, list) else []
    saver: object = getattr(frame, "input_saver", None)
    node: object = getattr(saver, "grad_fn", None)
    try:
        saved: object = getattr(node, "saved_tensors", ())
    except RuntimeError:  # released
        return []
    return list(cast("tuple[object, ...]", saved)) if isinstance(saved, tuple) else []


def graph_saves(roots: Sequence[object], pointers: set[int]) -> list[str]:
    """Where the autograd graph below ``roots`` saved a tensor living in ``pointers``.

    Walks ``grad_fn`` nodes through ``next_functions`` and reads their saved tensors
    (``_saved_*`` of built-in nodes, ``saved_tensors`` of custom Functions); returns
    ``"NodeName.field"`` for each hit, except :data:`METADATA_ONLY_SAVES`. A saved tensor
    behind an unpack hook (activation checkpointing, offloading) is not read: unpacking it
    would recompute (or consume) it. Touches every node of the graph: only
    :func:`check_release` calls it, when the cheap reference counts say something else
    holds an input about to be freed (and in debug mode).
    """
    return _scan_saves(roots, pointers).hazards


def _saved_error(name: str, hits: Sequence[str]) -> IntegrationError:
    return IntegrationError(
        f"node {name!r}: the free-input policy releases this node's inputs after forward, "
        f"but autograd saved one of them (or a view) for backward: {sorted(set(hits))}; "
        "backward would read freed memory. Expected the tensors a freeing slot receives "
        "to be needed by no backward: have the previous slot hand over a fresh tensor "
        "(e.g. .clone(), or the all-to-all's receive buffer) and compute this slot on a "
        "copy (e.g. the experts on a permuted copy), or pass "
        "ScheduleOptions(free_input=False)"
    )


def check_not_saved(
    name: str,
    storages: Sequence[torch.UntypedStorage],
    inputs: Sequence[Tensor | None],
    graph_roots: Sequence[object],
) -> None:
    """Raise if autograd saved (a view of) an input the node is about to free.

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
        raise _saved_error(name, hits)


def check_release(
    name: str,
    inputs: Sequence[Tensor | None],
    copies: Sequence[Tensor | None],
    outputs: Sequence[Tensor],
    kept: Sequence[tuple[str, Tensor | None]],
    own_roots: Sequence[object],
    *,
    count_inputs: bool = True,
    count_copies: bool = True,
    walk: bool = False,
) -> None:
    """Before a node frees ``inputs``: raise if something still holds one and would read it.

    ``copies`` are the node's detached copies of the inputs (what its slot received),
    ``kept`` every tensor kept for later slots, named (``node.detach`` copies and the
    layer state), ``own_roots`` the ``grad_fn`` of the node's outputs and handed-on
    tensors. Called when the cheap reference counts of an input's storage or tensors
    exceed the schedule's own (``walk`` set: always, in debug mode); ``count_inputs`` /
    ``count_copies`` off, the counts of the inputs / of the copies are not telling (a
    collective still holds them). Raises, naming it,
    for an output or a kept tensor over an input's storage; unless the references are
    explained by views' bases, shared storages and grad accumulators, the autograd graph
    of this node and of the previous one is walked and raises for a saved tensor backward
    would read there, for a recomputed region (``torch.utils.checkpoint``) rerunning on an
    input, and for an input the previous slot returned uncomputed (its own input, a copy,
    a parameter) whose memory another tensor holds. Other references (a collective's
    pending work holding the tensor, a reference the schedule cannot name) are accepted.
    """
    storages = [t.untyped_storage() for t in inputs if t is not None]
    check_no_alias(name, storages, outputs, [t for _, t in kept], [label for label, _ in kept])
    pointers = {s.data_ptr() for s in storages} - {0}
    del storages  # each held storage object is one more reference to count below
    if not pointers:
        return
    known: dict[int, Tensor] = {}
    _know(known, (*inputs, *copies))
    # A held grad accumulator makes a leaf's count certain (one reference, made or not).
    leaves = [t for t in (*inputs, *copies) if t is not None and t.requires_grad and t.is_leaf]
    accumulators = [torch.autograd.graph.get_gradient_edge(t).node for t in leaves]
    owners = {id(t) for t in leaves}
    counted = (count_inputs, count_copies)
    shared, copied = _unexplained(inputs, copies, known, owners, counted)
    if not (walk or shared or copied):
        return  # views, storages shared between inputs, accumulators: nothing else
    # What holds a copy (the slot's own input) was made in the slot: only its own graph is
    # walked for it; what holds the storage or the input may be the previous slot's too.
    producer = [t.grad_fn for t in inputs if t is not None] if walk or shared else []
    saves = _scan_saves([*producer, *own_roots], pointers)
    if saves.hazards:
        raise _saved_error(name, saves.hazards)
    if saves.recomputed:
        i = next(
            j
            for j, t in enumerate(inputs)
            if t is not None
            and any(
                r.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
                for r in saves.recomputed
            )
        )
        raise _recomputed_error(name, i, inputs[i])
    _know(known, saves.metadata_only)
    for i, t in enumerate(inputs):
        if t is not None and t.grad_fn is None and t.requires_grad:
            over = _storage_excess(t, known)
            if over > 0:
                raise _passed_through_error(name, i, t, over)
    del accumulators


def _know(known: dict[int, Tensor], tensors: Sequence[Tensor | None]) -> None:
    """Add ``tensors`` and their views' bases to the references the schedule accounts for."""
    for t in tensors:
        if t is None:
            continue
        known[id(t)] = t
        base = _base(t)
        if base is not None:
            known[id(base)] = base


def _storage_excess(t: Tensor, known: dict[int, Tensor]) -> int:
    """References to ``t``'s storage beyond the tensors in ``known`` and one storage object."""
    ptr = t.untyped_storage().data_ptr()
    on_it = sum(1 for k in known.values() if k.untyped_storage().data_ptr() == ptr)
    storage = t.untyped_storage()
    return storage_use_count(storage_cdata(storage)) - 1 - on_it


def _tensor_excess(t: Tensor, known: dict[int, Tensor], owners: set[int]) -> int:
    """References to ``t``'s tensor beyond its Python object, its accumulator (held) and
    the views of it the schedule knows."""
    expected = 1 + (id(t) in owners)
    expected += sum(1 for k in known.values() if _base(k) is t)
    return tensor_use_count(t) - expected


def _unexplained(
    inputs: Sequence[Tensor | None],
    copies: Sequence[Tensor | None],
    known: dict[int, Tensor],
    owners: set[int],
    counted: tuple[bool, bool],
) -> tuple[bool, bool]:
    """Whether some input's storage or (where ``counted``) input, and whether (where
    ``counted``) some copy, has references the schedule does not account for."""
    shared = copied = False
    for t, x in zip(inputs, copies, strict=True):
        if t is None or x is None or not t.untyped_storage().data_ptr():
            continue
        if _storage_excess(t, known) > 0 or (counted[0] and _tensor_excess(t, known, owners) > 0):
            shared = True
        if counted[1] and _tensor_excess(x, known, owners) > 0:
            copied = True
    return shared, copied


def _recomputed_error(name: str, i: int, t: Tensor | None) -> IntegrationError:
    what = f" ({_describe(t)})" if t is not None else ""
    return IntegrationError(
        f"node {name!r}: the free-input policy releases input {i}{what} right after this "
        "slot, but a recomputed region (torch.utils.checkpoint) keeps it to rerun on in "
        "backward, which would read freed memory. Expected recomputed regions to take "
        "tensors no freeing slot receives: recompute inside the slot that produces the "
        "tensor, or on a copy (checkpoint(fn, x.clone())); or pass "
        "ScheduleOptions(free_input=False)"
    )


def _passed_through_error(name: str, i: int, t: Tensor, over: int) -> IntegrationError:
    return IntegrationError(
        f"node {name!r}: the free-input policy releases input {i} ({_describe(t)}) right "
        "after this slot, but the previous slot returned it without computing it (its own "
        "input, a node.detach copy or a parameter, as it is), so its memory is held by "
        f"{over} more tensor(s) the release would take it from; the free-input policy "
        "expects a freeing slot's inputs to be fresh buffers. Expected the previous slot to "
        "return a copy (.clone(), or the all-to-all's receive buffer), or pass "
        "ScheduleOptions(free_input=False)"
    )


def check_own_leaves(
    name: str, roots: Sequence[object], allowed: Sequence[Tensor], own: Sequence[Tensor] = ()
) -> None:
    """Debug mode: raise if a slot's graph reaches a leaf that is neither a parameter, nor
    the slot's own input, nor a tensor an earlier slot of the layer handed on with
    ``node.detach``; or one of the slot's own ``node.detach`` copies (``own``).

    Such a leaf is another node's input, reached through a tensor passed between slots
    without ``node.detach``: its gradient would then be accumulated by two backward passes
    in another order than plain ``backward()`` (or the shared graph run twice). A copy
    the slot made itself and used again never passes its gradient on.
    """
    ok = {id(t) for t in allowed}
    mine = {id(t) for t in own}
    for fn in walk_graph(roots):
        leaf: object = getattr(fn, "variable", None)
        if not (isinstance(leaf, Tensor) and type(fn).__name__ == "AccumulateGrad"):
            continue
        if id(leaf) in mine:
            raise IntegrationError(
                f"node {name!r}: its outputs (or another node.detach copy) depend on a "
                f"node.detach copy it made itself ({_describe(leaf)}): the gradient through "
                "that use would stop at the copy and never reach the tensor it was detached "
                "from; expected node.detach(t) only for what a later slot reads from "
                "layer_state, and the slot's own outputs computed from t (checked in debug "
                "mode)"
            )
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
