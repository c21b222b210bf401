"""How far the self-checks of the torchtitan and Megatron-Core adapters let the split of a
layer differ from the layer's own forward and backward, and how their errors say it."""

from __future__ import annotations

import torch

from moe_overlap.adapters._hf_probe import PROBE_TOLERANCE

__all__ = ["probe_tolerance", "tolerance_text"]


def probe_tolerance(dtype: torch.dtype, device: torch.device) -> float:
    """The largest relative difference the self-check accepts in ``dtype`` on ``device``.

    None where the kernels are deterministic (CPU, or deterministic algorithms on): the
    split runs the block's own operations in its order, so it is bit-identical to the
    block's own forward and backward. Elsewhere two runs of the block itself may differ by
    its kernels' atomic additions: float32 ``PROBE_TOLERANCE``, a 16-bit dtype 8 of its
    rounding units."""
    if device.type == "cpu" or torch.are_deterministic_algorithms_enabled():
        return 0.0
    if dtype == torch.float32 or not dtype.is_floating_point:
        return PROBE_TOLERANCE
    return 8 * torch.finfo(dtype).eps


def tolerance_text(tolerance: float, dtype: torch.dtype) -> str:
    """What a self-check error says it expected: bit-identical results, or at most
    ``tolerance`` in ``dtype``."""
    if tolerance == 0.0:
        return "expected bit-identical (deterministic kernels)"
    return f"over {tolerance:g} in {dtype}"
