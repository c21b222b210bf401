"""Expert parallelism over two real gloo processes: each rank checks its own gradients."""

from __future__ import annotations

import pytest

from tests.parallel_runs import ParallelRuns


@pytest.fixture
def ep2_results(ep2_rows: list[dict[str, object]]) -> list[dict[str, object]]:
    """``ep_worker``'s one launch with every case (shared with ``test_a2a_chunks.py``)."""
    return ep2_rows


CASES = [
    "moe",
    "shared_delay",
    "all_moe_aux",
    "starved_delay",
    "no_overlap",
    "count_group",
    "padded_aux_delay",
]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_ep2_bit_identical(ep2_results: list[dict[str, object]], case: str) -> None:
    rows = [r for r in ep2_results if r["case"] == case]
    assert sorted(int(str(r["rank"])) for r in rows) == [0, 1]
    for r in rows:
        assert r["losses_equal"], r
        assert r["mismatched"] == [], r
        assert r["missing"] == [], r


@pytest.mark.slow
def test_ep2_starved_rank_gets_no_tokens(ep2_results: list[dict[str, object]]) -> None:
    """Experts 0 and 1 (all of rank 0's) receive nothing; the all-to-all copes."""
    rows = [r for r in ep2_results if r["case"] == "starved_delay"]
    assert len(rows) == 2
    for r in rows:
        counts = r["tokens_per_expert"]
        assert isinstance(counts, list) and counts[0] == counts[1] == 0
        assert sum(counts) == 2 * 16 * 2  # batch * seq * top-k, all routed to rank 1


@pytest.mark.slow
def test_ep_size_must_divide_experts(ep2_results: list[dict[str, object]]) -> None:
    rows = [r for r in ep2_results if r["case"] == "config_error"]
    assert len(rows) == 2
    for r in rows:
        assert "num_experts=3" in str(r["message"]) and "EP size 2" in str(r["message"])


@pytest.mark.slow
def test_count_group_must_match_the_ep_group(ep2_results: list[dict[str, object]]) -> None:
    rows = [r for r in ep2_results if r["case"] == "count_group_error"]
    assert len(rows) == 2
    for r in rows:
        assert "count_group" in str(r["message"]) and "size 1" in str(r["message"])


@pytest.mark.slow
def test_ep2_debug_first_step_check_compares_on_every_rank(
    ep2_launches: ParallelRuns[list[dict[str, object]]],
) -> None:
    """Debug mode at EP=2 (``MOE_OVERLAP_DEBUG=1``, two cases; the launch started beside the
    plain one by ``conftest.ep2_launches``): every rank runs the first-step check (the same
    all-to-alls, in the same order), finds no difference, and the step stays bit-identical."""
    rows = ep2_launches.result("debug")
    assert sorted((str(r["case"]), int(str(r["rank"]))) for r in rows) == [
        ("padded_aux_delay", 0),
        ("padded_aux_delay", 1),
        ("shared_delay", 0),
        ("shared_delay", 1),
    ]
    for r in rows:
        assert r["first_step_check"] == "compared", r
        assert r["losses_equal"] and r["mismatched"] == [] and r["missing"] == [], r
