"""The GPU benchmarks run: tiny CPU smoke runs (the figures come from the H200).

Each run is a single-threaded process (forked from a zygote that imported torch,
:mod:`tests.forked`); they start ahead of their tests, two at a time
(:class:`~tests.parallel_runs.ParallelRuns`, the ``ran`` fixture), so both cores work.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import socket
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from moe_overlap import ConfigError
from moe_overlap.plan import load_profile
from moe_overlap.steps import Direction, Slot, StreamKind
from tests import forked
from tests.benchmark_module import benchmark_module as _benchmark_module
from tests.figures import check_figure, saved_figures
from tests.gloo_ranks import SCRIPT_ENV
from tests.parallel_runs import ParallelRuns, selected_in

ROOT = Path(__file__).resolve().parents[1]


#: The environment variable that makes a benchmark's exactness pass see one ulp of
#: difference in one variant (the failure path's test).
PERTURB = "MOE_OVERLAP_BENCH_PERTURB"


_ENV = SCRIPT_ENV  # PYTHONPATH=src, PATH=/usr/bin:/bin, one intra-op thread
HAS_TORCHTITAN = importlib.util.find_spec("torchtitan") is not None
TORCHTITAN = pytest.mark.skipif(not HAS_TORCHTITAN, reason="torchtitan is not installed")
COMPOSE_VARIANTS = ["serial", "overlapped +recompute(all)", "overlapped +compile"]


def _run(argv: list[str], perturb: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(_ENV)
    if perturb is not None:
        env[PERTURB] = perturb
    return forked.run(argv, timeout=300, cwd=ROOT, env=env)


def _bench_run(
    script: str, *args: str, perturb: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``benchmarks/<script>`` on the CPU with a tiny model."""
    script_path = str(ROOT / "benchmarks" / script)
    return _run([sys.executable, script_path, "--device", "cpu", "--tiny", *args], perturb)


def _fails(done: subprocess.CompletedProcess[str], *expected: str) -> None:
    """The run failed (exit 1) and its stderr says each of ``expected``."""
    assert done.returncode == 1, (done.returncode, done.stderr[-3000:])
    for text in expected:
        assert text in done.stderr, (text, done.stderr[-3000:])


def _passed(done: subprocess.CompletedProcess[str]) -> str:
    """The run's stdout (it must pass)."""
    assert done.returncode == 0, done.stderr
    return done.stdout


Ran = tuple[subprocess.CompletedProcess[str], Path]
"""A test's run (:data:`RUNS`) and the folder it wrote to (its ``--out``)."""


@pytest.fixture(scope="module")
def _runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ParallelRuns[Ran]]:
    """The runs of this module's selected tests, started in test order, two at a time."""
    selected = selected_in(request)

    def job(name: str) -> Callable[[], Ran]:
        out = tmp_path_factory.mktemp(name)
        return lambda: (RUNS[name](out), out)

    ahead = [n for n in selected if n in RUNS and (HAS_TORCHTITAN or "torchtitan" not in n)]
    runs = ParallelRuns({name: job(name) for name in RUNS}, ahead)
    yield runs
    runs.close()


@pytest.fixture
def ran(request: pytest.FixtureRequest, _runs: ParallelRuns[Ran]) -> Ran:
    """This test's run (its entry of :data:`RUNS`) and its output folder."""
    return _runs.result(request.node.name)


def test_bench_overlap_smoke(ran: Ran) -> None:
    # One timed iteration, no warm-up and no rows at more microbatches (the same code as the
    # second row's): the smoke run checks the script, not the figures.
    done, out = ran
    stdout = _passed(done)
    assert "filldr" in stdout
    results = json.loads((out / "results.json").read_text())
    rows = results["results"] if isinstance(results, dict) else results
    assert rows and all(r["fill_drain"]["overlapped_ms"] > 0 for r in rows)
    assert results["env"]["exactness_failed"] == []
    for r in rows:  # every variant that computes gradients, checked before the timing
        exact = r["exactness"]
        assert exact["failed"] == [] and "deterministic" in exact["kernels"]
        assert {"serial (run to run)", "overlapped", "fill_drain_recompute"} <= set(
            exact["variants"]
        )
    assert {"graphs_fill_drain", "high_priority_comm", "delay_wgrad_compute"} <= set(
        rows[0]["exactness"]["variants"]
    )


