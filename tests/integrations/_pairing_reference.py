"""Test-only: the pairing of ``pair_overlap_f_b`` as it was before its incremental check.

Each trial pairing re-runs torch's whole send/recv placement (quadratic or worse in the
number of microbatches). Kept to compare the library's pairing against, bit for bit
(``tests/integrations/test_pairing_grid.py``), and to time it (``benchmarks/bench_pairing.py``).
The library never imports this module.
"""

from __future__ import annotations

from collections.abc import Callable

from moe_overlap.integrations.pipelining import _torch
from moe_overlap.integrations.pipelining._lowering import Order
from moe_overlap.integrations.pipelining._torch import Action


def pair_overlap_f_b_reference(
    order: Order, *, num_stages: int, stage_to_rank: Callable[[int], int]
) -> dict[int, list[Action | None]]:
    """The pairs ``pair_overlap_f_b`` makes, each trial checked by torch's whole placement
    (``order`` is taken as checked: no argument checks here)."""
    kinds = _torch.kinds()
    forward, full_backward = kinds.forward, kinds.full_backward

    def pairable(a: Action | None, b: Action | None, first: object) -> Action | None:
        if a is None or b is None or a.sub_actions is not None or b.sub_actions is not None:
            return None
        if a.computation_type != first or a.microbatch_index == b.microbatch_index:
            return None
        if {a.computation_type, b.computation_type} != {forward, full_backward}:
            return None
        f, bwd = (a, b) if a.computation_type == forward else (b, a)
        return _torch.overlap_action(f, bwd)

    out: dict[int, list[Action | None]] = {r: list(order[r]) for r in sorted(order)}
    for first in (full_backward, forward):
        for rank in sorted(out):
            i = 0
            while i + 1 < len(out[rank]):
                acts = out[rank]
                pair = pairable(acts[i], acts[i + 1], first)
                if pair is not None:
                    trial = {**out, rank: [*acts[:i], pair, *acts[i + 2 :]]}
                    if _lowers(trial, num_stages, stage_to_rank):
                        out = trial
                i += 1
    return out


def _lowers(order: Order, num_stages: int, stage_to_rank: Callable[[int], int]) -> bool:
    compute = {r: [a for a in acts if a is not None] for r, acts in order.items()}
    compute = {r: acts for r, acts in compute.items() if acts}
    try:
        _torch.add_send_recv(compute, stage_to_rank, num_stages)
    except AssertionError:
        return False
    return True
