"""EP=2 ``combined_1f1b`` over gloo under the stream-order checker: ``ep_worker.py``'s cases
(shared experts, delayed weight gradients, masks and the auxiliary loss, chunked
all-to-alls, fill/drain with a starved rank) with ``MOE_OVERLAP_STREAM_CHECK=1``, every
operator of both ranks checked (``tests/stream_checked.py``; a race ends the rank with the
checker's message); each case bit-identical to plain training, as ``test_ep.py`` holds it.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.gloo_ranks import run_ranks
from tests.stream_checked import WORKER_ENV

CASES = ["shared_delay", "padded_aux_delay", "chunks3_shared_delay", "chunks2_starved_fill_drain"]


@pytest.mark.slow
def test_ep2_combined_1f1b_is_stream_ordered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOE_OVERLAP_STREAM_CHECK", "1")
    monkeypatch.setenv(WORKER_ENV, "tests.models.ep_worker")
    monkeypatch.setenv("EP_CASES", ",".join(CASES))
    rows: list[dict[str, Any]] = [dict(r) for r in run_ranks("tests.stream_checked")]
    totals = sorted((r for r in rows if "stream_check" in r), key=lambda r: r["stream_check"])
    assert [r["stream_check"] for r in totals] == [0, 1]
    for total in totals:
        assert total["cross_stream_storages"] > 0, total
    cases = [r for r in rows if "case" in r]
    assert sorted((r["case"], r["rank"]) for r in cases) == sorted(
        (c, rank) for c in CASES for rank in (0, 1)
    )
    for r in cases:
        assert r["losses_equal"] and r["mismatched"] == [] and r["missing"] == [], r
