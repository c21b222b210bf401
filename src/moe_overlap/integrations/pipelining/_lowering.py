"""Schedules as data: the ``OVERLAP_F_B`` lowering and the checks of a rank's actions.

Pure functions over torch's action lists (``schedule.pipeline_order``): no process group,
no stage, no plan; tested on schedule data as torch tests its own lowering.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from moe_overlap import ConfigError
from moe_overlap.engine.args import CALLABLE, POSITIVE, Instance, check_arg
from moe_overlap.integrations.pipelining import _torch
from moe_overlap.integrations.pipelining._torch import Action, check_torch

__all__ = ["Order", "check_actions", "describe", "pair_overlap_f_b"]

Order = Mapping[int, Sequence["Action | None"]]
"""A compute-only schedule: per rank, its actions and ``None`` bubbles."""
_ORDER = Instance[Mapping[object, object]](Mapping, "a mapping of each rank to its actions")


def pair_overlap_f_b(
    order: Order, *, num_stages: int, stage_to_rank: Callable[[int], int]
) -> dict[int, list[Action | None]]:
    """Pair each rank's neighbouring forward and full backward into ``OVERLAP_F_B`` actions.

    ``order`` is a compute-only schedule (``schedule.pipeline_order``: per rank, ``F``,
    ``B`` (full backward) and ``None`` bubbles). Two neighbours on one rank are paired when
    one is a forward and the other a full backward of another microbatch (a backward needs
    the loss, hence every forward, of its own microbatch) and the schedule with the pair
    still lowers to communication without a deadlock: torch's own send/recv placement
    must succeed for every rank, the pair waiting for both of its inputs. The pair is
    ``(forward, backward)``, as ``ScheduleDualPipeV`` orders its own. Each rank's compute
    actions keep their order; ranks are paired in rank order.
    """
    check_torch()
    w = "pair_overlap_f_b"
    check_arg(w, "order", order, _ORDER)
    check_arg(w, "num_stages", num_stages, POSITIVE)
    check_arg(w, "stage_to_rank", stage_to_rank, CALLABLE)
    kinds = _torch.kinds()
    forward, full_backward = kinds.forward, kinds.full_backward

    def pairable(a: Action | None, b: Action | None) -> Action | None:
        if a is None or b is None or a.sub_actions is not None or b.sub_actions is not None:
            return None
        found = {a.computation_type, b.computation_type}
        if found != {forward, full_backward} or a.microbatch_index == b.microbatch_index:
            return None
        f, bwd = (a, b) if a.computation_type == forward else (b, a)
        return _torch.overlap_action(f, bwd)

    out: dict[int, list[Action | None]] = {r: list(order[r]) for r in sorted(order)}
    for rank in sorted(out):
        i = 0
        while i + 1 < len(out[rank]):
            acts = out[rank]
            pair = pairable(acts[i], acts[i + 1])
            if pair is not None:
                trial = {**out, rank: [*acts[:i], pair, *acts[i + 2 :]]}
                if _lowers(trial, num_stages, stage_to_rank):
                    out = trial
            i += 1
    return out


def _lowers(order: Order, num_stages: int, stage_to_rank: Callable[[int], int]) -> bool:
    """torch's send/recv placement succeeds (no rank waits forever)."""
    compute = {r: [a for a in acts if a is not None] for r, acts in order.items()}
    compute = {r: acts for r, acts in compute.items() if acts}
    try:
        _torch.add_send_recv(compute, stage_to_rank, num_stages)
    except AssertionError:
        return False
    return True


def check_actions(actions: Sequence[Action]) -> int:
    """Every compute action of a rank (``actions``, with communication) is one the plans
    run; returns the number of ``OVERLAP_F_B`` pairs."""
    kinds = _torch.kinds()
    pairs = 0
    for action in actions:
        if action.computation_type != kinds.overlap_f_b:
            continue
        parts = action.sub_actions or ()
        found = tuple(a.computation_type for a in parts)
        if found != (kinds.forward, kinds.full_backward):
            raise ConfigError(
                f"prepare_schedule: expected each OVERLAP_F_B as (FORWARD, FULL_BACKWARD), "
                f"received {action} with parts {[str(k) for k in found]}"
            )
        pairs += 1
    return pairs


def describe(action: Action) -> str:
    """``stage 1 microbatch 2 (forward) with stage 0 microbatch 1 (full backward)``."""
    names = {"F": "forward", "B": "full backward", "I": "input backward", "W": "weight backward"}
    parts = action.sub_actions or (action,)
    named = [
        f"stage {a.stage_index} microbatch {a.microbatch_index} "
        f"({names.get(str(a.computation_type.value), str(a.computation_type))})"
        for a in parts
    ]
    return " with ".join(named) + f" [action {action}]"
