"""The GPU benchmarks run: tiny CPU smoke runs (the figures come from the H200)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench(script: str, *args: str) -> str:
    """Run ``benchmarks/<script>`` on the CPU with a tiny model; its stdout."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--device", "cpu", "--tiny", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_bench_overlap_smoke(tmp_path: Path) -> None:
    # One timed iteration and no warm-up: the smoke run checks the script, not the figures.
    stdout = _bench("bench_overlap.py", "--warmup", "0", "--iters", "1", "--out", str(tmp_path))
    assert "filldr" in stdout
    results = json.loads((tmp_path / "results.json").read_text())
    rows = results["results"] if isinstance(results, dict) else results
    assert rows and all(r["fill_drain"]["overlapped_ms"] > 0 for r in rows)


def test_bench_compose_smoke(tmp_path: Path) -> None:
    variants = ["serial", "overlapped +recompute(all)", "overlapped +compile"]
    _bench(
        "bench_compose.py",
        *("--warmup", "0", "--iters", "1", "--only", ",".join(variants)),
        *("--out", str(tmp_path)),
    )
    rows = json.loads((tmp_path / "compose.json").read_text())["rows"]
    assert [r["variant"] for r in rows] == variants
    assert all(r["step_ms"] > 0 for r in rows)


def test_bench_slice_graphs_smoke(tmp_path: Path) -> None:
    _bench("bench_slice_graphs.py", "--iters", "1", "--out", str(tmp_path))
    report = json.loads((tmp_path / "slice_graphs.json").read_text())
    assert [m for m in report if m != "config"] == ["eager", "attn", "attn+router"]
    assert all(report[m].get("bit_identical_to_eager") for m in ("eager", "attn", "attn+router"))


def test_ab_calls_counts_the_same_tree_the_same() -> None:
    """Call counts are deterministic: a tree against itself differs by no call."""
    src = str(ROOT / "src")
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "ab_calls.py"), "--a", src, "--b", src],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=ROOT,
        env={"PYTHONPATH": src, "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    for mode in ("serial", "overlapped"):
        assert summary[mode]["b_over_a"] == 1.0, summary[mode]
        assert summary[mode]["most_changed"] == {}, summary[mode]
        assert summary[mode]["a_calls_per_node"] > 10


def test_bench_torchtitan_smoke(tmp_path: Path) -> None:
    pytest.importorskip("torchtitan")
    _bench(
        "bench_torchtitan.py",
        *("--warmup", "0", "--iters", "1", "--microbatches", "2", "--layers", "1"),
        *("--exact-microbatches", "2", "--out", str(tmp_path)),
    )
    result = json.loads((tmp_path / "bench_torchtitan.json").read_text())
    for mode in ("default", "deterministic"):
        rows = result["exactness"][mode]["rows"]
        assert all(r["bit_identical"] for name, r in rows.items() if "torchtitan" not in name)
    (timing,) = result["timing"]
    assert all(timing["rows"][v]["median_ms"] > 0 for v in ("torchtitan", "overlapped"))
