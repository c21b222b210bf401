"""The torchtitan adapter under torchtitan's own pipeline split: PP=2 (two gloo processes)
and PP=2 x EP=2 (four), DualPipeV and paired interleaved 1F1B, with and without delayed
weight gradients and torchtitan's selective activation checkpointing.

The worker (:mod:`tests.adapters.titan_pp_worker`) says what is torchtitan's and what is
compared. The two launches start ahead of their tests, side by side.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator
from typing import cast

import pytest

from tests.gloo_ranks import run_ranks
from tests.parallel_runs import ParallelRuns, selected_in

pytest.importorskip("torchtitan")


def _spec(schedule: str, *, delay: bool = False, ac: bool = False) -> dict[str, object]:
    return {"schedule": schedule, "delay": delay, "ac": ac}


LAUNCHES: dict[str, tuple[int, list[dict[str, object]]]] = {
    "test_pp2_dualpipev_and_interleaved_bit_identical": (
        1,
        [
            _spec("DualPipeV"),
            _spec("Interleaved1F1B", delay=True),
            _spec("DualPipeV", delay=True, ac=True),
            _spec("Interleaved1F1B", ac=True),
        ],
    ),
    "test_pp2_ep2_bit_identical": (
        2,
        [_spec("DualPipeV", ac=True), _spec("Interleaved1F1B", delay=True)],
    ),
}
"""Each test's EP size and runs, by test name (the world: PP=2 x EP)."""


def _launch(ep: int, runs: list[dict[str, object]]) -> list[dict[str, object]]:
    env = {"TITAN_PP_CASE": json.dumps({"ep": ep, "runs": runs})}
    return run_ranks("tests.adapters.titan_pp_worker", world=2 * ep, timeout=600, env=env)


@pytest.fixture(scope="module")
def launches(request: pytest.FixtureRequest) -> Iterator[ParallelRuns[list[dict[str, object]]]]:
    """The selected tests' launches, started ahead of them, side by side."""
    jobs: dict[str, Callable[[], list[dict[str, object]]]] = {
        n: functools.partial(_launch, ep, runs) for n, (ep, runs) in LAUNCHES.items()
    }
    started = ParallelRuns(jobs, [n for n in selected_in(request) if n in jobs])
    yield started
    started.close()


def _rows(
    request: pytest.FixtureRequest, launches: ParallelRuns[list[dict[str, object]]]
) -> list[dict[str, object]]:
    """This test's rows, each checked: exact, paired, nothing pending, AC as asked."""
    ep, runs = LAUNCHES[request.node.name]
    rows = launches.result(request.node.name)
    assert len(rows) == len(runs) * 2 * ep
    for r in rows:
        assert r["bit_identical"], r  # prepared schedule vs torch's execution of it
        assert r["vs_torchtitan_ok"], r  # vs torch's execution of torchtitan's own chunks
        assert r["pending"] == 0, r
        assert int(str(r["paired"])) > 0, r  # overlapped forward+backward pairs ran
        # torchtitan's SelectiveAC wrapped every block of the stages (kept in the chunks).
        assert (int(str(r["checkpointed"])) > 0) == r["ac"], r
    return rows


@pytest.mark.slow
def test_pp2_dualpipev_and_interleaved_bit_identical(
    request: pytest.FixtureRequest, launches: ParallelRuns[list[dict[str, object]]]
) -> None:
    rows = _rows(request, launches)
    dualpipe = {int(str(r["rank"])): r for r in rows if r["schedule"] == "DualPipeV"}
    # torchtitan's V-shaped split: rank 0 holds the first and the last stage.
    assert dualpipe[0]["stages"] == [0, 3] and dualpipe[1]["stages"] == [1, 2]
    modules = cast("list[list[str]]", dualpipe[0]["modules"])
    assert modules[0][0] == "tok_embeddings" and modules[1][-2:] == ["norm", "lm_head"]


@pytest.mark.slow
def test_pp2_ep2_bit_identical(
    request: pytest.FixtureRequest, launches: ParallelRuns[list[dict[str, object]]]
) -> None:
    rows = _rows(request, launches)
    assert {int(str(r["rank"])) for r in rows} == {0, 1, 2, 3}
    for r in rows:  # torchtitan's EP on every MoE stage, its parallelize wrappers kept
        if r["stages"] == [1, 2]:
            found = " ".join(map(str, cast("list[str]", r["ep"])))
            assert "AllToAllTokenDispatcher" in found and "ep=2" in found, r["ep"]
            assert "DTensor" in found and "instance forward" in found, r["ep"]
