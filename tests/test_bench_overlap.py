"""``benchmarks/bench_overlap.py`` runs (a tiny CPU smoke run; the figures come from the GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_overlap_smoke(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_overlap.py"),
            "--device",
            "cpu",
            "--tiny",
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
    assert "filldr" in done.stdout
    results = json.loads((tmp_path / "results.json").read_text())
    rows = results["results"] if isinstance(results, dict) else results
    assert rows and all(r["fill_drain"]["overlapped_ms"] > 0 for r in rows)
