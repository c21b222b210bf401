"""The demo CLI and the timeline it writes."""

from __future__ import annotations

import dataclasses
import gc
import importlib.abc
import json
import sys
import weakref
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType

import pytest
import torch

import moe_overlap.demo as demo_module
from moe_overlap import ConfigError, ModelChunkSchedulePlan, combined_1f1b
from moe_overlap.__main__ import main
from moe_overlap.demo import DemoArgs, run_demo
from moe_overlap.models import GPTMoEModel
from moe_overlap.steps import Direction, Step
from moe_overlap.timeline import Span, Timeline
from tests.figures import check_figure, saved_figures
from tests.models._helpers import SMALL, microbatches

ONE_STEP = ["demo", "--steps", "1", "--microbatches", "1"]


def test_demo_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["demo", "--steps", "2", "--microbatches", "2", "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "step 2: loss combined_1f1b" in out
    assert "grads bit-identical True" in out
    assert "all steps bit-identical: True" in out
    assert (tmp_path / "timeline.png").stat().st_size > 0
    trace = json.loads((tmp_path / "timeline.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {"name", "ph", "ts", "dur", "pid", "tid"} <= set(spans[0])
    names = {e["name"] for e in spans}
    # one step of 2 microbatches: dispatch on the comm stream, wgrad steps present
    assert "mb0.L1.dispatch.F" in names and "mb1.L3.mlp.W" in names
    comm = {e["name"].split(".", 2)[2] for e in spans if e["tid"] == 1}
    assert comm <= {"dispatch.F", "dispatch.B", "combine.F", "combine.B"}


def test_demo_timeline_png_says_what_ran(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    figures = saved_figures(monkeypatch)
    assert main([*ONE_STEP, "--out", str(tmp_path)]) == 0
    (fig,) = figures
    check_figure(
        fig,
        title=["moe_overlap demo", "combined_1f1b", "1 microbatches", "cpu float32"],
        x_unit="(ms)",
        legend={"forward", "backward", "weight gradient"},
    )


def test_demo_on_cpu_says_zero_overlap_is_expected(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*ONE_STEP, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "comm hidden under compute in step 1: 0 us of the" in out
    assert (
        f"so 0 us is expected; a GPU step's overlap is pictured in {demo_module._GPU_TIMELINE} "
        "of the source repository)" in out
    )
    assert (Path(__file__).resolve().parents[2] / demo_module._GPU_TIMELINE).is_file()


class _Tripwire(importlib.abc.MetaPathFinder):
    """Records every attempt to import ``name`` (and refuses it)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.attempts = 0

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname.split(".")[0] == self.name:
            self.attempts += 1
            raise ImportError(f"{fullname} is refused by the test")
        return None


@pytest.fixture
def tqdm_tripwire(monkeypatch: pytest.MonkeyPatch) -> _Tripwire:
    """tqdm out of ``sys.modules`` (torch.hub imports it when installed) and every import
    of it counted and refused until the test ends."""
    for name in [m for m in sys.modules if m == "tqdm" or m.startswith("tqdm.")]:
        monkeypatch.delitem(sys.modules, name)
    wire = _Tripwire("tqdm")
    monkeypatch.setattr(sys, "meta_path", [wire, *sys.meta_path])
    return wire


def test_no_tqdm_import_when_not_on_a_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tqdm_tripwire: _Tripwire
) -> None:
    assert not sys.stdout.isatty()
    assert main([*ONE_STEP, "--out", str(tmp_path)]) == 0
    assert tqdm_tripwire.attempts == 0
    captured = capsys.readouterr()
    assert "step 1: loss" in captured.out and "steps" not in captured.err


def _pretend_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    for stream in (sys.stdout, sys.stderr):
        monkeypatch.setattr(stream, "isatty", lambda: True)


def test_progress_bar_on_a_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("tqdm")
    _pretend_terminal(monkeypatch)
    assert main(["demo", "--steps", "2", "--microbatches", "1", "--out", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert "2/2" in captured.err and "step 2: loss" in captured.out
    assert main([*ONE_STEP, "--out", str(tmp_path), "--no-progress"]) == 0
    assert "steps" not in capsys.readouterr().err


def test_demo_without_tqdm_and_matplotlib_says_what_to_install(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tqdm_tripwire: _Tripwire,
) -> None:
    _pretend_terminal(monkeypatch)
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_Tripwire("matplotlib"), *sys.meta_path])
    assert main([*ONE_STEP, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert tqdm_tripwire.attempts == 1
    assert "(no progress bar: tqdm is not installed; pip install 'moe-overlap[demo]')" in out
    assert "no PNG: Timeline.to_png(" in out and "pip install 'moe-overlap[demo]'" in out
    assert "all steps bit-identical: True" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["timeline.json"]


def test_timeline_overlap_ms(monkeypatch: pytest.MonkeyPatch) -> None:
    """The time both streams ran a step: comm spans against the union of compute spans."""

    def span(text: str, start: float, end: float) -> Span:
        return Span(
            step=Step.parse(text),
            microbatch=0,
            start_ms=start,
            end_ms=end,
            host_start_ms=start,
            host_end_ms=end,
        )

    spans = [
        span("f.L0.pre_dispatch.F@comp", 0.0, 2.0),
        span("f.L0.mlp.F@comp", 1.5, 3.0),  # overlaps the span before it: counted once
        span("f.L0.dispatch.F@comm", 2.5, 4.0),  # 0.5 under compute
        span("b.L0.combine.B@comm", 5.0, 6.0),
        span("b.L0.mlp.B@comp", 5.5, 7.0),  # 0.5 under the combine
    ]
    timeline = Timeline()
    assert timeline.overlap_ms() == 0.0
    monkeypatch.setattr(timeline, "spans", lambda: spans)
    assert timeline.overlap_ms() == pytest.approx(1.0)


def test_demo_no_delay_sgd(tmp_path: Path) -> None:
    args = ["demo", "--steps", "1", "--microbatches", "1", "--out", str(tmp_path)]
    assert main([*args, "--no-delay-wgrad", "--optimizer", "sgd", "--no-progress"]) == 0


def test_demo_rejects_ep_without_processes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ConfigError, match="--ep 2"):
        run_demo(DemoArgs(ep=2, out=tmp_path))
    with pytest.raises(SystemExit) as exit_info:  # the command line: one line, status 2
        main(["demo", "--ep", "2", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "moe-overlap demo: error: demo --ep:" in capsys.readouterr().err


def test_timeline_creates_no_reference_cycles() -> None:
    """Observed nodes die by reference counting: a timer is held only while its step runs."""
    model = GPTMoEModel(dataclasses.replace(SMALL, delay_wgrad_compute=True))
    data = microbatches(2, vocab=SMALL.vocab_size)
    combined_1f1b(model, data, options=model.schedule_options())  # warm up lazy state
    timeline = Timeline()
    nodes: list[weakref.ref[object]] = []

    def on_plan(plan: ModelChunkSchedulePlan) -> None:
        nodes.extend(weakref.ref(n) for lp in plan.layers for n in lp.nodes.values())

    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        combined_1f1b(
            model, data, options=model.schedule_options(), on_plan=on_plan, observer=timeline
        )
        alive = sum(r() is not None for r in nodes)
        found = gc.collect()
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert nodes and alive == 0
    assert found == 0, f"{found} objects were only reachable through reference cycles"
    assert {s.direction for s in timeline.spans()} == set(Direction) - {
        Direction.HOOK,
        Direction.RECOMPUTE,
    }


def test_ep_grad_averaging_scales_experts_like_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under EP the demo's grads are those of the mean loss over ranks, experts included.

    Two ranks with identical grads are simulated by an all-reduce that doubles: replicated
    grads come back unchanged, and expert grads (already the sum over both ranks' tokens)
    must be halved like everything else.
    """
    model = GPTMoEModel(SMALL)
    data = microbatches(1, vocab=SMALL.vocab_size)
    combined_1f1b(model, data)
    before = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    def all_reduce_two_identical_ranks(t: torch.Tensor) -> None:
        t.mul_(2)

    monkeypatch.setattr(demo_module, "_all_reduce", all_reduce_two_identical_ranks)
    demo_module._average_grads(model, 2)
    for name, p in model.named_parameters():
        assert p.grad is not None
        expected = before[name] / 2 if ".experts." in name else before[name]
        assert torch.equal(p.grad, expected), name
