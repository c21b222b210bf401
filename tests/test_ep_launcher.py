"""The expert-parallel launcher (benchmarks/ep_nccl.py) on two real gloo processes: the
launcher forked from a zygote that imported torch (:mod:`tests.forked`, as a fresh
``python ep_nccl.py`` would start), its ranks the plain subprocesses it starts itself."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests import forked

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_launcher_is_exact_on_two_gloo_ranks(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = forked.run(
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
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("ep2_rank*.json"))]
    assert sorted(r["rank"] for r in reports) == [0, 1]
    for r in reports:
        assert r["world"] == 2
        assert r["exact"]["losses_equal"]
        assert r["exact"]["grads_equal"], r["exact"]["mismatched"]
        assert r["all_ranks_exact"]
