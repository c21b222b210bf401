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


def _readme_table(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "readme_table.py"), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=ROOT,
    )


def _fixture_row(ffn: int, *, overlapped: float, warmup: int) -> dict[str, object]:
    """One row of a bench_overlap.py results.json, the fields readme_table.py reads."""
    serial, compute, comm, bound = 600.0, 280.0, 370.0, 0.96 * overlapped
    return {
        "config": {
            **{"hidden": 4096, "ffn": ffn, "tokens": 4096, "num_layers": 4},
            **{"num_experts": 64, "local_experts": 8, "top_k": 8},
            **{"loopback": "host", "dtype": "torch.bfloat16"},
        },
        "microbatches": 4,
        "warmup": warmup,
        "iters": 5,
        "step_ms": {
            "serial": serial,
            "overlapped": overlapped,
            "compute_only": compute,
            "comm_only": comm,
        },
        "step_ms_spread": {"serial": 0.01, "overlapped": 0.02, "compute_only": 0.0, "comm_only": 0},
        "bound_ms": bound,
        "efficiency": bound / overlapped,
        "speedup": serial / overlapped,
        "overlapped_over_max": overlapped / comm,
        "fill_drain": {"overlapped_ms": 0.95 * overlapped, "spread": 0.015},
    }


def _fixture(out: Path, *, device: str = "NVIDIA H200", iters: int = 5) -> Path:
    """A hand-written results.json with its timeline beside it, as bench_overlap.py writes."""
    rows = [
        _fixture_row(2048, overlapped=480.0, warmup=4),
        _fixture_row(512, overlapped=450.0, warmup=2),
    ]
    for r in rows:
        r["iters"] = iters
    env = {"date": "2026-12-02 10:00:00 UTC", "torch": "2.11.0", "device": device, "warmup": 2}
    path = out / "results.json"
    path.write_text(json.dumps({"env": env, "results": rows, "skipped": ["H=7168 F=2048"]}))
    title = "overlapped step, H=4096 F=2048 T=4096 L=4 N=4 (480.0 ms median)"
    trace = {"traceEvents": [{"name": "process_name", "ph": "M", "args": {"name": title}}]}
    (out / "timeline_trace.json").write_text(json.dumps(trace))
    (out / "timeline.png").write_bytes(b"\x89PNG")
    return path


def test_readme_table_regenerates_the_block(tmp_path: Path) -> None:
    results = _fixture(tmp_path)
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\nbefore\n<!-- bench:begin -->\nold table\n<!-- bench:end -->\nafter\n")
    args = ("--results", str(results), "--readme", str(readme))
    stale = _readme_table(*args, "--check")
    assert stale.returncode == 1, stale.stderr
    assert "-old table" in stale.stderr
    assert _readme_table(*args).returncode == 0
    text = readme.read_text()
    assert text.startswith("# x\n\nbefore\n<!-- bench:begin -->\n")
    assert text.endswith("<!-- bench:end -->\nafter\n")
    assert "old table" not in text
    assert "| overlapped step (`combined_1f1b`) | 480.0 | 2.0 % |" in text
    assert "](timeline.png)" in text
    flat = " ".join(text.split())
    assert "0.96 across the 2 configurations of the sweep at 4 microbatches" in flat
    assert "4 warm-ups (2 after the first configuration) and 5 timed steps" in flat
    assert "1 configuration skipped by the time budget" in flat
    done = _readme_table(*args, "--check")
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    ("device", "iters", "message"),
    [("cpu", 5, "README shows device results"), ("NVIDIA H200", 3, "the method asks")],
)
def test_readme_table_refuses(tmp_path: Path, device: str, iters: int, message: str) -> None:
    results = _fixture(tmp_path, device=device, iters=iters)
    readme = tmp_path / "README.md"
    readme.write_text("<!-- bench:begin -->\n<!-- bench:end -->\n")
    done = _readme_table("--results", str(results), "--readme", str(readme))
    assert done.returncode == 2
    assert message in done.stderr


def test_readme_table_refuses_a_timeline_of_another_run(tmp_path: Path) -> None:
    results = _fixture(tmp_path)
    (tmp_path / "timeline_trace.json").write_text(
        json.dumps({"traceEvents": [{"args": {"name": "overlapped step (26.3 ms median)"}}]})
    )
    readme = tmp_path / "README.md"
    readme.write_text("<!-- bench:begin -->\n<!-- bench:end -->\n")
    done = _readme_table("--results", str(results), "--readme", str(readme))
    assert done.returncode == 2
    assert "not from this run" in done.stderr


def test_readme_is_generated_from_the_committed_results() -> None:
    """README.md's headline block is what readme_table.py makes of the committed results."""
    env = json.loads((ROOT / "benchmarks" / "results" / "results.json").read_text())["env"]
    if env.get("device") == "cpu" or "first_warmup" not in env:
        pytest.skip(
            "benchmarks/results/results.json is not a device run by the current method "
            f"({env.get('device')}, {env.get('date')}): the README's block stays as it is "
            "until the next device run (python benchmarks/readme_table.py)"
        )
    done = _readme_table("--check")
    assert done.returncode == 0, done.stderr
