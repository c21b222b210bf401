"""The pipeline x EP launcher (``benchmarks/pp_nccl.py``) on real gloo processes: exact
against torch's own execution of the schedule, timed, one trace per rank. Both launches
start ahead of their tests, side by side."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tests.gloo_ranks import torchrun
from tests.parallel_runs import ParallelRuns, selected_in

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "pp_nccl.py"
RUNS = {
    "4-argv0": (4, ["--ep", "2", "--delay-wgrad"]),
    "2-argv1": (2, ["--schedule", "interleaved", "--loopback"]),
}
"""Each test's processes and arguments, by its parameter id."""
Ran = tuple[str, Path]
"""A run's output and its ``--out`` folder."""


def _run(procs: int, argv: list[str], out: Path) -> Ran:
    stdout = torchrun(
        SCRIPT,
        procs,
        *("--device", "cpu", "--tiny", "--microbatches", "4", "--iters", "1"),
        *("--out", str(out), *argv),
    )
    return stdout, out


@pytest.fixture(scope="module")
def runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ParallelRuns[Ran]]:
    """The selected tests' launches, started at once, side by side."""
    name = "test_launcher_is_exact_and_writes_a_trace_per_rank"
    jobs: dict[str, Callable[[], Ran]] = {
        f"{name}[{key}]": functools.partial(_run, p, a, tmp_path_factory.mktemp(key))
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
def test_launcher_is_exact_and_writes_a_trace_per_rank(
    request: pytest.FixtureRequest, runs: ParallelRuns[Ran], procs: int, argv: list[str]
) -> None:
    stdout, tmp_path = runs.result(request.node.name)
    assert "matches torch's schedule on every rank: True" in stdout, stdout
    summary = json.loads((tmp_path / "pp_results.json").read_text())
    assert summary["bit_identical"] and len(summary["ranks"]) == procs
    assert all(r["overlap_f_b_actions"] > 0 and r["comp_busy_ms"] > 0 for r in summary["ranks"])
    traces = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("pp_rank"))
    assert traces == [f"pp_rank{r}.json" for r in range(procs)]
