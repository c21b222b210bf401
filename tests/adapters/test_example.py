"""``examples/train_mixtral.py`` runs and trains, at EP=1 and EP=2 (gloo). Both runs start
ahead of their tests, side by side (:class:`~tests.parallel_runs.ParallelRuns`): the EP=1
one is a single process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.parallel_runs import ParallelRuns, selected_in

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_mixtral.py"
ARGVS = {"argv0": ["--ep", "1"], "argv1": ["--ep", "2", "--delay-wgrad"]}
"""Each run's arguments, by its test's parameter id."""


# The EP=1 run takes every core (``torch.set_num_threads``); its OpenMP threads sleep at a
# barrier instead of spinning, or beside the other run they spin out most of a core's time.
ENV = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}


def _train(argv: list[str]) -> Callable[[], subprocess.CompletedProcess[str]]:
    return lambda: subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", "4", *argv],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
        check=False,
    )


@pytest.fixture(scope="module")
def runs(
    request: pytest.FixtureRequest,
) -> Iterator[ParallelRuns[subprocess.CompletedProcess[str]]]:
    jobs = {f"test_train_mixtral[{k}]": _train(v) for k, v in ARGVS.items()}
    started = ParallelRuns(jobs, [n for n in selected_in(request) if n in jobs])
    yield started
    started.close()


@pytest.mark.slow
@pytest.mark.parametrize("argv", ARGVS.values(), ids=ARGVS.keys())
def test_train_mixtral(
    request: pytest.FixtureRequest,
    runs: ParallelRuns[subprocess.CompletedProcess[str]],
    argv: list[str],
) -> None:
    done = runs.result(request.node.name)
    assert done.args[2:] == ["--steps", "4", *argv]
    assert done.returncode == 0, done.stderr
    losses = [float(x) for x in re.findall(r"step +\d+: loss ([0-9.]+)", done.stdout)]
    assert len(losses) == 4 and losses[-1] < losses[0], done.stdout
    assert "gathered checkpoint" in done.stdout
