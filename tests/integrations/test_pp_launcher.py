"""The pipeline x EP launcher (``benchmarks/pp_nccl.py``) on real gloo processes: exact
against torch's own execution of the schedule, timed, one trace per rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.gloo_ranks import torchrun

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "pp_nccl.py"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("procs", "argv"),
    [
        pytest.param(
            4,
            ["--ep", "2", "--delay-wgrad"],
            marks=pytest.mark.skipif(
                torch.__version__.startswith("2.11"),
                reason="torch 2.11 DualPipeV warm-up sends to the same rank, which gloo refuses",
            ),
        ),
        (2, ["--schedule", "interleaved", "--loopback"]),
    ],
)
def test_launcher_is_exact_and_writes_a_trace_per_rank(
    procs: int, argv: list[str], tmp_path: Path
) -> None:
    stdout = torchrun(
        SCRIPT,
        procs,
        *("--device", "cpu", "--tiny", "--microbatches", "4", "--iters", "1"),
        *("--out", str(tmp_path), *argv),
    )
    assert "matches torch's schedule on every rank: True" in stdout, stdout
    summary = json.loads((tmp_path / "pp_results.json").read_text())
    assert summary["bit_identical"] and len(summary["ranks"]) == procs
    assert all(r["overlap_f_b_actions"] > 0 and r["comp_busy_ms"] > 0 for r in summary["ranks"])
    traces = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("pp_rank"))
    assert traces == [f"pp_rank{r}.json" for r in range(procs)]
