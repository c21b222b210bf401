"""The torchtitan adapter under torchtitan's own pipeline split: PP=2 (two gloo processes)
and PP=2 x EP=2 (four), DualPipeV and paired interleaved 1F1B, with and without delayed
weight gradients and torchtitan's selective activation checkpointing.

The worker (:mod:`tests.adapters.titan_pp_worker`) says what is torchtitan's and what is
compared.
"""

from __future__ import annotations

import json
from typing import cast

import pytest

from tests.gloo_ranks import run_ranks

pytest.importorskip("torchtitan")


def _run(
    monkeypatch: pytest.MonkeyPatch, ep: int, runs: list[dict[str, object]]
) -> list[dict[str, object]]:
    monkeypatch.setenv("TITAN_PP_CASE", json.dumps({"ep": ep, "runs": runs}))
    rows = run_ranks("tests.adapters.titan_pp_worker", world=2 * ep, timeout=600)
    assert len(rows) == len(runs) * 2 * ep
    for r in rows:
        assert r["bit_identical"], r  # prepared schedule vs torch's execution of it
        assert r["vs_torchtitan_ok"], r  # vs torch's execution of torchtitan's own chunks
        assert r["pending"] == 0, r
        assert int(str(r["paired"])) > 0, r  # overlapped forward+backward pairs ran
        # torchtitan's SelectiveAC wrapped every block of the stages (kept in the chunks).
        assert (int(str(r["checkpointed"])) > 0) == r["ac"], r
    return rows


def _spec(schedule: str, *, delay: bool = False, ac: bool = False) -> dict[str, object]:
    return {"schedule": schedule, "delay": delay, "ac": ac}


@pytest.mark.slow
def test_pp2_dualpipev_and_interleaved_bit_identical(monkeypatch: pytest.MonkeyPatch) -> None:
    runs = [
        _spec("DualPipeV"),
        _spec("Interleaved1F1B", delay=True),
        _spec("DualPipeV", delay=True, ac=True),
        _spec("Interleaved1F1B", ac=True),
    ]
    rows = _run(monkeypatch, 1, runs)
    dualpipe = {int(str(r["rank"])): r for r in rows if r["schedule"] == "DualPipeV"}
    # torchtitan's V-shaped split: rank 0 holds the first and the last stage.
    assert dualpipe[0]["stages"] == [0, 3] and dualpipe[1]["stages"] == [1, 2]
    modules = cast("list[list[str]]", dualpipe[0]["modules"])
    assert modules[0][0] == "tok_embeddings" and modules[1][-2:] == ["norm", "lm_head"]


@pytest.mark.slow
def test_pp2_ep2_bit_identical(monkeypatch: pytest.MonkeyPatch) -> None:
    runs = [_spec("DualPipeV", ac=True), _spec("Interleaved1F1B", delay=True)]
    rows = _run(monkeypatch, 2, runs)
    assert {int(str(r["rank"])) for r in rows} == {0, 1, 2, 3}
    for r in rows:  # torchtitan's EP on every MoE stage, its parallelize wrappers kept
        if r["stages"] == [1, 2]:
            found = " ".join(map(str, cast("list[str]", r["ep"])))
            assert "AllToAllTokenDispatcher" in found and "ep=2" in found, r["ep"]
            assert "DTensor" in found and "instance forward" in found, r["ep"]
