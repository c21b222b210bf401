"""Delayed weight gradients: who computes them, and what a model still owes.

A module that can delay its weight gradient queues it in backward only while a schedule
(or :func:`claim_wgrad`) claims it, for that schedule's ``backward_dw()``; otherwise it
computes it at once, as ``nn.Linear`` does, so a plain ``loss.backward()``, another
adapter's schedule or a deep copy of the model leaves nothing owed. One checker for the
whole library: :func:`check_wgrad_done` (call it before ``optimizer.step()`` when you
drive plans yourself) over :func:`owed_wgrad`, which reads every module's
:class:`~moe_overlap.PendingWgrad` count.
"""

from moe_overlap import BackwardDWWrapper as BackwardDWWrapper
from moe_overlap import PendingWgrad as PendingWgrad
from moe_overlap import WgradLayer as WgradLayer
from moe_overlap import WgradScope as WgradScope
from moe_overlap.engine._owed_wgrad import check_wgrad_done as check_wgrad_done
from moe_overlap.engine._owed_wgrad import owed_wgrad as owed_wgrad
from moe_overlap.engine.core._wgrad_claims import claim_wgrad as claim_wgrad
from moe_overlap.engine.core._wgrad_claims import wgrad_claimed as wgrad_claimed
from moe_overlap.protocols import HoldsDelayedModules as HoldsDelayedModules

__all__ = [
    "BackwardDWWrapper",
    "HoldsDelayedModules",
    "PendingWgrad",
    "WgradLayer",
    "WgradScope",
    "check_wgrad_done",
    "claim_wgrad",
    "owed_wgrad",
    "wgrad_claimed",
]
