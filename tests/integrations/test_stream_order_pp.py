"""Prepared torch pipelining schedules under the stream-order checker, on real gloo ranks.

One launch of four ranks runs DualPipeV, paired interleaved 1F1B and ZBV zero bubble at
PP=2 (two pipelines side by side) and at PP=2 x EP=2 (``stream_order_pp_worker.py``, with
``pp_worker.py``'s models, stages and data) with ``MOE_OVERLAP_STREAM_CHECK=1``: every
operator of every rank is checked (``tests/stream_checked.py``; a race ends the rank with
the checker's message). Each schedule must have used its streams together on every rank
and given finite losses and gradients; bit-identity with torch's own execution is
``test_pipelining.py``'s, and under the checker the one-process
``tests/engine/test_stream_order_compositions.py``'s.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.gloo_ranks import run_ranks
from tests.stream_checked import WORKER_ENV

# torch 2.11's stage set-up sends a warm-up tensor between the two stages a V-schedule puts on
# one rank; gloo cannot send to its own rank (2.13 skips same-rank neighbours).
V_ON_GLOO = pytest.mark.skipif(
    torch.__version__.startswith("2.11"),
    reason="torch 2.11 V-schedule warm-up sends to the same rank, which gloo refuses",
)
LAYOUTS = ["pp2", "pp2-ep2"]
SCHEDULES = ["dualpipev", "interleaved", "zbv"]
WORLD = 4


@pytest.fixture(scope="module")
def pp_rows() -> list[dict[str, Any]]:
    """Every rank's rows of the one launch (the environment put back after it)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MOE_OVERLAP_STREAM_CHECK", "1")
        env.setenv(WORKER_ENV, "tests.integrations.stream_order_pp_worker")
        return [dict(r) for r in run_ranks("tests.stream_checked", world=WORLD)]


@pytest.mark.slow
@V_ON_GLOO
def test_every_rank_ran_checked(pp_rows: list[dict[str, Any]]) -> None:
    totals = sorted((r for r in pp_rows if "stream_check" in r), key=lambda r: r["stream_check"])
    assert [r["stream_check"] for r in totals] == list(range(WORLD))
    for total in totals:
        assert total["cross_stream_storages"] > 0, total
    runs = [(r["layout"], r["schedule"], r["rank"]) for r in pp_rows if "schedule" in r]
    assert sorted(runs) == sorted(
        (layout, s, rank) for layout in LAYOUTS for s in SCHEDULES for rank in range(WORLD)
    )


@pytest.mark.slow
@V_ON_GLOO
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_prepared_schedule_is_stream_ordered(
    pp_rows: list[dict[str, Any]], layout: str, schedule: str
) -> None:
    rows = [r for r in pp_rows if r.get("layout") == layout and r.get("schedule") == schedule]
    assert sorted(r["rank"] for r in rows) == list(range(WORLD))
    for row in rows:
        where = f"{layout} {schedule} on rank {row['rank']}"
        assert row["checked_ops"] > 0 and row["cross_stream_storages"] > 0, where
        if schedule != "zbv":  # zero bubble's backward comes in I/W halves: nothing to pair
            assert row["pairs"] > 0, where
        assert row["losses_finite"] and row["bad_grads"] == [], where
    last = [r["losses"] for r in rows if r["losses"][0]]  # the ranks of the last stage
    assert last and all(len(step) == 4 for losses in last for step in losses)
