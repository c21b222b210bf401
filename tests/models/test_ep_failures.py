"""After a failed ``combined_1f1b`` step under expert parallelism: refused or exact, on
every rank.

Real gloo ranks (``ep_failure_worker``), EP=2 with a 3 s EP-group timeout so that a rank
blocked in an all-to-all with a failed peer fails quickly, and a ``consensus_group``. Each
case: step 0 exact, step 1 with a fault on some ranks, step 2 after the documented recovery.
Without the vote, a failure on one rank lets the next step's all-to-all messages meet the
failed step's: gloo aborts a process on the size mismatch, and a message of the expected
size is read as data (``docs/errors.md``). With it, a failure while the step communicated
raises on every rank in step 1 and refuses step 2 (and the model, and the group) on every
rank before any communication; a failure before the step communicated on every rank leaves
step 2 exact.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from tests.gloo_ranks import run_ranks

INJECTED = "injected failure"
RECOVER = "restore the last checkpoint, on every rank, into a new model built on new"

CASES: list[dict[str, Any]] = [
    # rank 1's forward fails mid-step; rank 0 waits in the all-to-all until its timeout
    dict(name="forward-one", kind="forward", ranks=[1], consensus=True),
    # rank 1's input is refused before its step communicates; rank 0's step communicates
    dict(name="before-one", kind="before", ranks=[1], consensus=True),
    # every rank's input refused before the step communicates: nothing in flight
    dict(name="before-all", kind="before", ranks=[0, 1], consensus=True),
]


@pytest.fixture(scope="module")
def rows() -> dict[str, dict[int, dict[int, dict[str, Any]]]]:
    """By case, rank and step: how each step ended."""
    os.environ["EP_FAILURE"] = json.dumps({"timeout": 3, "cases": CASES})
    try:
        found = run_ranks("tests.models.ep_failure_worker", timeout=120)
    finally:
        del os.environ["EP_FAILURE"]
    by: dict[str, dict[int, dict[int, dict[str, Any]]]] = {}
    for row in found:
        by.setdefault(str(row["case"]), {}).setdefault(int(str(row["rank"])), {})[
            int(str(row["step"]))
        ] = dict(row)
    return by


@pytest.mark.slow
@pytest.mark.parametrize("name", ["forward-one", "before-one"])
def test_a_failure_on_one_rank_raises_on_every_rank_and_refuses_the_next_step(
    rows: dict[str, dict[int, dict[int, dict[str, Any]]]], name: str
) -> None:
    case = rows[name]
    assert sorted(case) == [0, 1]
    for rank, steps in case.items():
        where = f"{name}, rank {rank}"
        assert steps[0]["raised"] is None and steps[0]["exact"], (where, steps[0])
        s1, s2, s3 = steps[1], steps[2], steps[3]
        # Step 1: a ScheduleError on every rank naming the failed ranks, the step, the way on.
        assert s1["raised"] == "ScheduleError", (where, s1)
        assert f"global rank {rank}, combined_1f1b step 1: " in s1["message"], where
        assert "global rank 1 (" in s1["message"] and RECOVER in s1["message"], where
        if name == "forward-one" and rank == 1:  # its own positioned error first
            assert s1["message"].startswith("step "), where
            assert INJECTED in s1["message"], where
        if name == "before-one":
            assert "global rank 1 (before the step communicated)" in s1["message"], where
            if rank == 1:  # its own error, named
                assert "the step failed here: ConfigError: " in s1["message"], where
        # Step 2 refused on every rank before any communication (no timeout waited).
        assert s2["raised"] == "ScheduleError", (where, s2)
        assert s2["message"].startswith(f"global rank {rank}: combined_1f1b refuses to step"), where
        assert "step 1 failed on global rank" in s2["message"] and RECOVER in s2["message"], where
        assert s2["seconds"] < 1.0, (where, s2["seconds"])
        # The model with a new consensus group, a new model with the old group: refused.
        assert s3["same_model"]["raised"] == "ScheduleError", (where, s3)
        assert "refuses to step this model" in s3["same_model"]["message"], where
        assert s3["same_consensus_group"]["raised"] == "ScheduleError", (where, s3)
        assert "refuses to step this consensus_group" in s3["same_consensus_group"]["message"]


@pytest.mark.slow
def test_a_failure_before_any_rank_communicated_leaves_the_next_step_exact(
    rows: dict[str, dict[int, dict[int, dict[str, Any]]]],
) -> None:
    case = rows["before-all"]
    assert sorted(case) == [0, 1]
    for rank, steps in case.items():
        where = f"before-all, rank {rank}"
        assert steps[0]["raised"] is None and steps[0]["exact"], (where, steps[0])
        assert steps[1]["raised"] == "ConfigError", (where, steps[1])  # its own, unchanged
        assert "padding_mask" in steps[1]["message"], where
        assert steps[2]["raised"] is None and steps[2]["exact"], (where, steps[2])
        assert 3 not in steps, where
