"""FSDP2 with the overlap, on real gloo ranks: fully_shard_slots, exact, and the refusals.

The cases of one world size run in one launch; the launches start at once (the
``launches`` fixture)."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.gloo_ranks import run_ranks
from tests.parallel_runs import ParallelRuns, selected_in

CASES: dict[str, dict[str, Any]] = {
    "dp2-ep1": dict(dp=2, ep=1, microbatches=4),
    "dp2-ep2": dict(dp=2, ep=2, microbatches=4),
    "layer_level": dict(dp=2, ep=1, microbatches=2, layer_level=True),
    "delay": dict(dp=2, ep=1, microbatches=2, delay=True),
    # fsdp_worker.SCHEDULES: node schedules (3 microbatches in flight, R steps) and the
    # schedule's recompute of pre-dispatch and mlp, overlapped and fill/drain.
    "schedules-dp2-ep1": dict(
        dp=2,
        ep=1,
        microbatches=4,
        schedules=[
            "node",
            "node_recompute",
            "planner_fill_drain_recompute",
            "recompute",
            "recompute_fill_drain",
            "recompute_early_r",
        ],
    ),
    "schedules-dp2-ep2": dict(
        dp=2, ep=2, microbatches=4, schedules=["node_recompute", "recompute_fill_drain"]
    ),
}

Launches = Callable[[str], list[dict[str, Any]]]


def _world(case: dict[str, Any]) -> int:
    return int(case["dp"]) * int(case["ep"])


def _launch(world: int) -> dict[str, list[dict[str, Any]]]:
    """Every case of ``world`` ranks in one launch (``fsdp_worker``'s ``cases``: each runs
    as it would alone; most of a launch's time is its ranks' start): rows by case name."""
    group = {n: c for n, c in CASES.items() if _world(c) == world}
    env = {"FSDP_CASE": json.dumps({"cases": group})}
    launched = run_ranks("tests.integrations.fsdp_worker", world=world, timeout=600, env=env)
    return {n: [dict(r) for r in launched if r["case"] == n] for n in group}


@pytest.fixture(scope="module")
def launches(request: pytest.FixtureRequest) -> Iterator[Launches]:
    """A case's rows, by name. The launches of the selected tests' world sizes start at
    once, side by side."""
    case_of = {  # each test's case, by test name
        "test_fully_sharded_overlap_is_bit_identical_to_plain_fsdp[2-1]": "dp2-ep1",
        "test_fully_sharded_overlap_is_bit_identical_to_plain_fsdp[2-2]": "dp2-ep2",
        "test_fsdp_on_a_layer_is_refused": "layer_level",
        "test_fsdp_with_delayed_wgrad_is_refused": "delay",
        "test_node_schedules_and_recompute_are_bit_identical_to_plain_fsdp[2-1]": (
            "schedules-dp2-ep1"
        ),
        "test_node_schedules_and_recompute_are_bit_identical_to_plain_fsdp[2-2]": (
            "schedules-dp2-ep2"
        ),
    }
    worlds = sorted({_world(c) for c in CASES.values()})
    wanted = {_world(CASES[case_of[n]]) for n in selected_in(request) if n in case_of}
    runs = ParallelRuns(
        {str(w): functools.partial(_launch, w) for w in worlds},
        [str(w) for w in sorted(wanted, reverse=True)],
    )
    yield lambda name: runs.result(str(_world(CASES[name])))[name]
    runs.close()


@pytest.mark.parametrize(("dp", "ep"), [(2, 1), (2, 2)])
def test_fully_sharded_overlap_is_bit_identical_to_plain_fsdp(
    launches: Launches, dp: int, ep: int
) -> None:
    rows = launches(f"dp{dp}-ep{ep}")
    assert len(rows) == dp * ep
    for row in rows:
        assert row["losses"] == row["plain_losses"]
        assert row["overlap_vs_sequential"], f"rank {row['rank']}"
        assert row["overlap_vs_plain"], f"rank {row['rank']}: differs from plain FSDP2 training"
        assert row["close_to_single_process"], f"rank {row['rank']}"


@pytest.mark.parametrize(("dp", "ep"), [(2, 1), (2, 2)])
def test_node_schedules_and_recompute_are_bit_identical_to_plain_fsdp(
    launches: Launches, dp: int, ep: int
) -> None:
    """Each of the case's ways (``fsdp_worker.SCHEDULES``) against plain per-microbatch
    ``backward()`` on the same FSDP2 sharding: losses and gradient shards bit-identical."""
    name = f"schedules-dp{dp}-ep{ep}"
    rows = launches(name)
    assert len(rows) == dp * ep
    for row in rows:
        assert row["exact"] == dict.fromkeys(CASES[name]["schedules"], True), f"rank {row['rank']}"
        assert row["in_flight"] == 3  # the node schedule's random order keeps 3 in flight


def test_fsdp_on_a_layer_is_refused(launches: Launches) -> None:
    rows = launches("layer_level")
    assert len(rows) == 2
    for row in rows:
        for key in ("refused", "refused_node"):  # the macro schedule's and a node schedule's
            assert str(row[key]).startswith(
                "GPTMoEModel.decoder.layers[0] (FSDPDenseLayer): expected a layer that is not "
                "an FSDPModule, received one; the schedule calls _preprocess / _postprocess"
            )


def test_fsdp_with_delayed_wgrad_is_refused(launches: Launches) -> None:
    rows = launches("delay")
    assert len(rows) == 2
    for row in rows:
        for key in ("refused", "refused_node"):  # a node schedule's W steps alike
            assert "delayed weight gradients with FSDP2 modules are not composed" in row[key]
