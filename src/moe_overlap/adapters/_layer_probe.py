"""What the self-checks of the torchtitan and Megatron-Core adapters share: the layers
they probe (one per structure), the comparison of a layer's split with the layer's own
forward and backward, how far the two may differ and how their errors say it."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator

import torch
from torch import Tensor, nn

from moe_overlap.adapters._hf_probe import (
    PROBE_TOLERANCE,
    Mismatch,
    rel_difference,
    worst_gradient,
)

__all__ = ["compare_backward", "first_of_each", "probe_tolerance", "tolerance_text"]


def first_of_each(
    named: Iterable[tuple[str, nn.Module]], structure: Callable[[nn.Module], Hashable]
) -> Iterator[tuple[str, nn.Module, list[str]]]:
    """The first module of each ``structure``, with the names of every module of that
    structure (the list grows as the iteration goes on)."""
    seen: dict[Hashable, list[str]] = {}
    for name, module in named:
        key = structure(module)
        if key in seen:
            seen[key].append(name)
            continue
        seen[key] = [name]
        yield name, module, seen[key]


def compare_backward(
    out_c: Tensor,
    out_r: Tensor,
    grad_out: Tensor,
    inputs: tuple[Tensor, Tensor],
    copies: tuple[nn.Module, nn.Module],
) -> Mismatch:
    """The split's output ``out_c`` against the layer's own ``out_r`` (its backward run
    with ``grad_out``), then, after the split's backward with ``grad_out``, the input
    gradients (``inputs``: the split's, the layer's) and every parameter's gradient
    (``copies``: the split's copy of the layer, the layer's own)."""
    if out_c.shape != out_r.shape:
        return Mismatch("output shape", float("inf"))
    worst = Mismatch("output", rel_difference(out_c, out_r))
    torch.autograd.backward(out_c, grad_out)
    (x_cand, x_ref), (cand, ref) = inputs, copies
    pairs: list[tuple[str, Tensor | None, Tensor | None]] = [
        ("input gradient", x_cand.grad, x_ref.grad)
    ]
    cand_grads = dict(cand.named_parameters())
    for pname, p in ref.named_parameters():
        pairs.append((f"gradient of {pname}", cand_grads[pname].grad, p.grad))
    return worst_gradient(pairs, worst)


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