def test_bench_schedules_smoke(ran: Ran) -> None:
    """The planner's best schedule of the main configuration (four microbatches in flight,
    delayed weight gradients, recomputation started early) beside today's, tiny, on CPU."""
    done, out = ran
    stdout = _passed(done)
    assert "| main N=4 | searched |" in stdout
    (result,) = json.loads((out / "schedules.json").read_text())["results"]
    assert result["exactness_failed"] == []
    assert set(result["rows"]) == {
        "serial",
        "overlapped",
        "fill_drain",
        "fill_drain_recompute",
        "searched",
    }
    assert result["rows"]["searched"]["predicted_ms"] > 0
    assert "| predicted here ms (error) |" in stdout
    for row in result["rows"].values():  # predicted from this run's serial step
        assert math.isfinite(row["predicted_here_ms"]) and row["predicted_here_ms"] > 0
        assert math.isfinite(row["prediction_here_error"])
    assert load_profile(result["serial_slot_durations"])
    (host,) = json.loads((out / "schedules.json").read_text())["host_bound"]
    assert host["layer_pairs"] == 4 * 4  # tiny slice: 4 layers, 4 microbatches
    today = ("serial", "overlapped", "fill_drain", "fill_drain_recompute", "searched")
    graphed = [f"graphs_{k}" for k in today if k != "fill_drain_recompute"]
    plain = ("plain", "plain_recompute", "graphs_plain")
    for k in (*today, *graphed, *plain):
        assert host[k]["host_ms_per_layer_pair"] > 0
        assert host[k]["gpu_ms_per_layer_pair"] is None  # CPU: no device to time
        assert host[k]["bit_identical_to_serial"] is True
    # Every step of the pass was checked against the eager serial step, the twins included.
    assert set(host["exactness"]["variants"]) == {
        "serial (run to run)",
        *today[1:],
        *graphed,
        *plain,
    }
    assert host["exactness_failed"] == [] and "deterministic" in host["exactness"]["kernels"]
    for k in graphed:  # CPU: graphed blocks run eagerly, nothing captured or replayed
        assert host[k]["graph_replays_per_step"] == 0
    assert host["graphs_captured"] == 0 and host["graphs_on_device"] is False
    assert "set_recompute" in host["graphs_fill_drain_recompute"]["skipped"]
    for k, ref in (("serial", "plain"), ("fill_drain_recompute", "plain_recompute")):
        row = host[k]
        assert row["plain_reference"] == ref
        added = row["host_ms_per_layer_pair"] - host[ref]["host_ms_per_layer_pair"]
        assert row["schedule_host_ms_per_layer_pair"] == pytest.approx(added)
        assert row["schedule_share_of_host"] == pytest.approx(added / row["host_ms_per_layer_pair"])
    assert host["graphs_overlapped"]["plain_reference"] == "graphs_plain"
    assert host["searched"]["schedule_share_of_host"] is None
    assert host["searched"]["no_plain_reference"]
    table = stdout.split("host-bound size")[1]
    for k in ("searched", "graphs_searched", "graphs_fill_drain_recompute", "graphs_plain"):
        assert f"| main N=4 | {k} |" in table
    assert "the graphed twins run eagerly" in table


FrontierRows = list[tuple[dict[str, Any], dict[str, Any]]]


FRONTIERS = ("frontier", "frontier_one_event", "frontier_choice", "frontier_by_kind")
"""The committed frontiers: the planner's defaults; searched as the engine runs (one event
per microbatch) with the benchmark slice's weight-gradient shares; with the planner's
(``choose_schedule``'s default space); and as the second with a contention per
communication kind."""


def _frontier_rows(name: str = "frontier") -> tuple[dict[str, Any], FrontierRows]:
    """The committed frontier ``name``, and each of its configurations (with the search
    space, as ``bench_schedules.py`` hands it on) with the round-9 row (serial profile,
    measured steps) it was searched from."""
    frontier = json.loads((ROOT / f"benchmarks/results/{name}/frontier.json").read_text())
    source = json.loads((ROOT / "benchmarks/results/round9/results.json").read_text())
    pairs: FrontierRows = []
    for config in frontier["configs"]:
        config = {**config, "space": frontier["space"]}
        (row,) = (
            r
            for r in source["results"]
            if (r["config"]["ffn"], r["microbatches"]) == (config["ffn"], config["microbatches"])
        )
        pairs.append((config, row))
    return frontier, pairs


