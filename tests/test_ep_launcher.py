"""The expert-parallel launcher (benchmarks/ep_nccl.py) on two real gloo processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_launcher_is_exact_on_two_gloo_ranks(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "ep_nccl.py"),
            "--nproc",
            "2",
            "--device",
            "cpu",
            "--tiny",
            "--skip-bench",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("ep2_rank*.json"))]
    assert sorted(r["rank"] for r in reports) == [0, 1]
    for r in reports:
        assert r["world"] == 2
        assert r["exact"]["losses_equal"]
        assert r["exact"]["grads_equal"], r["exact"]["mismatched"]
        assert r["all_ranks_exact"]
