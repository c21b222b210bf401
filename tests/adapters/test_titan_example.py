"""``examples/train_torchtitan.py`` runs and trains (one process, with and without delayed
weight gradients; two gloo ranks under torchrun, as its docstring shows). Each run is
forked from a zygote that imported torch (:mod:`tests.forked`), one intra-op thread per
process: they start ahead of their tests, two at a time
(:class:`~tests.parallel_runs.ParallelRuns`)."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests import forked
from tests.gloo_ranks import SCRIPT_ENV
from tests.parallel_runs import ParallelRuns, selected_in

pytest.importorskip("torchtitan")

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_torchtitan.py"
ARGVS = {"argv0": [], "argv1": ["--delay-wgrad", "--family", "qwen3"]}
"""Each run's arguments, by its test's parameter id."""


TWO_RANKS = "test_train_torchtitan_on_two_gloo_ranks"


def _train(argv: list[str]) -> Callable[[], subprocess.CompletedProcess[str]]:
    return lambda: forked.run([sys.executable, str(SCRIPT), "--steps", "3", *argv], timeout=300)


def _train_two_ranks() -> subprocess.CompletedProcess[str]:
    """``torchrun --nproc-per-node 2 examples/train_torchtitan.py --steps 2`` on CPU."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    return forked.run([*launch, str(SCRIPT), "--steps", "2"], timeout=300, env=SCRIPT_ENV)


@pytest.fixture(scope="module")
def runs(
    request: pytest.FixtureRequest,
) -> Iterator[ParallelRuns[subprocess.CompletedProcess[str]]]:
    jobs = {f"test_train_torchtitan[{k}]": _train(v) for k, v in ARGVS.items()}
    jobs[TWO_RANKS] = _train_two_ranks
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


@pytest.mark.slow
def test_train_torchtitan_on_two_gloo_ranks(
    runs: ParallelRuns[subprocess.CompletedProcess[str]],
) -> None:
    """Data parallel on CPU: torchtitan's load-balancing hook builds its meshes on the
    ranks' device, not on CUDA, which torchtitan assumes unless told."""
    done = runs.result(TWO_RANKS)
    assert done.returncode == 0, done.stderr[-4000:]
    steps = [int(x) for x in re.findall(r"step +(\d+): loss [0-9.]+", done.stdout)]
    assert steps == [1, 2], done.stdout
    assert "torchtitan's load-balancing hook" in done.stdout, done.stdout
