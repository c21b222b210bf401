"""The torchtitan adapter under torchtitan's own pipeline split (PP=2, gloo processes).

The worker (:mod:`tests.adapters.titan_pp_worker`) says what is torchtitan's and what is
compared.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.gloo_ranks import run_ranks

pytest.importorskip("torchtitan")

SCHEDULES = ["DualPipeV", "Interleaved1F1B"]


def _run(monkeypatch: pytest.MonkeyPatch, *, ep: int, delay: bool) -> list[dict[str, object]]:
    case = {"ep": ep, "schedules": SCHEDULES, "delay": delay}
    monkeypatch.setenv("TITAN_PP_CASE", json.dumps(case))
    return run_ranks("tests.adapters.titan_pp_worker", world=2 * ep, timeout=600)


def _check(rows: list[dict[str, object]], world: int) -> None:
    assert sorted((str(r["schedule"]), int(str(r["rank"]))) for r in rows) == sorted(
        (s, r) for s in SCHEDULES for r in range(world)
    )
    for r in rows:
        assert r["bit_identical"], r
        assert r["vs_torchtitan_ok"], r
        assert r["pending"] == 0, r
        # DualPipeV emits its own overlapped pairs; interleaved 1F1B is paired by us.
        assert int(str(r["paired"])) > 0, r


@pytest.mark.slow
@pytest.mark.parametrize("delay", [False, True], ids=["plain-wgrad", "delayed-wgrad"])
def test_pp2_bit_identical_to_torchs_execution(
    monkeypatch: pytest.MonkeyPatch, delay: bool
) -> None:
    rows = _run(monkeypatch, ep=1, delay=delay)
    _check(rows, 2)
    by_rank = {int(str(r["rank"])): r for r in rows if r["schedule"] == "DualPipeV"}
    assert by_rank[0]["stages"] == [0, 3] and by_rank[1]["stages"] == [1, 2]
    assert "tok_embeddings" in str(by_rank[0]["modules"]) and "lm_head" in str(
        by_rank[0]["modules"]
    )


_ = os
