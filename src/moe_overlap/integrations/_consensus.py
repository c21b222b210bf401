"""After every pipeline step, the ranks agree whether it failed anywhere.

The step consensus lives in the engine (``engine/_consensus.py``), where
:func:`~moe_overlap.combined_1f1b` votes with it too (its ``consensus_group``); the
pipelining runtime takes it from here. Only public ``torch.distributed`` API is used.
"""

from __future__ import annotations

from moe_overlap.engine import Phase, StepConsensus, Verdict, verdict_error

__all__ = ["Phase", "StepConsensus", "Verdict", "verdict_error"]
