"""torch.distributed.pipelining schedules through moe_overlap plans, on real gloo ranks.

Each case runs the same torch schedule twice on identically initialised models: unprepared
(torch's own execution on the plain stage modules) and prepared by ``prepare_schedule``
(every compute action through plans, ``OVERLAP_F_B`` overlapped). Losses and every
gradient must be bit-identical, and within float32 rounding of single-process plain
training. The stage layout is uneven on purpose: stage 0 holds only the dense layer, the
others one or two MoE layers; ``starve`` routes no token to the last EP rank's experts.
The cases of one world size run in one launch; the launches start at once (the ``runs``
fixture).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest
import torch

from tests.gloo_ranks import run_ranks
from tests.parallel_runs import ParallelRuns, selected_in

# torch 2.11's stage set-up sends a warm-up tensor between the two stages a V-schedule
# puts on one rank; gloo cannot send to its own rank (2.13 skips same-rank neighbours).
V_ON_GLOO = pytest.mark.skipif(
    torch.__version__.startswith("2.11"),
    reason="torch 2.11 DualPipeV warm-up sends to the same rank, which gloo refuses",
)
# torch 2.11's own BACKWARD_WEIGHT (stage_backward_weight) reads ``_input_metadata`` of the
# autograd node, which a custom autograd.Function's node (the delayed-wgrad matmul) refuses:
# torch's unprepared run fails there, so there is nothing to compare with (fixed in 2.13).
ZB_ON_211 = pytest.mark.skipif(
    torch.__version__.startswith("2.11"),
    reason="torch 2.11's own BACKWARD_WEIGHT fails on custom autograd.Function nodes",
)

UNEVEN = [0, 1, 3, 4, 6]  # layer boundaries of 4 stages: dense only, 2 MoE, 1 MoE, 2 MoE

CASES: dict[str, dict[str, Any]] = {
    "dualpipev-pp2-mb4": dict(pp=2, ep=1, schedule="dualpipev", microbatches=4, delay=False),
    "dualpipev-pp2-mb8-delay": dict(pp=2, ep=1, schedule="dualpipev", microbatches=8, delay=True),
    "interleaved-pp2-mb4-delay": dict(
        pp=2, ep=1, schedule="interleaved", microbatches=4, delay=True
    ),
    "interleaved-pp2-mb8": dict(pp=2, ep=1, schedule="interleaved", microbatches=8, delay=False),
    "dualpipev-pp2-ep2-mb4-delay-starved": dict(
        pp=2, ep=2, schedule="dualpipev", microbatches=4, delay=True, starve=True
    ),
    "dualpipev-pp2-ep2-mb8": dict(pp=2, ep=2, schedule="dualpipev", microbatches=8, delay=False),
    "interleaved-pp2-ep2-mb8-delay": dict(
        pp=2, ep=2, schedule="interleaved", microbatches=8, delay=True
    ),
    "interleaved-pp2-mb4-positions": dict(
        pp=2, ep=1, schedule="interleaved", microbatches=4, delay=True, positions=True
    ),
    "interleaved-pp2-ep2-mb4-delay-masks": dict(
        pp=2, ep=2, schedule="interleaved", microbatches=4, delay=True, masks=True
    ),
    "interleaved-pp2-mb4-sequential": dict(
        pp=2, ep=1, schedule="interleaved", microbatches=4, delay=True, overlap=False
    ),
    # torch's other action-runtime schedules: I/W split, no pairs (zero bubble) or pairs.
    "interleaved-zero-bubble-pp2-mb4-delay": dict(
        pp=2, ep=1, schedule="interleaved-zero-bubble", microbatches=4, delay=True
    ),
    "zbv-pp2-mb4": dict(pp=2, ep=1, schedule="zbv", microbatches=4, delay=False),
    "looped-bfs-pp2-mb4": dict(pp=2, ep=1, schedule="looped-bfs", microbatches=4, delay=False),
    # transformers' Qwen3-MoE through the adapter (TransformersMoEStage), layer 0 dense.
    "qwen3-moe-interleaved-pp2-mb4": dict(
        pp=2, ep=1, schedule="interleaved", microbatches=4, delay=False, model="qwen3_moe"
    ),
    "qwen3-moe-dualpipev-pp2-mb4-delay": dict(
        pp=2, ep=1, schedule="dualpipev", microbatches=4, delay=True, model="qwen3_moe"
    ),
}


def _skipped_here(case: dict[str, Any]) -> bool:
    """Whether the case's test is skipped on this torch (``V_ON_GLOO``, ``ZB_ON_211``)."""
    return torch.__version__.startswith("2.11") and case["schedule"] in (
        "dualpipev",
        "zbv",
        "interleaved-zero-bubble",
    )


