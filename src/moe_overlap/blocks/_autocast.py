"""The autocast state a custom autograd Function's forward ran under, for its backward.

``torch.autocast`` changes what a forward computes (a matrix product in bfloat16), and a
backward usually runs outside it (``with torch.autocast(...): loss = model(x)``, then
``loss.backward()``). torch's own ops are made for that; a custom
``torch.autograd.Function`` is not: its backward would multiply a bfloat16 gradient by a
float32 weight. ``torch.amp.custom_fwd`` / ``custom_bwd`` record the forward's state and run
the backward under it, for one device type fixed when the Function is defined;
:class:`AutocastState` does the same for the device type of the Function's input, found
when it runs (CPU or CUDA), and lets a delayed weight gradient be computed later under the
state its forward saw.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from dataclasses import dataclass

import torch

__all__ = ["AutocastState"]


def _available_at_import() -> dict[str, bool]:
    out: dict[str, bool] = {}
    for kind in ("cpu", "cuda", "xpu", "mps", "hpu"):
        # a device type this torch build does not know: left out, asked per call
        with contextlib.suppress(RuntimeError):
            out[kind] = torch.amp.is_autocast_available(kind)
    return out


_AVAILABLE = _available_at_import()
"""Whether autocast supports each common device type, asked once at import: torch.compile
before torch 2.13 cannot trace ``torch.amp.is_autocast_available`` inside an autograd
Function's forward (an error, not a graph break), and a delayable linear asks it there."""


@dataclass(frozen=True, slots=True)
class AutocastState:
    """Whether autocast is on for ``device_type`` and its dtype (``None``: a device type
    autocast does not support, e.g. ``meta``: nothing to restore)."""

    device_type: str
    enabled: bool
    dtype: torch.dtype | None

    @classmethod
    def of(cls, kind: str) -> AutocastState:
        """The current state for the device type ``kind`` (what ``custom_fwd`` records)."""
        available = _AVAILABLE.get(kind)
        if available is None:  # a rarer device type: asked each time (eager only before 2.13)
            available = torch.amp.is_autocast_available(kind)
        if not available:
            return cls(kind, False, None)
        return cls(kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))

    @contextlib.contextmanager
    def restored(self) -> Generator[None]:
        """Run the block under this state (what ``custom_bwd`` does); no autocast context
        is entered where the current state is this one already."""
        if self.dtype is None or AutocastState.of(self.device_type) == self:
            yield
            return
        with torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled):
            yield
