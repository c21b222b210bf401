"""The demo CLI and the timeline it writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_overlap import ConfigError
from moe_overlap.__main__ import main


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
