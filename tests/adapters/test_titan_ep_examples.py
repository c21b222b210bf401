"""``examples/torchtitan_ep.py`` (EP=2) and ``examples/torchtitan_pp_ep.py`` (PP=2 x EP=2)
run under torchrun on gloo, one intra-op thread per rank, and find the schedule
bit-identical to torchtitan's own run (their self-check); ``docs/torchtitan.md`` includes
them. The three launches start ahead of their tests, two at a time."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.gloo_ranks import torchrun
from tests.parallel_runs import ParallelRuns, selected_in

pytest.importorskip("torchtitan")

ROOT = Path(__file__).resolve().parents[2]
EP, PP_EP = ROOT / "examples" / "torchtitan_ep.py", ROOT / "examples" / "torchtitan_pp_ep.py"


EP_TEST = "test_ep_example_is_bit_identical_to_torchtitan"
PP_EP_TEST = "test_pp_ep_example_is_bit_identical_to_torchtitan"
JOBS: dict[str, Callable[[], str]] = {
    EP_TEST: lambda: torchrun(EP, 2, "--layers", "2", "--steps", "2"),
    **{
        f"{PP_EP_TEST}[{s}]": functools.partial(torchrun, PP_EP, 4, "--schedule", s, timeout=300)
        for s in ("DualPipeV", "Interleaved1F1B")
    },
}
"""Each test's launch, by test name."""


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest) -> Iterator[ParallelRuns[str]]:
    """The selected tests' launches, started ahead of them, two at a time."""
    started = ParallelRuns(JOBS, [n for n in selected_in(request) if n in JOBS])
    yield started
    started.close()


@pytest.mark.slow
def test_ep_example_is_bit_identical_to_torchtitan(runs: ParallelRuns[str]) -> None:
    out = runs.result(EP_TEST)
    lines = re.findall(r"rank (\d): step (\d): loss [0-9.]+, bit-identical to torchtitan", out)
    assert sorted(lines) == [("0", "1"), ("0", "2"), ("1", "1"), ("1", "2")], out
    assert "autocast" not in out, out
    assert "EP=2: layers.1 experts DTensor [8, 256, 256], [4, 256, 256] on each rank" in out


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["DualPipeV", "Interleaved1F1B"])
def test_pp_ep_example_is_bit_identical_to_torchtitan(
    runs: ParallelRuns[str], schedule: str
) -> None:
    out = runs.result(f"{PP_EP_TEST}[{schedule}]")
    # ``.*?``: two ranks' lines can reach the pipe without the newline between them (torchrun
    # merges the ranks' output), and a greedy ``.*`` would then swallow the second rank's.
    done = re.findall(
        r"rank (\d): stages \[(\d), (\d)\], (\d+) overlapped pairs, .*?bit-identical", out
    )
    assert sorted(r for r, *_ in done) == ["0", "1", "2", "3"], out
    assert all(int(pairs) > 0 for *_, pairs in done), out


def test_docs_show_the_examples_with_their_launch_commands() -> None:
    """The page includes each example file itself (Sphinx ``literalinclude``: never a stale
    copy) and shows its launch command."""
    page = (ROOT / "docs" / "torchtitan.md").read_text(encoding="utf-8")
    for script, procs in ((EP, 2), (PP_EP, 4)):
        name = script.relative_to(ROOT).as_posix()
        assert f"torchrun --nproc-per-node {procs} {name}" in page, name
        assert f"```{{literalinclude}} ../{name}\n:language: python\n```" in page, name
