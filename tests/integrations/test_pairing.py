"""The OVERLAP_F_B lowering on schedule data (no process group), as torch tests its own.

The lowering module is called directly: it needs no process group, stage or plan.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.pipelining.schedules import (
    BACKWARD_INPUT,
    FORWARD,
    FULL_BACKWARD,
    OVERLAP_F_B,
    ScheduleInterleaved1F1B,
    _Action,
    _add_send_recv,
)

from moe_overlap import ConfigError
from moe_overlap.integrations.pipelining import stage_rank
from moe_overlap.integrations.pipelining._lowering import check_actions, pair_overlap_f_b
from moe_overlap.integrations.pipelining._torch import check_torch


class _Stage:
    """What a schedule's constructor reads of a stage (torch's tests mock it the same way)."""

    def __init__(self, index: int, num_stages: int, group_size: int, rank: int) -> None:
        self.stage_index = index
        self.num_stages = num_stages
        self.group_size = group_size
        self.group_rank = rank
        self.is_first = index == 0
        self.is_last = index == num_stages - 1
        self.submod = nn.Identity()


def _interleaved(pp: int, stages_per_rank: int, n_mb: int) -> dict[int, list[_Action | None]]:
    n = pp * stages_per_rank
    stages: list[Any] = [_Stage(k * pp, n, pp, 0) for k in range(stages_per_rank)]  # rank 0's
    schedule = ScheduleInterleaved1F1B(stages, n_microbatches=n_mb, loss_fn=lambda a, b: a)
    return {r: list(acts) for r, acts in schedule.pipeline_order.items()}


def _same_compute(lowered: Sequence[_Action | None], original: Sequence[_Action | None]) -> bool:
    """The lowered rank runs the original's compute actions in the original order, two
    neighbours merged into each pair (in either order inside it)."""
    todo = [a for a in original if a is not None]
    for item in (a for a in lowered if a is not None):
        n = 2 if item.sub_actions is not None else 1
        head, todo = todo[:n], todo[n:]
        if set(item.sub_actions or (item,)) != set(head):
            return False
    return not todo


@pytest.mark.parametrize(("pp", "per_rank", "n_mb"), [(2, 2, 4), (2, 2, 8), (4, 2, 8)])
def test_interleaved_1f1b_pairs_without_deadlock(pp: int, per_rank: int, n_mb: int) -> None:
    order = _interleaved(pp, per_rank, n_mb)
    n = pp * per_rank
    lowered = pair_overlap_f_b(order, num_stages=n, stage_to_rank=lambda s: s % pp)
    pairs = [a for acts in lowered.values() for a in acts if a is not None and a.sub_actions]
    assert pairs, "the steady state has neighbouring forwards and backwards to pair"
    for rank in order:
        assert _same_compute(lowered[rank], order[rank])
    for p in pairs:
        assert p.computation_type == OVERLAP_F_B
        assert p.sub_actions is not None
        f, b = p.sub_actions
        assert (f.computation_type, b.computation_type) == (FORWARD, FULL_BACKWARD)
        assert f.microbatch_index != b.microbatch_index
    compute = {r: [a for a in acts if a is not None] for r, acts in lowered.items()}
    _add_send_recv(compute, lambda s: s % pp, n)  # lowers to communication


def test_a_pair_that_would_deadlock_is_not_made() -> None:
    """Rank 1 pairs its backward with the next forward, (1B0, 1F1), first; rank 0's
    (0F1, 0B0) would then wait on rank 1's pair, which waits on 0F1: a cycle, so rank 0
    keeps the two apart."""
    a = _Action.from_str
    order: dict[int, list[_Action | None]] = {
        0: [a("0F0"), a("0F1"), a("0B0"), a("0B1")],
        1: [a("1F0"), a("1B0"), a("1F1"), a("1B1")],
    }
    lowered = pair_overlap_f_b(order, num_stages=2, stage_to_rank=lambda s: s)
    assert lowered[0] == order[0]
    assert [repr(x) for x in lowered[1]] == ["1F0", "(1F1;1B0)OVERLAP_F_B", "1B1"]


def test_a_backward_pairs_with_the_next_forward_first() -> None:
    """In the steady state every backward is paired with the forward after it, so that a
    pair waits only for its neighbours' previous pairs (``moe_overlap.plan`` replays it)."""
    order = _interleaved(4, 2, 16)
    lowered = pair_overlap_f_b(order, num_stages=8, stage_to_rank=lambda s: s % 4)
    for rank, acts in order.items():
        compute = [x for x in acts if x is not None]
        pairs = [x for x in lowered[rank] if x is not None and x.sub_actions]
        for p in pairs:
            assert p.sub_actions is not None
            f, b = p.sub_actions
            i, j = compute.index(f), compute.index(b)
            assert j == i - 1, (rank, f, b)


