"""``examples/train_pp_ep.py`` runs under torchrun as documented and matches torch's run
(both launches start ahead of their tests, side by side)."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tests.gloo_ranks import torchrun
from tests.parallel_runs import ParallelRuns, selected_in

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_pp_ep.py"
RUNS = {
    "4-argv0": (4, []),
    "2-argv1": (2, ["--ep", "1", "--schedule", "interleaved", "--delay-wgrad"]),
}
"""Each test's processes and arguments, by its parameter id."""
Ran = tuple[str, Path]
"""A run's output and its ``--timeline`` folder."""


def _run(procs: int, argv: list[str], out: Path) -> Ran:
    return torchrun(SCRIPT, procs, "--steps", "3", "--timeline", str(out), *argv, timeout=180), out


@pytest.fixture(scope="module")
def runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ParallelRuns[Ran]]:
    """The selected tests' launches, started at once, side by side."""
    jobs: dict[str, Callable[[], Ran]] = {
        f"test_train_pp_ep[{key}]": functools.partial(_run, p, a, tmp_path_factory.mktemp(key))
        for key, (p, a) in RUNS.items()
    }
    started = ParallelRuns(jobs, [n for n in selected_in(request) if n in jobs])
    yield started
    started.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("procs", "argv"),
    [
        pytest.param(
            *RUNS["4-argv0"],
            marks=pytest.mark.skipif(
                torch.__version__.startswith("2.11"),
                reason="torch 2.11 DualPipeV warm-up sends to the same rank, which gloo refuses",
            ),
        ),
        RUNS["2-argv1"],
    ],
)
def test_train_pp_ep(
    request: pytest.FixtureRequest, runs: ParallelRuns[Ran], procs: int, argv: list[str]
) -> None:
    stdout, tmp_path = runs.result(request.node.name)
    rows = re.findall(r"step (\d): losses ([0-9. ]+) \| matches torch's schedule: (\w+)", stdout)
    assert [r[0] for r in rows] == ["1", "2", "3"], stdout
    assert all(r[2] == "True" for r in rows), stdout
    means = [sum(map(float, r[1].split())) / 4 for r in rows]
    assert means[-1] < means[0], stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"rank{r}.json" for r in range(procs)]
