"""The demo CLI and the timeline it writes."""

from __future__ import annotations

import dataclasses
import gc
import json
import weakref
from pathlib import Path

import pytest
import torch

import moe_overlap.demo as demo_module
from moe_overlap import ConfigError, ModelChunkSchedulePlan, combined_1f1b
from moe_overlap.__main__ import main
from moe_overlap.models import GPTMoEModel
from moe_overlap.steps import Direction
from moe_overlap.timeline import Timeline
from tests.models._helpers import SMALL, microbatches


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


def test_demo_no_delay_sgd(tmp_path: Path) -> None:
    args = ["demo", "--steps", "1", "--microbatches", "1", "--out", str(tmp_path)]
    assert main([*args, "--no-delay-wgrad", "--optimizer", "sgd", "--no-progress"]) == 0


def test_demo_rejects_ep_without_processes(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--ep 2"):
        main(["demo", "--ep", "2", "--out", str(tmp_path)])


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
    assert {s.direction for s in timeline.spans()} == set(Direction) - {Direction.HOOK}


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
