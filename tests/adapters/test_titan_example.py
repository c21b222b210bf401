"""``examples/train_torchtitan.py`` runs and trains (one process, with and without delayed
weight gradients). Each run is one single-threaded process, forked from a zygote that
imported torch (:mod:`tests.forked`): both start ahead of their tests, side by side
(:class:`~tests.parallel_runs.ParallelRuns`)."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests import forked
from tests.parallel_runs import ParallelRuns, selected_in

pytest.importorskip("torchtitan")

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_torchtitan.py"
ARGVS = {"argv0": [], "argv1": ["--delay-wgrad", "--family", "qwen3"]}
"""Each run's arguments, by its test's parameter id."""


def _train(argv: list[str]) -> Callable[[], subprocess.CompletedProcess[str]]:
    return lambda: forked.run([sys.executable, str(SCRIPT), "--steps", "3", *argv], timeout=300)


@pytest.fixture(scope="module")
def runs(
    request: pytest.FixtureRequest,
) -> Iterator[ParallelRuns[subprocess.CompletedProcess[str]]]:
    jobs = {f"test_train_torchtitan[{k}]": _train(v) for k, v in ARGVS.items()}
    started = ParallelRuns(jobs, [n for n in selected_in(request) if n in jobs])
    yield started
    started.close()


@pytest.mark.slow
@pytest.mark.parametrize("argv", ARGVS.values(), ids=ARGVS.keys())
def test_train_torchtitan(
    request: pytest.FixtureRequest,
    runs: ParallelRuns[subprocess.CompletedProcess[str]],
    argv: list[str],
) -> None:
    done = runs.result(request.node.name)
    assert done.args[2:] == ["--steps", "3", *argv]
    assert done.returncode == 0, done.stderr
    losses = [float(x) for x in re.findall(r"step +\d+: loss ([0-9.]+)", done.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0], done.stdout
    steps = [int(x) for x in re.findall(r"step +(\d+): loss", done.stdout)]
    assert steps == [1, 2, 3], done.stdout
    # the self-check as a table: a header row, then a row per block structure
    assert re.search(
        r"\n  block class +blocks +largest rel\. difference +probe dtype\n", done.stdout
    )
    assert re.search(r"\n  \w+Block +[0-9, ]+ +[0-9.e+-]+ +float32\n", done.stdout), done.stdout
    assert "autocast" not in done.stderr, done.stderr
