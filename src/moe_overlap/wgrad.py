"""Delayed weight gradients: what a model still owes, checked before and after every step.

One checker for the whole library: :func:`check_wgrad_done` (call it before
``optimizer.step()`` when you drive plans yourself) over :func:`owed_wgrad`, which reads
every module's :class:`~moe_overlap.PendingWgrad` count.
"""

from moe_overlap.engine import BackwardDWWrapper as BackwardDWWrapper
from moe_overlap.engine import PendingWgrad as PendingWgrad
from moe_overlap.engine import WgradLayer as WgradLayer
from moe_overlap.engine import WgradScope as WgradScope
from moe_overlap.engine import check_wgrad_done as check_wgrad_done
from moe_overlap.engine import owed_wgrad as owed_wgrad

__all__ = [
    "BackwardDWWrapper",
    "PendingWgrad",
    "WgradLayer",
    "WgradScope",
    "check_wgrad_done",
    "owed_wgrad",
]