Launches = Callable[[str], list[dict[str, Any]]]


def _launch(world: int) -> Callable[[], dict[str, list[dict[str, Any]]]]:
    """The launch of every case of ``world`` ranks that runs here (``pp_worker``'s
    ``cases``: each runs as it would alone): its rows by case name."""

    def launch() -> dict[str, list[dict[str, Any]]]:
        group = {n: {"stages": UNEVEN, **c} for n, c in EVERY.items() if _world(c) == world}
        launched = run_ranks(
            "tests.integrations.pp_worker",
            world=world,
            timeout=600,
            env={"PP_CASE": json.dumps({"cases": group})},
        )
        return {
            n: [{k: v for k, v in r.items() if k != "case"} for r in launched if r["case"] == n]
            for n in group
        }

    return launch


def _world(case: dict[str, Any]) -> int:
    return int(case["pp"]) * int(case["ep"])


FAILURE = "test_failure_names_the_pipeline_position_and_the_next_step_is_exact"


def _failure() -> dict[str, Any]:
    """World 1: DualPipeV's two stages on one rank, a forward failing in microbatch 3."""
    case = dict(
        pp=1, ep=1, schedule="dualpipev", microbatches=4, delay=True, fail_at=3, stages=[0, 2, 4]
    )
    (row,) = run_ranks("tests.integrations.pp_worker", world=1, env={"PP_CASE": json.dumps(case)})
    return dict(row)


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest) -> Iterator[ParallelRuns[Any]]:
    """The launches of the selected tests, started at once, two at a time (a pipeline's
    ranks leave a core idle in its bubbles): one per world size for the cases (each
    ``pp_worker`` launch runs every case of its size: most of a launch's time is its
    ranks' start) and the failure test's."""
    jobs: dict[str, Callable[[], Any]] = {
        str(w): _launch(w) for w in sorted({_world(c) for c in EVERY.values()})
    }
    jobs[FAILURE] = _failure
    selected = selected_in(request)
    cases = {n.partition("[")[2].rstrip("]") for n in selected}
    ahead = [str(w) for w in sorted({_world(c) for n, c in EVERY.items() if n in cases})[::-1]]
    if FAILURE in selected and not torch.__version__.startswith("2.11"):  # V_ON_GLOO
        ahead.append(FAILURE)
    started = ParallelRuns(jobs, ahead)
    yield started
    started.close()


