"""Checks a node runs on what its forward returned: still in the graph, not freed early.

Cheap ones run on every forward (a few attribute reads per tensor). The saved-tensor
diagnosis wraps the forward in autograd hooks and runs in debug mode only
(``docs/debug.md``): it records which inputs autograd saved, and names them if backward
then reads freed memory. It cannot fail at forward: some ops save a tensor only for its
metadata (``index_add`` saves its source for ``dim()``), which survives the release.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType

import torch
from torch import Tensor

from ._errors import IntegrationError

__all__ = [
    "FREED_MEMORY_HINT",
    "SavedStorages",
    "check_in_graph",
    "check_no_alias",
    "freed_memory_hint",
    "saved_and_freed_error",
    "inputs_saved_by_autograd",
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


class SavedStorages:
    """Record the storages autograd saves for backward inside a ``with`` block."""

    __slots__ = ("_hooks", "pointers")

    def __init__(self) -> None:
        self.pointers: set[int] = set()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, t: Tensor) -> Tensor:
        try:
            self.pointers.add(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # storage-less tensor subclasses
            pass
        # A detached alias: returning ``t`` itself would tie a saved output to its own
        # grad_fn in a reference cycle.
        return t.detach()

    def __enter__(self) -> SavedStorages:
        self._hooks.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._hooks.__exit__(exc_type, exc, tb)


def _unpack(t: Tensor) -> Tensor:
    return t


def inputs_saved_by_autograd(inputs: Sequence[Tensor | None], saved: set[int]) -> tuple[str, ...]:
    """Descriptions of the inputs autograd saved (or saved a view of) for backward."""
    out: list[str] = []
    for j, t in enumerate(inputs):
        if t is None:
            continue
        ptr = t.untyped_storage().data_ptr()
        if ptr and ptr in saved:
            out.append(f"input {j} ({_describe(t)})")
    return tuple(out)


def saved_and_freed_error(name: str, saved: Sequence[str], exc: BaseException) -> IntegrationError:
    """The debug-mode diagnosis of a backward that read an input free-input released."""
    return IntegrationError(
        f"node {name!r}: backward read memory the free-input policy had released: autograd "
        f"saved {', '.join(saved)} of this node for backward, and the node freed its inputs "
        "after forward; expected the slot to compute on a fresh buffer (e.g. the experts on "
        "a permuted copy, or a .clone() of the input), or pass "
        f"ScheduleOptions(free_input=False) (torch said: {exc})"
    )