def test_same_microbatch_is_never_paired() -> None:
    a = _Action.from_str
    order: dict[int, list[_Action | None]] = {0: [a("0F0"), a("0B0")]}
    assert pair_overlap_f_b(order, num_stages=1, stage_to_rank=lambda s: 0) == order


def test_untested_torch_is_refused() -> None:
    check_torch(torch.__version__)
    with pytest.raises(ConfigError, match=r"tested with torch 2.11, 2.13; received torch 2.99"):
        check_torch("2.99.0+cpu")


def test_the_action_check_counts_pairs_and_refuses_other_parts() -> None:
    a = _Action.from_str
    lowered = pair_overlap_f_b(
        {0: [a("0F0"), a("0F1"), a("0B0"), a("0B1")]}, num_stages=1, stage_to_rank=lambda s: 0
    )
    assert check_actions([x for x in lowered[0] if x is not None]) == 1
    parts = (_Action(0, FORWARD, 1), _Action(0, BACKWARD_INPUT, 0))
    with pytest.raises(ConfigError, match=r"expected each OVERLAP_F_B as \(FORWARD, FULL_BACK"):
        check_actions([_Action(-1, OVERLAP_F_B, None, parts)])


def test_stage_rank_checks_its_arguments_and_stages() -> None:
    """An unknown class was taken as a loop, pp=0 a ZeroDivisionError on first use, and a
    stage beyond a V's 2 * pp stages a negative rank."""
    cases: list[tuple[Any, str]] = [
        (lambda: stage_rank("Schedule2F2B", 2), "stage_rank: schedule_class must be one of"),
        (lambda: stage_rank("ScheduleInterleaved1F1B", 0), "stage_rank: pp must be an int >= 1"),
        (lambda: stage_rank("ScheduleDualPipeV", _bad(True)), "pp must be an int >= 1"),
        (
            lambda: stage_rank("ScheduleDualPipeV", 2)(4),
            "stage_rank('ScheduleDualPipeV'): a stage index must be an int in [0, 3]",
        ),
        (
            lambda: stage_rank("ScheduleInterleaved1F1B", 2)(-1),
            "stage_rank('ScheduleInterleaved1F1B'): a stage index must be an int >= 0",
        ),
        (lambda: stage_rank("ScheduleInterleaved1F1B", 2)(_bad("1")), "received str '1'"),
    ]
    for call, message in cases:
        with pytest.raises(ConfigError, match=re.escape(message)):
            call()
    assert [stage_rank("ScheduleDualPipeV", 2)(s) for s in range(4)] == [0, 1, 1, 0]
    assert [stage_rank("ScheduleInterleaved1F1B", 2)(s) for s in range(5)] == [0, 1, 0, 1, 0]


def test_an_order_its_arguments_disagree_with_is_refused() -> None:
    """Each returned the order unpaired without a word (every trial pairing failed its
    lowering), or raised a bare AttributeError / KeyError."""
    order = _interleaved(2, 2, 4)
    loop = stage_rank("ScheduleInterleaved1F1B", 2)
    cases: list[tuple[Any, str]] = [
        (
            lambda: pair_overlap_f_b(order, num_stages=2, stage_to_rank=loop),
            "received 2F0 on rank 0, outside num_stages=2",
        ),
        (
            lambda: pair_overlap_f_b(order, num_stages=8, stage_to_rank=loop),
            "expected an order torch lowers to communication without a deadlock",
        ),
        (
            lambda: pair_overlap_f_b(order, num_stages=4, stage_to_rank=lambda s: 0),
            "received 1F0 on rank 1, whose stage stage_to_rank puts on 0",
        ),
        (
            lambda: pair_overlap_f_b({0: order[0]}, num_stages=4, stage_to_rank=loop),
            "received none for rank(s) [1]",
        ),
        (  # rank 1's stages never run: torch's placement raised a bare KeyError
            lambda: pair_overlap_f_b(
                {0: order[0], 1: [None] * len(order[1])}, num_stages=4, stage_to_rank=loop
            ),
            "expected an order torch lowers to communication without a deadlock",
        ),
        (
            lambda: pair_overlap_f_b({0: _bad([1, 2])}, num_stages=4, stage_to_rank=loop),
            "order[0]: expected torch actions or None (bubbles), received int 1",
        ),
        (
            lambda: pair_overlap_f_b(_bad({"0": order[0]}), num_stages=4, stage_to_rank=loop),
            "order: expected a mapping of each pipeline rank (an int) to its actions",
        ),
    ]
    for call, message in cases:
        with pytest.raises(ConfigError, match=re.escape(message)):
            call()
    paired = pair_overlap_f_b(order, num_stages=4, stage_to_rank=loop)
    assert any(a is not None and a.sub_actions for a in paired[0])


def _bad(value: object) -> Any:
    """``value`` typed ``Any``: a misuse the type checkers would flag, made at run time."""
    return value