@pytest.mark.parametrize("name", FRONTIERS)
def test_bench_schedules_predicts_as_the_frontier_does(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """From the round-9 profiles the frontier was searched from, the benchmark's prediction
    of every row is the frontier's committed one (today's and the searched order's), with
    the shares and event model the frontier was searched with."""
    bench = _benchmark_module("bench_schedules", monkeypatch)
    frontier, pairs = _frontier_rows(name)
    for config, row in pairs:
        got = bench.predict(
            row["order_search"]["serial_slot_durations"],
            config,
            num_layers=row["config"]["num_layers"],
            contention=frontier["comm_contention"],
            contention_by_kind=bench.by_kind_of(frontier),
            compute_contention_by_kind=bench.by_kind_of(frontier, "compute_contention_by_kind"),
        )
        want = {k: config["today"][k]["step_ms"] for k in bench.TODAY}
        want["searched"] = config["targets"]["best_ms"]
        assert got == pytest.approx(want, rel=1e-9), config["name"]


def test_frontier_reads_weight_gradient_shares_and_refuses_bad_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--wgrad-share`` gives the search space's pairs; a slot without a weight gradient,
    a share outside [0, 1], a slot twice or a word without ``=`` is a one-line error."""
    frontier = _benchmark_module("frontier", monkeypatch)
    parser = argparse.ArgumentParser()
    got = frontier._shares(parser, ["mlp=0.5", "pre_dispatch=0"])
    assert got == ((Slot.MLP, 0.5), (Slot.PRE_DISPATCH, 0.0))
    assert frontier._shares(parser, None) is None
    for bad in (["dispatch=0.1"], ["mlp=1.5"], ["mlp=0.5", "mlp=0.4"], ["mlp"], ["x=1"]):
        with pytest.raises(SystemExit) as exc:
            frontier._shares(parser, bad)
        assert exc.value.code == 2


def test_frontier_reads_contention_per_kind_and_refuses_bad_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--contention-by-kind`` gives a coefficient per (slot, direction), the kinds not
    named absent (0); a kind that does not communicate, a kind twice, a coefficient below 0,
    not finite or not a number is a one-line error."""
    frontier = _benchmark_module("frontier", monkeypatch)
    parser = argparse.ArgumentParser()
    got = frontier._by_kind(parser, ["combine.B=0.7", "dispatch.F=0"])
    assert got == {(Slot.COMBINE, Direction.BACKWARD): 0.7, (Slot.DISPATCH, Direction.FORWARD): 0.0}
    assert frontier._by_kind(parser, None) is None
    bad_words = (["mlp.F=0.1"], ["combine.B=0.1", "combine.B=0.2"], ["combine.B=-1"])
    for bad in (*bad_words, ["combine.B=inf"], ["combine.B=nan"], ["combine.B"], ["combine.B=x"]):
        with pytest.raises(SystemExit) as exc:
            frontier._by_kind(parser, bad)
        assert exc.value.code == 2
    # --compute-contention-by-kind: the compute kinds (W and R too), not the communication's
    got = frontier._by_kind(parser, ["pre_dispatch.F=0.5", "mlp.R=0.01"], compute=True)
    assert got == {
        (Slot.PRE_DISPATCH, Direction.FORWARD): 0.5,
        (Slot.MLP, Direction.RECOMPUTE): 0.01,
    }
    for bad in (["combine.B=0.1"], ["mlp.H=0.1"], ["mlp.F=-0.1"]):
        with pytest.raises(SystemExit) as exc:
            frontier._by_kind(parser, bad, compute=True)
        assert exc.value.code == 2


def test_bench_schedules_fits_the_frontier_s_contention(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fitted on round 9's measured overlapped step at main N=4, the benchmark's contention
    is the one the frontier was fitted with (``moe_overlap.plan.fit_contention``)."""
    bench = _benchmark_module("bench_schedules", monkeypatch)
    frontier, pairs = _frontier_rows()
    config, row = pairs[0]
    profile, layers = row["order_search"]["serial_slot_durations"], row["config"]["num_layers"]
    fitted = bench.fit_here(
        profile, config, num_layers=layers, overlapped_ms=row["step_ms"]["overlapped"]
    )
    assert fitted == pytest.approx(frontier["comm_contention"], abs=1e-6)
    assert bench.fit_here(profile, config, num_layers=layers, overlapped_ms=1.0) is None


def test_bench_schedules_leaves_out_a_graphed_twin_the_library_refuses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A graphed twin the library refuses (its own error) is left out with the first line of
    why; the eager steps are not run by the probe; any other error is not swallowed."""
    bench = _benchmark_module("bench_schedules", monkeypatch)
    ran: list[str] = []

    def refuse() -> None:
        raise ConfigError("MoESliceLayer attention: a capture refused\nthe usual causes")

    def broken() -> None:
        raise RuntimeError("not the library's")

    b = types.SimpleNamespace(model=torch.nn.Module())
    fns = {
        "serial": lambda: ran.append("serial"),
        "graphs_serial": lambda: ran.append("graphs_serial"),
        "graphs_searched": refuse,
    }
    assert bench.refused(b, fns) == {
        "graphs_searched": "not run: MoESliceLayer attention: a capture refused"
    }
    assert ran == ["graphs_serial"]
    with pytest.raises(RuntimeError, match="not the library's"):
        bench.refused(b, {"graphs_plain": broken})


def test_bench_schedules_fails_when_the_searched_step_is_not_bit_identical(ran: Ran) -> None:
    done, _ = ran
    _fails(done, "a variant was not bit-identical")


def test_bench_schedules_fails_when_a_graphed_twin_is_not_bit_identical(ran: Ran) -> None:
    """One ulp in the graphed searched step at the host-bound size: its row says so and the
    process exits 1 after writing the results."""
    done, out = ran
    _fails(done, "a variant was not bit-identical", "graphs_searched is not bit-identical")
    (host,) = json.loads((out / "schedules.json").read_text())["host_bound"]
    assert host["exactness_failed"] == ["graphs_searched"]
    assert host["graphs_searched"]["bit_identical_to_serial"] is False
    assert host["searched"]["bit_identical_to_serial"] is True
    assert "| main N=4 | graphs_searched |" in (out / "schedules.md").read_text()


def test_bench_overlap_fails_when_a_variant_is_not_bit_identical(ran: Ran) -> None:
    """One ulp in fill/drain + recompute's gradients: the first row's exactness pass fails,
    the row is written without timing, and the process exits 1 naming the variant."""
    done, out = ran
    _fails(
        done,
        "EXACTNESS FAILED",
        "fill_drain_recompute is not bit-identical to serial",
        "embed_scale: max abs diff",
        "all finite",
    )
    results = json.loads((out / "results.json").read_text())
    (row,) = results["results"]
    assert row["exactness"]["failed"] == ["fill_drain_recompute"]
    assert "stopped" in row and "step_ms" not in row
    assert results["env"]["exactness_failed"] == ["H=64 F=32 T=64 N=4: fill_drain_recompute"]


@pytest.mark.slow  # the whole tiny sweep and the host-bound row, timed
def test_bench_overlap_continue_after_inexact_times_and_still_fails(ran: Ran) -> None:
    done, out = ran
    _fails(done, "overlapped is not bit-identical to serial", "timed anyway")
    results = json.loads((out / "results.json").read_text())
    rows = results["results"]
    assert len(rows) == 2 and all(r["step_ms"]["overlapped"] > 0 for r in rows)
    assert all(r["exactness"]["failed"] == ["overlapped"] for r in rows)


def test_bench_a2a_chunks_smoke(ran: Ran) -> None:
    done, out = ran
    stdout = _passed(done)
    assert "exact: 6 of 6 steps bit-identical" in stdout
    result = json.loads((out / "a2a_chunks.json").read_text())
    assert result["exactness"]["failed"] == []
    assert set(result["exactness"]["variants"]) == {
        f"K{k}_{m}" for k in (1, 2) for m in ("serial (run to run)", "overlapped", "fill_drain")
    }
    assert all(v > 0 for v in result["step_ms"].values())


def test_bench_a2a_chunks_fails_when_a_step_is_not_bit_identical(ran: Ran) -> None:
    done, out = ran
    _fails(done, "K2_fill_drain is not bit-identical to K2_serial", "gradients differ")
    result = json.loads((out / "a2a_chunks.json").read_text())
    assert result["exactness"]["failed"] == ["K2_fill_drain"]
    assert "step_ms" not in result  # stopped before the timing


def test_pp_nccl_fails_when_a_prepared_step_is_not_bit_identical(ran: Ran) -> None:
    """One rank over gloo (the two-stage interleaved schedule on one rank); the prepared
    step's gradient one ulp off: every rank exits 1, rank 0 names the step."""
    done, out = ran
    assert done.returncode != 0, done.stderr[-3000:]
    assert "matches torch's schedule on every rank: False" in done.stdout
    assert "EXACTNESS FAILED on rank 0" in done.stderr, done.stderr[-3000:]
    assert "prepared is not bit-identical to torch's execution" in done.stderr
    summary = json.loads((out / "pp_results.json").read_text())
    assert summary["bit_identical"] is False and "ranks" not in summary  # not timed
    (rank0,) = summary["exactness"]["ranks"]
    rows = rank0["exactness"]
    assert not rows["prepared"]["bit_identical"] and rows["prepared_serial"]["bit_identical"]


def test_bench_compose_smoke(ran: Ran) -> None:
    done, out = ran
    _passed(done)
    rows = json.loads((out / "compose.json").read_text())["rows"]
    assert [r["variant"] for r in rows] == COMPOSE_VARIANTS
    assert all(r["step_ms"] > 0 for r in rows)


def test_bench_slice_graphs_smoke(ran: Ran) -> None:
    done, out = ran
    _passed(done)
    report = json.loads((out / "slice_graphs.json").read_text())
    assert [m for m in report if m != "config"] == ["eager", "attn", "attn+router"]
    assert all(report[m].get("bit_identical_to_eager") for m in ("eager", "attn", "attn+router"))


def test_ab_calls_counts_the_same_tree_the_same(ran: Ran) -> None:
    """Call counts are deterministic: a tree against itself differs by no call."""
    done, _ = ran
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    for mode in ("serial", "overlapped"):
        assert summary[mode]["b_over_a"] == 1.0, summary[mode]
        assert summary[mode]["most_changed"] == {}, summary[mode]
        assert summary[mode]["a_calls_per_node"] > 10


@TORCHTITAN
def test_bench_torchtitan_smoke(ran: Ran) -> None:
    done, out = ran
    _passed(done)
    result = json.loads((out / "bench_torchtitan.json").read_text())
    exact = result["exactness"]
    assert exact["failed"] == [] and "deterministic" in exact["kernels"]
    assert all(r["bit_identical"] for r in exact["rows"].values())
    assert exact["rows"]["torchtitan own step run to run"]["reference"] == "torchtitan own step"
    (timing,) = result["timing"]
    assert all(timing["rows"][v]["median_ms"] > 0 for v in ("torchtitan", "overlapped"))


@TORCHTITAN
def test_bench_torchtitan_fails_when_a_step_is_not_bit_identical(ran: Ran) -> None:
    done, out = ran
    _fails(
        done,
        "overlapped (delayed_wgrad) is not bit-identical to plain (delayed_wgrad)",
        "tok_embeddings.weight: max abs diff",
        "not timed",
    )
    result = json.loads((out / "bench_torchtitan.json").read_text())
    assert result["exactness"]["failed"] == ["overlapped (delayed_wgrad)"]
    assert "timing" not in result


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
    """Every page's generated figures are what readme_table.py makes of the committed results
    (README.md, docs/*.md, benchmarks/README.md; the files are named in readme_table.py)."""
    done = _readme_table("--check")
    assert done.returncode == 0, done.stderr


def _stress_checked(*args: str) -> subprocess.CompletedProcess[str]:
    """``stress_exact.py`` once per composition, tiny, at 4 microbatches (without the fix,
    the checker names the race in every composition at that count), on CPU, under the
    stream-order checker (its one-rank group on a free port: two runs may overlap)."""
    script = str(ROOT / "benchmarks" / "stress_exact.py")
    argv = [sys.executable, script, "--device", "cpu", "--tiny", "--runs", "1", "--shake", "off"]
    argv += ["--microbatches", "4"]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    return forked.run(
        [*argv, *args],
        timeout=300,
        cwd=ROOT,
        env={**_ENV, "MOE_OVERLAP_STREAM_CHECK": "1", "MASTER_PORT": port},
    )


def test_stress_exact_smoke_under_the_stream_order_checker(ran: Ran) -> None:
    """Every composition of the stress, once, tiny, on CPU with the checker on every access."""
    done, _ = ran
    assert done.returncode == 0, done.stderr[-3000:]
    assert "runs not bit-identical: 0 of 11" in done.stdout


def test_stress_exact_without_the_fix_is_a_race_the_checker_names(ran: Ran) -> None:
    """Issue 37's race, reproduced by the stress's fault switch, found on CPU in one run."""
    done, _ = ran
    assert done.returncode != 0
    assert "StreamOrderError" in done.stderr
    assert "may still use it" in done.stderr and "'moe_dispatch' backward" in done.stderr


def test_gantt_png_says_what_it_shows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    figures = saved_figures(monkeypatch)
    nt = _benchmark_module("node_timing", monkeypatch)
    spans = [
        nt.NodeSpan(nt.NodeKey(0, 0, Slot.MLP, d), StreamKind.COMP, i, i + 1.0)
        for i, d in enumerate((Direction.FORWARD, Direction.BACKWARD, Direction.WGRAD))
    ]
    spans.append(
        nt.NodeSpan(nt.NodeKey(1, 0, Slot.DISPATCH, Direction.FORWARD), StreamKind.COMM, 0.5, 1.5)
    )
    nt.write_gantt_png(spans, tmp_path / "t.png", title="overlapped step, H=64")
    (fig,) = figures
    check_figure(
        fig,
        title=["overlapped step, H=64"],
        x_unit="(ms)",
        legend={"forward", "backward", "weight gradient"},
    )


def test_sweep_png_says_what_it_shows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    figures = saved_figures(monkeypatch)
    bench = _benchmark_module("bench_overlap", monkeypatch)
    rows = [
        {"comm_to_compute": c, "speedup": 1.2, "efficiency": 0.9, "microbatches": 4}
        for c in (0.5, 1.0, 2.0)
    ]
    bench.write_sweep_png(rows, tmp_path / "sweep.png", where="NVIDIA H200, torch 2.11.0")
    (fig,) = figures
    check_figure(
        fig,
        title=["bench_overlap.py sweep", "3 configurations at 4 microbatches", "NVIDIA H200"],
        x_unit="ratio",
        legend={"speed-up serial/overlapped", "efficiency bound/overlapped"},
    )
    assert fig.axes[0].get_ylabel()


# --- the runs ---------------------------------------------------------------------------------
_SRC = str(ROOT / "src")
RUNS: dict[str, Callable[[Path], subprocess.CompletedProcess[str]]] = {
    "test_bench_schedules_smoke": lambda out: _bench_run(
        "bench_schedules.py",
        *("--warmup", "0", "--iters", "1", "--configs", "main N=4", "--out", str(out)),
    ),
    "test_bench_schedules_fails_when_the_searched_step_is_not_bit_identical": lambda out: (
        _bench_run(
            "bench_schedules.py",
            *("--warmup", "0", "--iters", "1", "--configs", "main N=4", "--skip", "host"),
            *("--out", str(out)),
            perturb="searched",
        )
    ),
    "test_bench_schedules_fails_when_a_graphed_twin_is_not_bit_identical": lambda out: _bench_run(
        "bench_schedules.py",
        *("--warmup", "0", "--iters", "1", "--configs", "main N=4", "--skip", "main"),
        *("--out", str(out)),
        perturb="graphs_searched",
    ),
    "test_bench_overlap_smoke": lambda out: _bench_run(
        "bench_overlap.py",
        "--warmup",
        "0",
        "--iters",
        "1",
        "--more-microbatches",
        "--out",
        str(out),
    ),
    "test_bench_overlap_fails_when_a_variant_is_not_bit_identical": lambda out: _bench_run(
        "bench_overlap.py",
        *("--warmup", "0", "--iters", "1", "--out", str(out)),
        perturb="fill_drain_recompute",
    ),
    "test_bench_overlap_continue_after_inexact_times_and_still_fails": lambda out: _bench_run(
        "bench_overlap.py",
        *("--warmup", "0", "--iters", "1", "--more-microbatches", "--out", str(out)),
        "--continue-after-inexact",
        perturb="1",
    ),
    "test_bench_a2a_chunks_smoke": lambda out: _bench_run(
        "bench_a2a_chunks.py", "--chunks", "1", "2", "--out", str(out)
    ),
    "test_bench_a2a_chunks_fails_when_a_step_is_not_bit_identical": lambda out: _bench_run(
        "bench_a2a_chunks.py", "--chunks", "1", "2", "--out", str(out), perturb="K2_fill_drain"
    ),
    "test_pp_nccl_fails_when_a_prepared_step_is_not_bit_identical": lambda out: _run(
        [
            *(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1"),
            str(ROOT / "benchmarks" / "pp_nccl.py"),
            *("--device", "cpu", "--tiny", "--microbatches", "4", "--iters", "1"),
            *("--schedule", "interleaved", "--loopback", "--out", str(out)),
        ],
        perturb="prepared",
    ),
    "test_bench_compose_smoke": lambda out: _bench_run(
        "bench_compose.py",
        *("--warmup", "0", "--iters", "1", "--only", ",".join(COMPOSE_VARIANTS)),
        *("--out", str(out)),
    ),
    "test_bench_slice_graphs_smoke": lambda out: _bench_run(
        "bench_slice_graphs.py", "--iters", "1", "--out", str(out)
    ),
    "test_ab_calls_counts_the_same_tree_the_same": lambda out: _run(  # _ENV: src, PATH, 1 thread
        [sys.executable, str(ROOT / "benchmarks" / "ab_calls.py"), "--a", _SRC, "--b", _SRC]
    ),
    "test_bench_torchtitan_smoke": lambda out: _bench_run(
        "bench_torchtitan.py",
        *("--warmup", "0", "--iters", "1", "--microbatches", "2", "--layers", "1"),
        *("--exact-microbatches", "2", "--out", str(out)),
    ),
    "test_bench_torchtitan_fails_when_a_step_is_not_bit_identical": lambda out: _bench_run(
        "bench_torchtitan.py",
        *("--exact-microbatches", "1", "--microbatches", "2", "--out", str(out)),
        perturb="overlapped (delayed_wgrad)",
    ),
    "test_stress_exact_smoke_under_the_stream_order_checker": lambda out: _stress_checked(),
    "test_stress_exact_without_the_fix_is_a_race_the_checker_names": lambda out: _stress_checked(
        "--compositions", "pp_interleaved", "--without-record-stream-fix"
    ),
}
"""Each test's run by the test's name: the command its assertions read (``out``: the folder
for ``--out``)."""


def test_rank_orders_replays_each_best_order_under_each_model(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``rank_orders.py``: a frontier's own order under its own model is its committed
    ``best_ms``, and each model ranks its own order first (what its search chose); the
    table shows the measured column given, and a measured entry of no frontier is a usage
    error."""
    ro = _benchmark_module("rank_orders", monkeypatch)
    names = ("frontier_one_event", "frontier_by_kind")
    for config in ("main N=4", "main N=8"):
        ranked = ro.rank(names, config)
        for own in names:
            best = next(c for c in ro.load(own)["configs"] if c["name"] == config)
            assert ranked[own][own] == pytest.approx(best["targets"]["best_ms"], rel=1e-9)
            other = next(n for n in names if n != own)
            assert ranked[own][own] < ranked[other][own], (config, own)
    ro.main(["--configs", "main N=4", "--measured", "frontier_by_kind=514.6"])
    out = capsys.readouterr().out
    assert "| frontier_by_kind | 484.3 | 486.7 | 514.6 |" in out
    with pytest.raises(SystemExit) as exc:
        ro.main(["--configs", "main N=4", "--measured", "frontier=1"])
    assert exc.value.code == 2
