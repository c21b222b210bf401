"""FSDP2 (``fully_shard_slots``) with the overlap under the stream-order checker, on real
gloo ranks: ``fsdp_worker.py`` at DP=2 with ``MOE_OVERLAP_STREAM_CHECK=1``, every operator
of both ranks checked (``tests/stream_checked.py``; a race ends the rank with the checker's
message); bit-identical to plain FSDP2 training, as ``test_fsdp.py`` holds it. (DP=2 x EP=2
passes too; it costs four processes: EP under the checker is ``test_stream_order_ep.py``'s
and ``test_stream_order_pp.py``'s.)
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.gloo_ranks import run_ranks
from tests.stream_checked import WORKER_ENV


@pytest.mark.slow
def test_fully_sharded_overlap_is_stream_ordered(monkeypatch: pytest.MonkeyPatch) -> None:
    dp, ep = 2, 1
    monkeypatch.setenv("MOE_OVERLAP_STREAM_CHECK", "1")
    monkeypatch.setenv(WORKER_ENV, "tests.integrations.fsdp_worker")
    monkeypatch.setenv("FSDP_CASE", json.dumps({"dp": dp, "ep": ep, "microbatches": 2}))
    rows: list[dict[str, Any]] = [dict(r) for r in run_ranks("tests.stream_checked", world=dp * ep)]
    totals = sorted((r for r in rows if "stream_check" in r), key=lambda r: r["stream_check"])
    assert [r["stream_check"] for r in totals] == list(range(dp * ep))
    for total in totals:
        assert total["cross_stream_storages"] > 0, total
    runs = [r for r in rows if "losses" in r]
    assert len(runs) == dp * ep
    for row in runs:
        assert row["losses"] == row["plain_losses"]
        assert row["overlap_vs_sequential"], f"rank {row['rank']}"
        assert row["overlap_vs_plain"], f"rank {row['rank']}: differs from plain FSDP2 training"
