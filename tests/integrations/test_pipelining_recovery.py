"""After a failed prepared pipelining step: exact on every rank, or refused on every rank.

Real gloo ranks (``pp_recovery_worker``), the pipeline and EP groups with a 3 s timeout so a
rank blocked on a failed peer fails quickly. Each case: step 0 exact, step 1 with a fault
on some or all ranks, step 2 after the documented recovery. A failure while the step
communicates must raise on every rank in step 1 (a ScheduleError; the failing rank its own
positioned one), refuse step 2 on every rank before any communication, and refuse a new
schedule on the same groups. A failure before the step communicates on every rank, or
after its communication completed, must leave step 2 exact on every rank. The three
launches (PP=2 in two, PP=2 x EP=2) run at once.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from tests.gloo_ranks import run_ranks
from tests.parallel_runs import ParallelRuns, selected_in

UNEVEN = [0, 1, 3, 4, 6]  # layer boundaries of 4 stages: dense only, 2 MoE, 1 MoE, 2 MoE
INJECTED = "injected failure"
RECOVER = "restore the last checkpoint, create new process groups"

# Interleaved 1F1B is paired (OVERLAP_F_B); the zero-bubble schedule has I/W actions.
PP2: list[dict[str, Any]] = [
    dict(
        name="forward-one",
        schedule="interleaved",
        delay=True,
        fault=dict(kind="forward", ranks=[0]),
    ),
    # rank 0's second forward needs nothing of rank 1, rank 1's first one only rank 0's first:
    # both ranks fail on their own, none waits for a peer (receives posted, none timed out).
    dict(
        name="forward-all",
        schedule="interleaved",
        delay=True,
        fault=dict(kind="forward", at={"0": 2, "1": 1}, ranks=[0, 1]),
        own=[0, 1],
    ),
    dict(
        name="overlap-all",
        schedule="interleaved",
        delay=False,
        fault=dict(kind="overlap", ranks=[0, 1]),
    ),
    dict(
        name="backward-one",
        schedule="interleaved",
        delay=True,
        fault=dict(kind="backward", at=2, ranks=[1]),
        own_consensus_group=True,
    ),
    dict(
        name="input-all",
        schedule="interleaved-zero-bubble",
        delay=True,
        fault=dict(kind="input", ranks=[0, 1]),
    ),
    dict(
        name="weight-one",
        schedule="interleaved-zero-bubble",
        delay=False,
        fault=dict(kind="weight", at=2, ranks=[1]),
    ),
    dict(
        name="before-all",
        schedule="interleaved",
        delay=True,
        fault=dict(kind="before", ranks=[0, 1]),
    ),
    dict(name="after-one", schedule="interleaved", delay=True, fault=dict(kind="after", ranks=[1])),
    # Last: rank 1's consensus times out (rank 0 left without it).
    dict(
        name="interrupt-one",
        schedule="interleaved",
        delay=False,
        consensus_timeout=4,
        fault=dict(kind="interrupt", at=2, ranks=[0]),
    ),
]
# torch 2.11's own BACKWARD_WEIGHT fails on a custom autograd.Function's node (see
# test_pipelining.ZB_ON_211): its zero-bubble schedules run only from 2.13.
if torch.__version__.startswith("2.11"):
    PP2 = [c for c in PP2 if c["schedule"] != "interleaved-zero-bubble"]

PP2_EP2: list[dict[str, Any]] = [
    dict(
        name="overlap-one",
        schedule="interleaved",
        delay=True,
        fault=dict(kind="overlap", ranks=[3]),
    ),
    dict(
        name="forward-all",
        schedule="interleaved",
        delay=False,
        fault=dict(kind="forward", at={"0": 2, "1": 2, "2": 1, "3": 1}, ranks=[0, 1, 2, 3]),
    ),
]

CONSISTENT = ("before-all", "after-one")


def _launch(pp: int, ep: int, cases: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    config = dict(
        pp=pp,
        ep=ep,
        timeout=3,
        stages=UNEVEN,
        cases=[{"microbatches": 4, **c} for c in cases],
    )
    rows = run_ranks(
        "tests.integrations.pp_recovery_worker",
        world=pp * ep,
        timeout=300,
        env={"PP_RECOVERY": json.dumps(config)},
    )
    by_case: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_case.setdefault(str(row["case"]), []).append(dict(row))
    assert sorted(by_case) == sorted(c["name"] for c in cases)
    assert all(len(v) == pp * ep for v in by_case.values())
    return by_case


def _check_poisoned(case: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    faulty = case["fault"]["ranks"]
    for row in rows:
        where = f"{case['name']}, rank {row['rank']}"
        assert row["step0"]["raised"] is None and row["step0_exact"], where
        s1, s2 = row["step1"], row["step2"]
        if case["fault"]["kind"] == "interrupt" and row["rank"] in faulty:
            assert s1["raised"] == "KeyboardInterrupt", where  # unchanged, no consensus
        else:
            assert s1["raised"] == "ScheduleError", (where, s1)
            assert RECOVER in s1["message"], (where, s1["message"])
        if row["rank"] in case.get("own", []):
            # Its own positioned error first: the pipeline rank, the action, the plan step.
            assert s1["message"].startswith(f"pipeline rank {row['rank']}, stage "), where
            assert INJECTED in s1["message"], where
        if case["fault"]["kind"] != "interrupt":
            failed = [
                r
                for r in faulty
                if INJECTED in next(x["step1"]["message"] for x in rows if x["rank"] == r)
            ]
            assert failed, f"{case['name']}: no rank reached its fault"
            for r in failed:
                assert f"global rank {r} (while the step communicated)" in s1["message"], where
        # Refused on every rank, before any communication (no timeout waited).
        assert s2["raised"] == "ScheduleError", (where, s2)
        assert "refuses to step" in s2["message"] and RECOVER in s2["message"], where
        assert s2["seconds"] < 2.0, (where, s2["seconds"])
        rebuilt = row["rebuilt_on_old_groups"]
        assert rebuilt["raised"] == "ConfigError", (where, rebuilt)
        assert "was used by a schedule whose step failed" in rebuilt["message"], where


def _check_consistent(case: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    faulty = case["fault"]["ranks"]
    for row in rows:
        where = f"{case['name']}, rank {row['rank']}"
        assert row["step0"]["raised"] is None and row["step0_exact"], where
        s1 = row["step1"]
        if row["rank"] in faulty:  # its own error, unchanged
            expected = "WgradError" if case["fault"]["kind"] == "before" else "RuntimeError"
            assert s1["raised"] == expected, (where, s1)
        else:
            assert s1["raised"] == "ScheduleError", (where, s1)
            assert "nothing of it is in flight" in s1["message"], where
        assert row["step2"]["raised"] is None and row["step2_exact"], (where, row["step2"])
        assert "rebuilt_on_old_groups" not in row


Launched = dict[str, list[dict[str, Any]]]
_FIRST = ("forward-one", "forward-all", "overlap-all", "backward-one", "before-all")
LAUNCHES: dict[str, Callable[[], Launched]] = {
    "pp2-first": lambda: _launch(2, 1, [c for c in PP2 if c["name"] in _FIRST]),
    "pp2-rest": lambda: _launch(2, 1, [c for c in PP2 if c["name"] not in _FIRST]),
    "pp2-ep2": lambda: _launch(2, 2, PP2_EP2),
}
"""The launches by name: PP2's cases in two (``interrupt-one`` last in its own), PP2_EP2's."""
TEST_LAUNCHES = {
    "test_pp2_failures_poison_or_recover_on_every_rank": ("pp2-first", "pp2-rest"),
    "test_pp2_ep2_failures_poison_every_rank": ("pp2-ep2",),
}
"""Each test's launches, by test name."""


