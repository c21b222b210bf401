"""``benchmarks/bench_compose.py`` runs (a tiny CPU smoke run; the figures come from the GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_compose_smoke(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_compose.py"),
            "--device",
            "cpu",
            "--tiny",
            "--warmup",
            "0",
            "--iters",
            "1",
            "--only",
            "serial,overlapped +recompute(all),overlapped +compile",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr
    rows = json.loads((tmp_path / "compose.json").read_text())["rows"]
    assert [r["variant"] for r in rows] == [
        "serial",
        "overlapped +recompute(all)",
        "overlapped +compile",
    ]
    assert all(r["step_ms"] > 0 for r in rows)