@pytest.fixture
def launches(runs: ParallelRuns[Any]) -> Launches:
    """A case's rows, by name (:data:`CASES`, :data:`EVAL_CASES`)."""
    return lambda name: cast("list[dict[str, Any]]", runs.result(str(_world(EVERY[name])))[name])


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=V_ON_GLOO)
        if CASES[n]["schedule"] in ("dualpipev", "zbv")
        else pytest.param(n, marks=ZB_ON_211)
        if CASES[n]["schedule"] == "interleaved-zero-bubble"
        else n
        for n in sorted(CASES)
    ],
)
def test_overlapped_schedule_is_bit_identical(launches: Launches, name: str) -> None:
    rows = launches(name)
    assert len(rows) == CASES[name]["pp"] * CASES[name]["ep"]
    # Zero-bubble schedules backward in I/W halves; looped BFS has no F/B neighbours to pair.
    pairs_expected = CASES[name]["schedule"] in ("dualpipev", "interleaved")
    for row in rows:
        assert (row["pairs"] > 0) == pairs_expected, row["pairs"]
        assert row["plan_steps"] > 0, "the compute actions ran through plans"
        if CASES[name].get("overlap", True):
            assert row["switches"] >= 2 * row["pairs"], "overlapped runs interleave microbatches"
        assert row["got"] == row["base"], f"rank {row['rank']}: losses differ"
        if CASES[name].get("model") == "qwen3_moe" and CASES[name]["delay"]:
            # The adapter computes delayed expert weight gradients with its own grouped
            # GEMM, not the experts module's autograd: those equal torch's run to rounding
            # (close_to_plain below); every other gradient is bit-identical.
            assert all(".experts." in n for n in row["differ"]), row["differ"]
        else:
            assert row["identical"], f"rank {row['rank']}: {row['differ']} differ from torch's"
        assert row["close_to_plain"], f"rank {row['rank']}: far from plain training"
    losses = [r["got"] for r in rows if r["got"][0]]
    assert losses and all(len(step) == CASES[name]["microbatches"] for step in losses[0])


@V_ON_GLOO
def test_failure_names_the_pipeline_position_and_the_next_step_is_exact(
    runs: ParallelRuns[Any],
) -> None:
    """World 1: DualPipeV's two stages on one rank (the V hand-off, I/W actions)."""
    row = runs.result(FAILURE)
    failure = str(row["failure"])
    assert failure.startswith("pipeline rank 0, stage 1 microbatch 2 (forward) with stage 0 ")
    assert "OVERLAP_F_B" in failure and "slot pre_dispatch" in failure
    assert "injected failure" in failure
    assert row["got"] == row["base"] and row["identical"] and row["close_to_plain"]


# --- issue 24, part wgrad: forward-only runs of a prepared schedule -----------------------------

EVAL_CASES: dict[str, dict[str, Any]] = {
    # I/W actions (zero bubble); torch's own eval runs it too.
    "eval-interleaved-zero-bubble-pp2-delay": dict(
        pp=2, ep=1, schedule="interleaved-zero-bubble", microbatches=4, delay=True
    ),
    "eval-interleaved-pp2": dict(pp=2, ep=1, schedule="interleaved", microbatches=4, delay=False),
    # V-shaped, I/W actions: torch's own eval fails in the V hand-off of a backward (its
    # get_local_bwd_output asserts the stage has a backward); the prepared one runs.
    "eval-dualpipev-pp2-delay": dict(pp=2, ep=1, schedule="dualpipev", microbatches=4, delay=True),
}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=V_ON_GLOO)
        if "dualpipev" in n
        else pytest.param(n, marks=ZB_ON_211)  # its step after eval compares with torch's
        if "zero-bubble" in n
        else n
        for n in sorted(EVAL_CASES)
    ],
)
def test_eval_and_a_schedule_without_loss_fn_run_forward_only(
    launches: Launches, name: str
) -> None:
    """schedule.eval() and a schedule built with loss_fn=None, prepared: the plain model's
    outputs and losses, no gradient touched; the same schedule then trains exactly."""
    rows = launches(name)
    assert len(rows) == EVAL_CASES[name]["pp"]
    for row in rows:
        failed = [k for k, v in row.items() if k != "rank" and v is not True]
        assert not failed, f"rank {row['rank']}: {failed}"


EVERY: dict[str, dict[str, Any]] = {
    **{n: c for n, c in CASES.items() if not _skipped_here(c)},
    **{n: {**c, "eval": True} for n, c in EVAL_CASES.items() if not _skipped_here(c)},
}
"""Every case that runs here, by name."""
