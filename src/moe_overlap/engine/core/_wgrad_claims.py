"""Which delayed modules a schedule will compute the weight gradients of: its claims.

A module that can delay its weight gradient (:class:`~moe_overlap.blocks.DelayedWgradModule`)
queues it in backward only while a claim names it, and otherwise computes it at once, as
``nn.Linear`` does. A claim names the modules a schedule will run ``backward_dw()`` for:
every layer plan claims what its layer lists (``pre_dispatch_wgrad()`` / ``mlp_wgrad()``)
from construction to release, so a plain ``loss.backward()``, another adapter's schedule
or a deep copy of the model (other objects) never leaves a weight gradient waiting for a
``backward_dw()`` nothing runs.

Claims are process-wide and keyed by object identity: backward runs on autograd's worker
threads (one per device), recompute inside it, and both must see the claim the scheduling
thread made. A claim holds the objects it names, so their identities stay theirs until it
is released (or its owner is garbage-collected).
"""

from __future__ import annotations

import threading
from collections.abc import Generator, Iterable, Sequence
from contextlib import contextmanager
from types import TracebackType
from typing import cast

from torch import nn

from moe_overlap.protocols import HoldsDelayedModules

__all__ = ["WgradClaim", "claim_wgrad", "claimed_members", "wgrad_claimed"]

_CLAIMED: dict[int, int] = {}
"""``id(object) -> live claims naming it``; read lock-free by backward (a dict lookup)."""
_LOCK = threading.Lock()


def wgrad_claimed(module: object) -> bool:
    """Whether a live claim names ``module``: its backward may queue its weight gradient."""
    return id(module) in _CLAIMED


def claimed_members(parts: Iterable[object]) -> dict[int, object]:
    """What claiming ``parts`` names, by ``id``: each part, every submodule of an
    ``nn.Module`` part, and what a part that is not one holds when it is a
    :class:`~moe_overlap.wgrad.HoldsDelayedModules` (walked the same way); a list or tuple
    stands for its items."""
    found: dict[int, object] = {}
    stack = list(parts)
    while stack:
        part = stack.pop()
        if isinstance(part, (list, tuple)):
            stack.extend(cast("Sequence[object]", part))
        elif id(part) in found:
            continue
        elif isinstance(part, nn.Module):
            found[id(part)] = part
            stack.extend(part.children())  # (cheaper than modules(): no names built)
        else:
            found[id(part)] = part
            if _holds_delayed_modules(part):
                stack.extend(cast(HoldsDelayedModules, part).delayed_modules())
    return found


_HOLDS: dict[type, bool] = {}
"""Per class: whether its instances are :class:`HoldsDelayedModules` (asked once per class:
this runs for every layer of every microbatch)."""


def _holds_delayed_modules(part: object) -> bool:
    known = _HOLDS.get(type(part))
    if known is None:
        # its one member, looked up as its rule table (HOLDS_DELAYED_MODULES) does
        known = _HOLDS[type(part)] = callable(getattr(part, "delayed_modules", None))
    return known


class WgradClaim:
    """A claim on the modules behind ``parts`` (:func:`claimed_members`) until
    :meth:`release` (idempotent; also a context manager)."""

    __slots__ = ("_held",)

    def __init__(self, parts: Iterable[object]) -> None:
        held = claimed_members(parts)
        with _LOCK:
            for key in held:
                _CLAIMED[key] = _CLAIMED.get(key, 0) + 1
        self._held = held

    def release(self) -> None:
        """Stop claiming (the modules' next backward computes at once unless claimed again)."""
        held, self._held = self._held, {}
        with _LOCK:
            for key in held:
                count = _CLAIMED[key] - 1
                if count:
                    _CLAIMED[key] = count
                else:
                    del _CLAIMED[key]

    def __enter__(self) -> WgradClaim:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


@contextmanager
def claim_wgrad(*parts: object) -> Generator[None]:
    """Inside, the delayed modules behind ``parts`` queue their weight gradients in backward.

    For callers that run ``backward_dw()`` themselves (a custom schedule, a test): run the
    backward inside, then each part's ``backward_dw()`` once per backward (inside or
    after). Outside any claim (a plain ``loss.backward()``), such a module computes its
    weight gradient at once, bit-identical to ``nn.Linear``. ``parts``: modules (their
    submodules too), :class:`~moe_overlap.WgradLayer` s, models.
    """
    claim = WgradClaim(parts)
    try:
        yield
    finally:
        claim.release()
