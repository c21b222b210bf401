"""Tensors a recomputed region keeps for its backward: free-input must not release them.

A region checkpointed with ``torch.utils.checkpoint`` reruns on its original inputs in
backward. Free-input releases a freeing slot's inputs right after its forward; if one of
them is such an input, the recompute would read released memory, silently (a CPU kernel
reads an empty storage without raising). :func:`hold_for_recompute` (called by
:func:`moe_overlap.blocks.recompute`) records the region's inputs; the free-input guard
(``_attached_checks.py``) refuses to release one. The schedule core never reads them.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

from torch import Tensor

__all__ = ["held_for_recompute", "hold_for_recompute"]

_HELD: dict[int, weakref.ref[Tensor]] = {}
_SWEEP_AT = 4096


def hold_for_recompute(tensors: Iterable[object]) -> None:
    """Record ``tensors`` as inputs a pending recompute will read."""
    for t in tensors:
        if isinstance(t, Tensor):
            ptr = t.untyped_storage().data_ptr()
            if ptr:
                _HELD[ptr] = weakref.ref(t)
    if len(_HELD) > _SWEEP_AT:
        _sweep()


def held_for_recompute(ptr: int) -> bool:
    """Whether a live tensor a recompute holds lives in the storage at ``ptr``."""
    ref = _HELD.get(ptr)
    if ref is None:
        return False
    t = ref()
    if t is None or t.untyped_storage().data_ptr() != ptr:
        del _HELD[ptr]
        return False
    return True


def _sweep() -> None:
    for ptr in [p for p, ref in _HELD.items() if ref() is None]:
        del _HELD[ptr]