@pytest.fixture(scope="module")
def _launches(request: pytest.FixtureRequest) -> Iterator[ParallelRuns[Launched]]:
    """The selected tests' launches, started together: most of a launch's time is a rank
    waiting out a failed peer's timeout, which leaves the cores to the other launches."""
    ahead = [n for t in selected_in(request) for n in TEST_LAUNCHES.get(t, ())]
    runs = ParallelRuns(LAUNCHES, ahead, workers=len(LAUNCHES))
    yield runs
    runs.close()


@pytest.fixture
def launched(request: pytest.FixtureRequest, _launches: ParallelRuns[Launched]) -> Launched:
    """This test's launches: their rows by case name."""
    found: Launched = {}
    for name in TEST_LAUNCHES[request.node.name]:
        found.update(_launches.result(name))
    return found


def test_pp2_failures_poison_or_recover_on_every_rank(launched: Launched) -> None:
    by_case = launched
    for case in PP2:
        rows = by_case[case["name"]]
        if case["name"] in CONSISTENT:
            _check_consistent(case, rows)
        else:
            _check_poisoned(case, rows)
    for row in by_case["backward-one"]:  # consensus_group of the user's
        alone = row["consensus_group_alone"]
        assert alone["raised"] == "ConfigError", alone
        assert (
            "expected a consensus_group holding every rank of the stages' groups"
            in (alone["message"])
        )
    interrupted = {r["rank"]: r for r in by_case["interrupt-one"]}
    assert "did not all report this step's outcome" in interrupted[1]["step1"]["message"]


def test_pp2_ep2_failures_poison_every_rank(launched: Launched) -> None:
    by_case = launched
    for case in PP2_EP2:
        _check_poisoned(case, by_case[case["name"]])
