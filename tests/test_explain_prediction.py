"""``benchmarks/explain_prediction.py``: the CPU smoke run, its analysis on a made-up
timeline, and its chart (the figures come from a GPU)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from moe_overlap.steps import Direction, Slot, StreamKind
from tests import forked
from tests.benchmark_module import benchmark_module as _module
from tests.figures import check_figure, saved_figures
from tests.gloo_ranks import SCRIPT_ENV

ROOT = Path(__file__).resolve().parents[1]
F, B, W, R = Direction.FORWARD, Direction.BACKWARD, Direction.WGRAD, Direction.RECOMPUTE
COMP, COMM = StreamKind.COMP, StreamKind.COMM


def test_the_smoke_run_explains_both_rows(tmp_path: Path) -> None:
    """Tiny, on the CPU: both rows against both models, every measured node matched with a
    predicted one (the searched row's W and R steps included), every file written and
    named."""
    argv = [sys.executable, str(ROOT / "benchmarks" / "explain_prediction.py")]
    argv += ["--device", "cpu", "--tiny", "--warmup", "0", "--repeats", "1", "--out", str(tmp_path)]
    done = forked.run(argv, timeout=300, cwd=ROOT, env=dict(SCRIPT_ENV))
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads((tmp_path / "explain.json").read_text())
    (result,) = doc["results"]
    written = [*result["pngs"], str(tmp_path / "explain.json"), str(tmp_path / "explain.md")]
    for path in written:
        assert Path(path).is_file(), path
        assert f"wrote {path}" in done.stdout
    assert result["name"] == "main N=4"
    for row in ("overlapped", "searched"):
        explained = result["rows"][row]
        assert explained["nodes"] == len(result["timelines"]["measured"][row])
        for model in ("planner", "one_event", "one_event_measured_w"):
            m = explained["models"][model]
            assert m["only_measured"] == [] and m["only_predicted"] == [], (row, model)
            assert m["predicted_step_ms"] > 0 and m["drift"]["largest"]
            assert set(m["streams"]) == {"comp", "comm"}
    kinds = {k["kind"]: k for k in result["rows"]["searched"]["models"]["planner"]["kinds"]}
    for kind in ("mlp.R@comp", "pre_dispatch.R@comp", "mlp.W@comp", "pre_dispatch.W@comp"):
        assert kinds[kind]["count"] == 16, kind  # 4 microbatches x 4 layers
        assert kinds[kind]["uncontended_ms"] is not None, kind
    assert "## main N=4" in (tmp_path / "explain.md").read_text()


def test_each_node_waits_for_what_ended_last(monkeypatch: pytest.MonkeyPatch) -> None:
    """A made-up timeline: the previous node on the stream, the microbatch's previous
    node on the other stream (not past a ``W``), the host's issue, or nothing recorded."""
    ex = _module("explain_prediction", monkeypatch)
    nt = _module("node_timing", monkeypatch)

    def node(mb: int, slot: Slot, d: Direction, stream: StreamKind, t: tuple[float, ...]) -> Any:
        return ex.Node(nt.NodeKey(mb, 0, slot, d), stream, *t)

    nodes = [
        node(0, Slot.MLP, F, COMP, (0.0, 2.0, 0.0)),
        node(0, Slot.COMBINE, F, COMM, (2.0, 3.0, 0.1)),  # its microbatch's mlp
        node(1, Slot.MLP, F, COMP, (2.0, 4.0, 0.2)),  # the stream
        node(0, Slot.MLP, W, COMP, (4.0, 5.0, 0.3)),  # the stream (a W waits for no event)
        node(1, Slot.COMBINE, F, COMM, (9.0, 10.0, 9.0)),  # the host issued it late
        node(0, Slot.MLP, B, COMP, (7.0, 8.0, 0.4)),  # nothing recorded: 2 ms unexplained
    ]
    got = ex.waits(nodes, None, event=True)
    seen = [(w.what, None if w.on is None else w.on.label()) for w in got.values()]
    assert seen == [
        ("host", None),  # issued at the origin, started then
        ("event", "mb0.L0.mlp.F"),
        ("stream", "mb0.L0.mlp.F"),
        ("stream", "mb1.L0.mlp.F"),
        ("host", None),
        ("none", None),
    ]
    assert got[nodes[-1].key].gap_ms == pytest.approx(2.0)
    # the model ran each node 1 ms earlier from the host's one on: only that node grew
    model = [
        ex.Node(n.key, n.stream, n.start - (n.start >= 9), n.end - (n.start >= 9)) for n in nodes
    ]
    want = ex.waits(model, None, event=True)
    d = ex.drift(nodes, model, got, want, top=1, threshold_ms=0.5)
    assert [x["node"] for x in d["largest"]] == ["mb1.L0.combine.F"]
    assert d["largest"][0]["growth_ms"] == pytest.approx(1.0)


def test_the_comparison_chart_says_what_it_shows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    figures = saved_figures(monkeypatch)
    nt = _module("node_timing", monkeypatch)
    spans = [
        nt.NodeSpan(nt.NodeKey(0, 0, Slot.MLP, d), COMP, i, i + 1.0)
        for i, d in enumerate((F, R, B, W))
    ]
    later = [nt.NodeSpan(s.key, s.stream, s.start_ms + 0.5, s.end_ms + 0.5) for s in spans]
    nt.write_gantt_png(later, tmp_path / "t.png", title="searched: measured above", compare=spans)
    (fig,) = figures
    check_figure(
        fig,
        title=["searched: measured above"],
        x_unit="(ms)",
        legend={"forward", "backward", "weight gradient", "recompute"},
    )
    ticks = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert ticks == ["predicted comm", "predicted comp", "measured comm", "measured comp"]


def _node(node: str, stream: str, lo: float, hi: float) -> dict[str, Any]:
    return {"node": node, "stream": stream, "start_ms": lo, "end_ms": hi, "issued_ms": lo}


def test_contention_by_kind_reads_the_coefficient_each_row_implies(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A combine backward of 10 ms alone takes 12 ms with half of it beside compute in one
    row (coefficient 0.4) and 14 ms entirely beside compute in the other (0.4 again): the
    replay from the first row's coefficient is the second row's measurement; a file that is
    not an explain.json is the parser's one-line error."""
    cbk = _module("contention_by_kind", monkeypatch)
    alone = [_node("mb0.L0.combine.B", "comp", 0.0, 10.0)]
    overlapped = [_node("mb0.L0.combine.B", "comm", 0.0, 12.0), _node("x.mlp.F", "comp", 6.0, 12.0)]
    searched = [_node("mb0.L0.combine.B", "comm", 0.0, 14.0), _node("x.mlp.F", "comp", 0.0, 14.0)]
    result = {
        "name": "made up",
        "contention_fitted_here": {"planner": 0.1},
        "timelines": {
            "measured": {
                "overlapped": overlapped,
                "searched": searched,
                "searched_serial": alone,
            }
        },
    }
    path = tmp_path / "explain.json"
    path.write_text(json.dumps({"command": "c", "device": "d", "results": [result]}))
    assert cbk.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "| overlapped | combine.B | 12.0 | 10.0 | 1.200 | 0.500 | 0.400 |" in out
    assert "| searched | combine.B | 14.0 | 10.0 | 1.400 | 1.000 | 0.400 |" in out
    assert "measured 14.0 ms; each kind's coefficient from overlapped" in out
    assert "compute: 14.0 ms (+0.0%); one factor 0.100 on every node: 11.0 ms (-21.4%)" in out
    path.write_text("[]")
    with pytest.raises(SystemExit) as exc:
        cbk.main([str(path)])
    assert exc.value.code == 2


RECORDED = ROOT / "benchmarks" / "results" / "h100_2026_12_07b" / "explain" / "explain.json"


def _offline(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> tuple[Any, str, dict[str, Any], dict[str, Any], dict[str, Any], dict[str, float]]:
    """``--offline`` run on the committed H100 run: the module, what it printed, the
    recorded document, its one result, its measured rows and each node's one-stream ms."""
    ex = _module("explain_prediction", monkeypatch)
    ex.main(["--offline", str(RECORDED)])
    out = capsys.readouterr().out
    doc = json.loads(RECORDED.read_text())
    (result,) = doc["results"]
    measured = result["timelines"]["measured"]
    alone = {x["node"]: x["end_ms"] - x["start_ms"] for x in measured["searched_serial"]}
    return ex, out, doc, result, measured, alone


def _past_and_beside(
    nodes: list[dict[str, Any]], stream: str, alone: dict[str, float]
) -> dict[str, list[float]]:
    """Per node kind of ``stream``: its nodes' ms past ``alone`` and ms beside the other
    stream's busy time (merged intervals), recomputed from a recorded row."""
    other = "comp" if stream == "comm" else "comm"
    busy: list[list[float]] = []
    for x in sorted(nodes, key=lambda x: x["start_ms"]):
        if x["stream"] == other:
            if busy and x["start_ms"] <= busy[-1][1]:
                busy[-1][1] = max(busy[-1][1], x["end_ms"])
            else:
                busy.append([x["start_ms"], x["end_ms"]])
    sums: dict[str, list[float]] = {}
    for x in nodes:
        if x["stream"] == stream:
            lo, hi = x["start_ms"], x["end_ms"]
            s = sums.setdefault(".".join(x["node"].split(".")[-2:]), [0.0, 0.0])
            s[0] += hi - lo - alone[x["node"]]
            s[1] += sum(max(0.0, min(hi, e) - max(lo, b)) for b, e in busy)
    return sums


def test_offline_the_by_kind_model_is_what_the_recorded_run_implies(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--offline`` on the committed H100 run: each kind's coefficient is the one its
    recorded overlapped nodes imply (time past alone over time beside compute, ``c / (1 +
    c)``; 0 when no slower); the one factor replays the run's own prediction; every figure
    printed is finite, and the searched step is within 5 % with the coefficients per kind
    (6.4 % short with one factor)."""
    ex, out, doc, result, measured, alone = _offline(monkeypatch, capsys)
    sums = _past_and_beside(measured["overlapped"], "comm", alone)
    share = {k: max(0.0, past / beside) for k, (past, beside) in sums.items()}
    want = {k: v / (1.0 - v) for k, v in share.items()}
    frontier = json.loads(
        (ROOT / "benchmarks" / "results" / "frontier" / "frontier.json").read_text()
    )
    (found,) = ex.offline(doc, frontier["configs"])
    assert found["by_kind_fit"]["coefficients"] == pytest.approx(want, rel=1e-9)
    assert found["by_kind_fit"]["clamped"] == ["combine.F"]  # no slower than alone here
    rows = found["rows"]
    for row in ("overlapped", "searched"):
        recorded = result["rows"][row]["models"]["one_event_measured_w"]
        assert rows[row]["one_factor"]["step_ms"] == pytest.approx(
            recorded["predicted_step_ms"], rel=1e-9
        )
        for model in ("one_factor", "by_kind"):
            for key in ("step_ms", "comm_busy_ms"):
                assert math.isfinite(rows[row][model][key]) and rows[row][model][key] > 0
    searched = rows["searched"]
    step = searched["measured_step_ms"]
    assert abs(searched["by_kind"]["step_ms"] / step - 1) < 0.05
    assert searched["one_factor"]["step_ms"] / step - 1 < -0.06
    printed = (
        f"{searched['by_kind']['step_ms']:.1f} ({searched['by_kind']['step_ms'] / step - 1:+.1%})"
    )
    assert f"| searched | {step:.1f} | " in out and printed in out
    with pytest.raises(SystemExit):
        ex.main(["--offline", str(ROOT / "pyproject.toml")])


def test_offline_the_by_kind_both_model_is_what_the_recorded_run_implies(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--offline``'s compute coefficients are the ones the recorded overlapped compute
    nodes imply (time past their one-stream time, a backward's with its ``W``, over time
    beside the communication stream); fitted on combined 1F1B they replay its compute
    stream within 1 %, and predict the searched step within 2.5 % and nearer than the
    communication coefficients alone, every figure finite."""
    ex, out, doc, _, measured, alone = _offline(monkeypatch, capsys)
    for node in list(alone):  # a backward's one-stream time with its W (the step's B has it)
        if node.endswith(".B"):
            alone[node] += alone.get(node[:-1] + "W", 0.0)
    sums = _past_and_beside(measured["overlapped"], "comp", alone)
    want = {k: past / (beside - past) for k, (past, beside) in sums.items() if beside > 0}
    assert set(want) == {"pre_dispatch.F", "pre_dispatch.B", "mlp.F", "mlp.B"}
    assert all(c > 0 for c in want.values())
    frontier = json.loads(
        (ROOT / "benchmarks" / "results" / "frontier" / "frontier.json").read_text()
    )
    (found,) = ex.offline(doc, frontier["configs"])
    fit = found["compute_by_kind_fit"]
    assert {k: v for k, v in fit["coefficients"].items() if v} == pytest.approx(want, rel=1e-9)
    assert fit["clamped"] == [] and "mlp.W" in fit["unseen"] and "mlp.R" in fit["unseen"]
    rows = found["rows"]
    for row in ("overlapped", "searched"):
        for model in ("by_kind_both", "by_kind_both_wr0"):
            for key in ("step_ms", "comp_busy_ms", "comm_busy_ms"):
                assert math.isfinite(rows[row][model][key]) and rows[row][model][key] > 0
    fitted = rows["overlapped"]
    assert abs(fitted["by_kind_both"]["comp_busy_ms"] / fitted["measured_comp_busy_ms"] - 1) < 0.01
    assert fitted["by_kind"]["comp_busy_ms"] / fitted["measured_comp_busy_ms"] - 1 < -0.04
    searched = rows["searched"]
    step = searched["measured_step_ms"]
    both = searched["by_kind_both"]["step_ms"] / step - 1
    assert abs(both) < 0.025 and abs(both) < abs(searched["by_kind"]["step_ms"] / step - 1)
    assert searched["by_kind_both_wr0"]["step_ms"] <= searched["by_kind_both"]["step_ms"]
    printed = f"| searched | by_kind_both | {searched['by_kind_both']['step_ms']:.1f} ({both:+.1%})"
    assert printed in out


RECORDED_N8 = ROOT / "benchmarks" / "results" / "h100_2026_12_07d" / "explain8" / "explain.json"


def test_offline_fit_from_predicts_out_of_sample(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--fit-from``: the models fitted on the committed main N=4 run (another machine's
    session) replay the committed main N=8 run with exactly those coefficients, and predict
    its searched step within 2.5 % with both streams per kind; without it each run uses its
    own fit. A configuration the other file lacks, or ``--fit-from`` without ``--offline``,
    is a usage error."""
    ex = _module("explain_prediction", monkeypatch)
    n4, n8 = (json.loads(p.read_text()) for p in (RECORDED, RECORDED_N8))
    frontier = json.loads(
        (ROOT / "benchmarks" / "results" / "frontier" / "frontier.json").read_text()
    )
    fits = ex.fits_of(n4["results"][0])
    (own,) = ex.offline(n8, frontier["configs"])
    (out_of_sample,) = ex.offline(n8, frontier["configs"], ("main N=4", fits))
    assert own["fitted_on"] == "this run" and out_of_sample["fitted_on"] == "main N=4"
    assert out_of_sample["by_kind_fit"] == ex.fit_json(fits[0])
    assert out_of_sample["compute_by_kind_fit"] == ex.fit_json(fits[1])
    assert own["by_kind_fit"] != out_of_sample["by_kind_fit"]
    searched = out_of_sample["rows"]["searched"]
    step = searched["measured_step_ms"]
    assert abs(searched["by_kind_both"]["step_ms"] / step - 1) < 0.025
    ex.main(["--offline", str(RECORDED_N8), "--fit-from", str(RECORDED), "main N=4"])
    assert f"of main N=4 in {RECORDED}" in capsys.readouterr().out
    for argv in (
        ["--offline", str(RECORDED_N8), "--fit-from", str(RECORDED), "main N=9"],
        ["--fit-from", str(RECORDED), "main N=4"],
    ):
        with pytest.raises(SystemExit) as exc:
            ex.main(argv)
        assert exc.value.code == 2
