"""``pair_overlap_f_b`` makes the pairs it made when torch checked every trial pairing.

The library checks a trial on its wait graph (``_waits``) and asks torch only to confirm
a refusal and the result; these tests compare it with the old pairing
(``tests/integrations/_pairing_reference.py``) on every schedule class torch ships, and
on orders the graph misjudges, where the result must still be torch's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from torch.distributed.pipelining.schedules import _Action

from moe_overlap import ConfigError
from moe_overlap.integrations.pipelining import _lowering as lowering
from moe_overlap.integrations.pipelining import pair_overlap_f_b, schedule_order, stage_rank
from moe_overlap.integrations.pipelining._lowering import SCHEDULE_CLASSES, Order
from moe_overlap.integrations.pipelining._waits import WaitGraph
from tests.integrations._pairing_reference import pair_overlap_f_b_reference

_SINGLE = ("ScheduleGPipe", "Schedule1F1B")
_V = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")


def _grid() -> Iterator[tuple[str, int, int, int]]:
    """Each class, pp 1..8, its valid stages per rank, microbatch counts odd, even, below
    pp and not divisible by it (kept small: the reference is slow)."""
    for name in SCHEDULE_CLASSES:
        pers = (1,) if name in _SINGLE else (2,) if name in _V else (1, 2, 3)
        for pp in range(1, 9):
            for per in pers:
                for n_mb in sorted({1, 2, 3, 5, pp, pp + 1, 2 * pp + 1, 3 * pp + 2}):
                    yield name, pp, per, n_mb


def _same(order: Order, num_stages: int, rank_of: Callable[[int], int]) -> bool:
    got = pair_overlap_f_b(order, num_stages=num_stages, stage_to_rank=rank_of)
    want = pair_overlap_f_b_reference(order, num_stages=num_stages, stage_to_rank=rank_of)
    return got == want and list(got) == list(want)


class _Torch:
    """What torch's placement answered, trial by trial (``_lowers``), and how often the
    pairing ran (``_pair``: twice when the result's check sent it back to torch alone)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.answers: list[bool] = []
        self.pairings = 0
        lowers, pair = lowering._lowers, lowering._pair

        def counted_lowers(order: Order, num_stages: int, rank_of: Callable[[int], int]) -> bool:
            self.answers.append(lowers(order, num_stages, rank_of))
            return self.answers[-1]

        def counted_pair(*args: Any) -> Any:
            self.pairings += 1
            return pair(*args)

        monkeypatch.setattr(lowering, "_lowers", counted_lowers)
        monkeypatch.setattr(lowering, "_pair", counted_pair)


def test_every_torch_schedule_pairs_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same pairs, and torch only confirms: it never makes a pair the graph refused
    (at most two placements succeed: the order's and the result's) nor undoes one."""
    torch_ = _Torch(monkeypatch)
    checked, differ, asked = 0, [], []
    for name, pp, per, n_mb in _grid():
        try:
            order = schedule_order(name, pp=pp, stages_per_rank=per, n_microbatches=n_mb)
        except ConfigError:
            continue  # a count torch's class refuses
        torch_.answers, torch_.pairings = [], 0
        if not _same(order, pp * per, stage_rank(name, pp)):
            differ.append((name, pp, per, n_mb))
        if torch_.pairings != 1 or sum(torch_.answers) > 2:
            asked.append((name, pp, per, n_mb, torch_.pairings, torch_.answers))
        checked += 1
    assert not differ
    assert not asked
    assert checked > 250  # the grid is not skipped away


def test_a_torch_schedule_asks_torch_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """The order's check and the result's: no trial of the steady state goes to torch."""
    torch_ = _Torch(monkeypatch)
    order = schedule_order("ScheduleInterleaved1F1B", pp=4, stages_per_rank=2, n_microbatches=32)
    paired = pair_overlap_f_b(order, num_stages=8, stage_to_rank=lambda s: s % 4)
    assert sum(1 for acts in paired.values() for a in acts if a is not None and a.sub_actions)
    assert (torch_.answers, torch_.pairings) == ([True, True], 1)


def _orders() -> dict[str, dict[int, list[_Action | None]]]:
    a = _Action.from_str
    return {
        # 1B1 listed twice: the graph waits for both, a cycle; torch takes the first.
        "cyclic graph": {0: [a("0B1"), a("0F0")], 1: [a("1B1"), a("1F0"), a("1B1")]},
        # 0F0 listed twice: the graph waits for both, so refuses (1F0;1B2); torch makes it.
        "graph overruled": {0: [a("0F0"), a("0B2"), a("0F0")], 1: [a("1B2"), a("1F0")]},
        "a refusal": {
            0: [a("0F0"), a("0F1"), a("0B0"), a("0B1")],
            1: [a("1F0"), a("1B0"), a("1F1"), a("1B1")],
        },
    }


@pytest.mark.parametrize(
    ("case", "answers"),
    [
        ("cyclic graph", [True, True, False, True]),  # the order's check, then each trial
        # (0F0;0B2) made on the graph's word; (1F0;1B2) refused by it, made by torch
        ("graph overruled", [True, True, True]),
        ("a refusal", [True, False, True]),  # (0F1;0B0) refused, then the result's check
    ],
)
def test_orders_the_graph_misjudges_pair_as_torch_does(
    case: str, answers: list[bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    order = _orders()[case]
    torch_ = _Torch(monkeypatch)
    paired = pair_overlap_f_b(order, num_stages=2, stage_to_rank=lambda s: s)
    assert any(x is not None and x.sub_actions for acts in paired.values() for x in acts)
    assert (torch_.answers, torch_.pairings) == (answers, 1)
    assert _same(order, 2, lambda s: s)


def test_a_graph_that_accepts_every_pair_still_gives_torchs_pairs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The result's check catches a wrong pairing and pairs again with torch alone."""

    def accept(self: WaitGraph, u: int, v: int) -> bool:
        return True

    monkeypatch.setattr(WaitGraph, "try_merge", accept)
    order = _orders()["a refusal"]
    assert _same(order, 2, lambda s: s)


@pytest.mark.parametrize(
    ("name", "pp", "per", "n_mb"),
    [
        ("ScheduleInterleaved1F1B", 4, 2, 12),
        ("ScheduleInterleaved1F1B", 3, 3, 8),
        ("ScheduleGPipe", 4, 1, 5),
    ],
)
def test_the_graph_stays_in_topological_order(
    name: str, pp: int, per: int, n_mb: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After each merge every edge still points forward in the graph's order, which is what
    lets a check search only between the two nodes."""
    merge = WaitGraph.try_merge
    merged: list[bool] = []

    def checked(self: WaitGraph, u: int, v: int) -> bool:
        merged.append(merge(self, u, v))
        live = [x for x in self._topo if self._find(x) == x]
        assert sorted(self._pos[x] for x in self._topo) == list(range(len(self._topo)))
        for x in live:
            assert all(self._pos[y] > self._pos[x] for y in self._successors(x)), (u, v, x)
        return merged[-1]

    monkeypatch.setattr(WaitGraph, "try_merge", checked)
    order = schedule_order(name, pp=pp, stages_per_rank=per, n_microbatches=n_mb)
    pair_overlap_f_b(order, num_stages=pp * per, stage_to_rank=stage_rank(name, pp))
    assert any(merged)
