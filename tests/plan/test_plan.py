"""The planner on CPU: published bubble and memory formulas from torch's own action lists,
the one-rank replay against the engine's, the validation figures from the committed H200
profiles, refusals and the command line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from moe_overlap import ConfigError
from moe_overlap.__main__ import main
from moe_overlap.integrations.pipelining import schedule_order
from moe_overlap.plan import (
    Costs,
    Layout,
    Machine,
    ModelSpec,
    Plan,
    Schedule,
    costs_from_model,
    costs_from_profile,
    fit_contention,
    load_profile,
    plan,
    stage_layers,
)
from moe_overlap.plan import _plan as plan_module
from moe_overlap.steps import (
    ChunkShape,
    Direction,
    LayerShape,
    ScheduleMode,
    Slot,
    SlotKey,
    predict_ms,
)
from tests import forked
from tests.figures import check_figure, saved_figures
from tests.parallel_runs import ParallelRuns, selected_in

ROOT = Path(__file__).resolve().parents[2]


def _python(*argv: str) -> subprocess.CompletedProcess[str]:
    """``python *argv``, forked from a zygote that imported torch (:mod:`tests.forked`)."""
    return forked.run([sys.executable, *argv], timeout=600)


RUNS: dict[str, Callable[[Path], subprocess.CompletedProcess[str]]] = {
    "test_validation_points_are_within_5_percent": lambda out: _python(
        str(ROOT / "benchmarks" / "plan_validate.py"), "--out", str(out / "v.json")
    ),
    "test_command_line": lambda out: _python(
        *("-m", "moe_overlap", "plan", "--model", "qwen3-30b-a3b", "--machine", "h100"),
        *("--ep", "8", "--pp", "2", "--vpp", "2", "--microbatches", "8", "--seq-len", "1024"),
        *("--out", str(out)),
    ),
    "test_planning_page_tables_are_current": lambda out: _python(
        str(ROOT / "benchmarks" / "plan_tables.py"), "--check"
    ),
}
"""The subprocess runs of this module's tests, by test name (``out``: a folder of the
test's own). Each is one single-threaded process: they start ahead of their tests, two at
a time (:class:`~tests.parallel_runs.ParallelRuns`)."""
Ran = tuple[subprocess.CompletedProcess[str], Path]


@pytest.fixture(scope="module")
def _runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ParallelRuns[Ran]]:
    def job(name: str) -> Callable[[], Ran]:
        out = tmp_path_factory.mktemp(name)
        return lambda: (RUNS[name](out), out)

    runs = ParallelRuns(
        {name: job(name) for name in RUNS}, [n for n in selected_in(request) if n in RUNS]
    )
    yield runs
    runs.close()


@pytest.fixture
def ran(request: pytest.FixtureRequest, _runs: ParallelRuns[Ran]) -> Ran:
    """This test's run (its entry of :data:`RUNS`) and its folder."""
    return _runs.result(request.node.name)


F_, B_, W_ = Direction.FORWARD, Direction.BACKWARD, Direction.WGRAD


def _stage_costs(
    stages: int, *, f: float, b_in: float, w: float, moe: bool = False, comm: float = 0.0
) -> Costs:
    """One layer per stage: forward ``f`` (plus ``comm`` per all-to-all for MoE), input
    backward ``b_in``, weight backward ``w``; one activation unit per stage."""
    t: dict[SlotKey, float] = {}
    for layer in range(stages):
        t[(layer, Slot.PRE_DISPATCH, F_)] = f / 2
        t[(layer, Slot.MLP, F_)] = f / 2
        t[(layer, Slot.PRE_DISPATCH, B_)] = b_in / 2
        t[(layer, Slot.MLP, B_)] = b_in / 2
        t[(layer, Slot.PRE_DISPATCH, W_)] = w / 2
        t[(layer, Slot.MLP, W_)] = w / 2
        if moe:
            for slot in (Slot.DISPATCH, Slot.COMBINE):
                t[(layer, slot, F_)] = comm
                t[(layer, slot, B_)] = comm
    return Costs(times=t, moe=(moe,) * stages, activation_bytes=(1.0,) * stages, weight_split=True)


def _action_ms(p: Plan, marker: str) -> float:
    """The replayed length of the first action whose label contains ``marker``."""
    label = next(s.action for s in p.spans if marker in s.action and s.rank == 0)
    spans = [s for s in p.spans if s.action == label and s.rank == 0]
    return max(s.end_ms for s in spans) - min(s.start_ms for s in spans)


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
@pytest.mark.parametrize("per_rank", [2, 3])
def test_1f1b_and_zb1p_bubbles_match_the_published_formulas(pp: int, per_rank: int) -> None:
    """DualPipe's table: 1F1B (PP-1)(F+B), ZB1P (PP-1)(F+B-2W), B a full backward; ZB1P's
    activations PP on the first rank. torch's runnable 1F1B order (its interleaved runtime at
    one stage per rank) warms up 2(PP-1) forwards on the first rank, so 2PP-1 activations
    there, not the textbook's PP (torch's Schedule1F1B keeps no runnable action list)."""
    n = per_rank * pp
    for f, b_in, w in ((1.0, 1.2, 0.8), (2.0, 1.5, 1.5), (1.0, 2.0, 0.3)):
        b = b_in + w
        costs = _stage_costs(pp, f=f, b_in=b_in, w=w)
        layout = Layout(pp=pp, microbatches=n)
        one = plan(costs, layout, "1f1b")
        zb = plan(costs, layout, "zero_bubble")
        for r in one.ranks:
            assert r.bubble_ms == pytest.approx((pp - 1) * (f + b))
        for r in zb.ranks:
            assert r.bubble_ms == pytest.approx((pp - 1) * (f + b - 2 * w))
        assert zb.ranks[0].peak_activation_units == pp
        assert one.ranks[0].peak_activation_units == min(n, 2 * pp - 1)


@pytest.mark.parametrize("devices", [2, 3, 4, 6])
def test_dualpipev_bubble_and_memory_match_the_published_formulas(devices: int) -> None:
    """DualPipeV on PP/2 devices: bubble (PP/2-1)(F&B+B-3W) on every device, activations
    PP+1, for chunks balanced as the formula assumes (a forward as long as the input
    backward; F&B = F+B, nothing to hide). With all-to-alls that the pair hides, the
    replayed bubble is smaller than the formula gives (``docs/planning.md``)."""
    stages = 2 * devices
    for f, w in ((1.0, 1.0), (1.0, 0.5), (2.0, 1.5), (1.0, 0.2)):
        costs = _stage_costs(stages, f=f, b_in=f, w=w)
        b = f + w
        for n in (stages, 2 * stages):
            p = plan(costs, Layout(pp=devices, microbatches=n), "dualpipev")
            f_and_b = _action_ms(p, "+")
            assert f_and_b == pytest.approx(f + b)
            for r in p.ranks:
                assert r.bubble_ms == pytest.approx((devices - 1) * (f_and_b + b - 3 * w))
                assert r.peak_activation_units == stages + 1
            assert p.torch_class == "ScheduleDualPipeV"


def test_dualpipev_with_all_to_alls_hides_them_in_the_pairs() -> None:
    costs = _stage_costs(8, f=1.0, b_in=1.0, w=0.5, moe=True, comm=0.3)
    p = plan(costs, Layout(pp=4, microbatches=16), "dualpipev")
    serial_pair = 1.6 + 1.6 + 0.5  # forward and full backward, each with two all-to-alls
    assert _action_ms(p, "+") < serial_pair
    formula = 3 * (_action_ms(p, "+") + 2.1 - 1.5)
    assert max(r.bubble_ms for r in p.ranks) <= formula


def test_dualpipev_parameters_are_two_stages_per_device() -> None:
    order = schedule_order("ScheduleDualPipeV", pp=4, stages_per_rank=2, n_microbatches=8)
    stages = {
        r: {a.stage_index for a in acts if a is not None and a.sub_actions is None}
        for r, acts in order.items()
    }
    assert stages == {0: {0, 7}, 1: {1, 6}, 2: {2, 5}, 3: {3, 4}}


def _reference_costs(layers: int = 2) -> Costs:
    t: dict[SlotKey, float] = {
        (None, Slot.PRE_PROCESS, F_): 0.1,
        (None, Slot.POST_PROCESS, F_): 0.4,
    }
    t[(None, Slot.POST_PROCESS, B_)] = 0.5
    for layer in range(layers):
        for slot, ms in (
            (Slot.PRE_DISPATCH, 1.0),
            (Slot.DISPATCH, 0.7),
            (Slot.MLP, 1.3),
            (Slot.COMBINE, 0.9),
        ):
            t[(layer, slot, F_)] = ms
            t[(layer, slot, B_)] = 1.7 * ms
    return Costs(times=t, moe=(True,) * layers)


@pytest.mark.parametrize(
    ("schedule", "mode"),
    [
        ("serial", ScheduleMode.SERIAL),
        ("combined_1f1b", ScheduleMode.OVERLAPPED),
        ("fill_drain", ScheduleMode.FILL_DRAIN),
    ],
)
@pytest.mark.parametrize("n", [1, 2, 5])
def test_one_rank_is_the_engines_own_replay(schedule: str, mode: ScheduleMode, n: int) -> None:
    costs = _reference_costs()
    shape = ChunkShape(layers=tuple(LayerShape(index=i, is_moe=True) for i in range(2)))
    p = plan(costs, Layout(microbatches=n), schedule)
    assert p.step_ms == pytest.approx(predict_ms(shape, costs.times, n, mode))
    assert p.torch_class is None


def test_serial_is_the_sum_of_the_nodes() -> None:
    costs = _reference_costs()
    p = plan(costs, Layout(microbatches=3), "serial")
    assert p.step_ms == pytest.approx(3 * sum(costs.times.values()))
    assert p.ranks[0].bubble_ms == pytest.approx(0.0)


def test_validation_points_are_within_5_percent(ran: Ran) -> None:
    """``benchmarks/plan_validate.py`` on the committed H200 profiles: every predicted
    point within 5 % of its measured step, and the committed JSON is what it writes."""
    done, tmp_path = ran
    out = tmp_path / "v.json"
    assert done.returncode == 0, done.stderr
    got = json.loads(out.read_text())
    points = got["points"]
    assert len(points) >= 14
    for point in points:
        assert abs(point["error"]) < 0.05, point
    committed = json.loads(
        (ROOT / "benchmarks" / "results" / "round9" / "plan_validation.json").read_text()
    )
    assert [round(p["predicted_ms"], 6) for p in committed["points"]] == [
        round(p["predicted_ms"], 6) for p in points
    ]


def test_profile_rows_and_tiling() -> None:
    rows = json.loads(
        (
            ROOT / "benchmarks" / "results" / "round10" / "pp_dualpipev" / "pp_results.json"
        ).read_text()
    )["ranks"][0]["serial_slot_durations"]
    profile = load_profile(rows)
    costs = costs_from_profile(profile, num_layers=6)
    assert costs.moe == (True,) * 6
    assert costs.times[(5, Slot.MLP, F_)] == profile[(1, Slot.MLP, F_)]
    with pytest.raises(ConfigError, match="slot"):
        load_profile([{"layer": 0, "slot": "nope", "direction": "F", "ms": 1.0}])
    with pytest.raises(ConfigError, match="milliseconds"):
        load_profile([{"layer": 0, "slot": "mlp", "direction": "F", "ms": -1.0}])


def test_replace_refuses_an_unknown_field() -> None:
    """``Layout.replace``, ``Costs.replace`` and ``ScheduleGraph.replace`` with a name that
    is not a field: the library's error naming the class, the name and the fields (a bare
    ``TypeError`` from ``dataclasses.replace`` before); a known one still replaces."""
    from moe_overlap.plan import ScheduleGraph

    costs = _reference_costs()
    graph = ScheduleGraph(microbatches=2, moe=(True,))
    for obj, name in ((Layout(), "Layout"), (costs, "Costs"), (graph, "ScheduleGraph")):
        with pytest.raises(
            ConfigError,
            match=rf"{name}.replace: expected fields of {name} .*"
            r"received ppp; use those names",
        ):
            obj.replace(ppp=2)
    assert Layout().replace(pp=2).pp == 2
    assert costs.replace(comm_contention=0.5).comm_contention == 0.5
    assert graph.replace(microbatches=3).microbatches == 3
    with pytest.raises(ConfigError, match="Layout.pp"):
        Layout().replace(pp=0)


def test_load_profile_refuses_what_is_not_rows(tmp_path: Path) -> None:
    """Rows that are not mappings, a source that is neither a path nor rows, a missing or
    unreadable file: the library's own error naming what was received (they were a bare
    TypeError, FileNotFoundError or JSONDecodeError)."""
    with pytest.raises(ConfigError, match=r"each row a mapping .* received int 1"):
        load_profile(cast("list[dict[str, object]]", [1, 2]))
    with pytest.raises(ConfigError, match="received NoneType None"):
        load_profile(cast("list[dict[str, object]]", [None]))
    with pytest.raises(ConfigError, match="a path or rows .* received int 5"):
        load_profile(cast("list[dict[str, object]]", 5))
    missing = tmp_path / "missing.json"
    with pytest.raises(ConfigError, match="readable JSON file .*missing.json"):
        load_profile(missing)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ConfigError, match="readable JSON file .*broken.json"):
        load_profile(broken)


def test_stage_layers_checks_its_counts() -> None:
    """0 stages was a bare ZeroDivisionError, negative counts gave no stages, ``True``
    stages one, a float a bare TypeError."""
    assert stage_layers(5, 2) == [range(0, 3), range(3, 5)]
    for layers, stages, name in (
        (4, 0, "num_stages"),
        (-1, -2, "num_layers"),
        (4, True, "num_stages"),
        (4.0, 2, "num_layers"),
    ):
        with pytest.raises(ConfigError, match=rf"^stage_layers: {name} must be an int >= 1"):
            stage_layers(cast(Any, layers), cast(Any, stages))


def test_refusals() -> None:
    costs = _reference_costs()
    with pytest.raises(ConfigError, match="fill_drain runs on one pipeline rank"):
        plan(costs, Layout(pp=2, microbatches=4), "fill_drain")
    with pytest.raises(ConfigError, match="2 stage"):
        plan(costs, Layout(pp=1, vpp=3, microbatches=4), "dualpipev")
    with pytest.raises(ConfigError, match="at least one layer per stage"):
        plan(costs, Layout(pp=2, vpp=2, microbatches=4), "serial")
    with pytest.raises(ConfigError, match="Schedule"):
        plan(costs, Layout(), "2f2b")
    with pytest.raises(ConfigError, match="Layout.pp"):
        Layout(pp=0)
    with pytest.raises(ConfigError, match="Costs.times"):
        Costs(times={(7, Slot.MLP, F_): 1.0}, moe=(True,))
    with pytest.raises(ConfigError, match=r"Costs.times: the milliseconds of .* received float -1"):
        Costs(times={(0, Slot.MLP, F_): -1.0}, moe=(True,))
    with pytest.raises(ConfigError, match="Costs.activation_bytes"):
        Costs(times={}, moe=(True, True), activation_bytes=(1.0,))


def test_torch_schedule1f1b_list_is_refused() -> None:
    """torch 2.13's Schedule1F1B.pipeline_order shifts the last rank's microbatches (it is
    for show: the schedule runs without it); schedule_order checks every list it returns."""
    import torch

    if torch.__version__.startswith("2.13"):
        with pytest.raises(ConfigError, match="outside its"):
            schedule_order("Schedule1F1B", pp=2, stages_per_rank=1, n_microbatches=4)
    with pytest.raises(ConfigError, match="schedule_class must be one of"):
        schedule_order("ScheduleNope", pp=2, stages_per_rank=1, n_microbatches=4)
    with pytest.raises(ConfigError, match="stage"):
        schedule_order("ScheduleDualPipeV", pp=2, stages_per_rank=1, n_microbatches=4)


def test_schedule_names() -> None:
    assert Schedule.of("dualpipev") is Schedule.DUALPIPEV
    assert {s.value for s in Schedule} >= {"serial", "combined_1f1b", "fill_drain", "zero_bubble"}


def test_command_line(ran: Ran) -> None:
    done, tmp_path = ran
    assert done.returncode == 0, done.stderr
    assert "dualpipev vs serial" in done.stdout
    # The serial reference is the schedule without overlap, not torch's class by that name.
    assert (
        "serial: EP=8 PP=2 DP=1 VPP=2 microbatches=8 (16 GPUs), no overlap, torch "
        "ScheduleInterleaved1F1B's order\n"
    ) in done.stdout
    assert "combined_1f1b: EP=8 PP=2 DP=1 VPP=2 microbatches=8 (16 GPUs), a forward " in done.stdout
    data = json.loads((tmp_path / "plan.json").read_text())
    assert [p["schedule"] for p in data["plans"]] == ["serial", "combined_1f1b", "dualpipev"]
    assert (tmp_path / "plan_dualpipev_trace.json").exists()
    assert f"wrote {tmp_path / 'plan.json'}" in done.stdout


@pytest.mark.parametrize(
    ("schedule", "pp", "origin"),
    [
        ("serial", 1, "no overlap, the engine's macro steps"),
        ("serial", 2, "no overlap, torch ScheduleInterleaved1F1B's order"),
        (
            "combined_1f1b",
            1,
            "a forward overlapped with another microbatch's backward, the engine's macro steps",
        ),
        (
            "combined_1f1b",
            2,
            "a forward overlapped with another microbatch's backward, paired in torch "
            "ScheduleInterleaved1F1B's order",
        ),
        ("fill_drain", 1, "combined 1F1B with the fill and the drain overlapped too"),
        ("interleaved_1f1b", 2, "torch ScheduleInterleaved1F1B"),
        ("dualpipev", 2, "torch ScheduleDualPipeV"),
    ],
)
def test_summary_says_what_ran(schedule: str, pp: int, origin: str) -> None:
    vpp = 2 if pp > 1 else 1
    p = plan(_reference_costs(2 * pp * vpp), Layout(pp=pp, vpp=vpp, microbatches=4), schedule)
    assert p.origin.startswith(origin), p.origin
    assert p.summary().splitlines()[0].endswith(f"GPUs), {p.origin}")


def test_gantt_png_says_what_it_shows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    figures = saved_figures(monkeypatch)
    costs = _stage_costs(4, f=1.0, b_in=1.0, w=1.0, moe=True, comm=0.3)
    p = plan(costs, Layout(pp=2, vpp=2, microbatches=4), "zero_bubble")
    assert p.gantt_png(tmp_path / "g.png").stat().st_size > 0
    (fig,) = figures
    check_figure(
        fig,
        title=["predicted zero_bubble step", "PP=2", f"{p.step_ms:.1f} ms", p.origin],
        x_unit="(ms)",
        legend={"forward", "backward", "weight gradient"},
    )


def test_gantt_png_without_matplotlib_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    p = plan(_reference_costs(), Layout(microbatches=2), "serial")
    with pytest.raises(ConfigError, match=r"pip install 'moe-overlap\[demo\]'"):
        p.gantt_png(tmp_path / "g.png")
    assert not (tmp_path / "g.png").exists()


def test_planning_page_tables_are_current(ran: Ran) -> None:
    """``docs/planning.md``'s tables are the saved JSON's, and the first layout of each model
    still predicts what the JSON holds (``benchmarks/plan_tables.py --check``)."""
    done, _ = ran
    assert done.returncode == 0, done.stdout + done.stderr


def test_more_stages_than_layers_is_refused_before_lowering(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A huge ``pp`` is refused from the layout alone: lowering 20000 stages took minutes."""

    def never(*_: object) -> None:
        raise AssertionError("lowered before the stage count was checked")

    monkeypatch.setattr(plan_module, "lower", never)
    with pytest.raises(ConfigError, match="received 2 layers for 20000 stages"):
        plan(_reference_costs(), Layout(pp=10_000, microbatches=4), "dualpipev")


def _profile() -> dict[tuple[int | None, Slot, Direction], float]:
    out: dict[tuple[int | None, Slot, Direction], float] = {}
    for slot, ms in ((Slot.PRE_DISPATCH, 1.0), (Slot.DISPATCH, 0.5), (Slot.MLP, 2.0)):
        out[(0, slot, Direction.FORWARD)] = ms
        out[(0, slot, Direction.BACKWARD)] = 2 * ms
    out[(0, Slot.COMBINE, Direction.FORWARD)] = 0.5
    out[(0, Slot.COMBINE, Direction.BACKWARD)] = 1.0
    return out


def test_costs_from_profile_refuses_what_it_would_misread() -> None:
    """Each case was a bare TypeError, or a node timed 0 ms / a profile layer dropped
    silently."""
    profile = _profile()
    two = profile | {(1, s, d): ms for (_, s, d), ms in profile.items()}
    no_mlp_b = {k: v for k, v in profile.items() if k != (0, Slot.MLP, Direction.BACKWARD)}
    dense = {k: v for k, v in profile.items() if k[1] not in (Slot.DISPATCH, Slot.COMBINE)}
    cases: list[tuple[Callable[[], object], str]] = [
        (
            lambda: costs_from_profile(profile, num_layers=_bad("2")),
            "num_layers must be an int >= 1",
        ),
        (lambda: costs_from_profile(profile, num_layers=True), "num_layers must be an int >= 1"),
        (lambda: costs_from_profile(profile, num_layers=0), "num_layers must be an int >= 1"),
        (lambda: costs_from_profile(profile, num_layers=2, moe=[True] * 3), "one flag per layer"),
        (lambda: costs_from_profile(_bad(None), num_layers=2), "expected a mapping of (layer"),
        (lambda: costs_from_profile(two, num_layers=1), "at most num_layers=1 layers"),
        (lambda: costs_from_profile(no_mlp_b, num_layers=2), "layer 0's mlp backward"),
        (lambda: costs_from_profile(dense, num_layers=2, moe=[True, True]), "moe[0] True"),
    ]
    for call, message in cases:
        with pytest.raises(ConfigError, match=re.escape(message)):
            call()
    assert costs_from_profile(profile, num_layers=2).moe == (True, True)
    assert costs_from_profile(dense, num_layers=2).moe == (False, False)


@pytest.mark.parametrize(
    "key",
    ["x", (0, Slot.MLP), ("0", Slot.MLP, Direction.FORWARD), (True, Slot.MLP, Direction.FORWARD)],
)
def test_costs_refuses_keys_that_are_not_layer_slot_direction(key: object) -> None:
    with pytest.raises(ConfigError, match=r"Costs.times: expected keys \(layer in 0..1 or None"):
        Costs(times=_bad({key: 1.0}), moe=(True, True))


@pytest.mark.parametrize(
    "key",
    [
        (0, Slot.DISPATCH, Direction.FORWARD),  # layer 0 is dense
        (0, Slot.COMBINE, Direction.BACKWARD),
        (1, Slot.MLP, Direction.RECOMPUTE),
        (1, Slot.PRE_FORWARD, Direction.HOOK),
        (1, Slot.MTP_POST, Direction.FORWARD),
        (1, Slot.PRE_PROCESS, Direction.FORWARD),
        (None, Slot.MLP, Direction.FORWARD),
    ],
)
def test_costs_refuses_times_no_replay_reads(key: SlotKey) -> None:
    """Each was taken and never read: its milliseconds dropped without a word."""
    with pytest.raises(ConfigError, match=r"Costs.times: expected only keys a replay reads") as e:
        Costs(times={key: 1.0}, moe=(False, True))
    assert repr(key) in str(e.value) and "drop them" in str(e.value)


_LAYER = (Slot.PRE_DISPATCH, Slot.MLP, Slot.DISPATCH, Slot.COMBINE)


def test_costs_takes_every_key_a_replay_reads() -> None:
    """Every node of an MoE and a dense layer and the pre- and post-process, forward,
    backward and weight gradient (a communication node's W is added to its backward)."""
    times: dict[SlotKey, float] = {}
    for layer, slots in ((0, _LAYER[:2]), (1, _LAYER)):
        for slot in slots:
            for d in (Direction.FORWARD, Direction.BACKWARD, Direction.WGRAD):
                times[(layer, slot, d)] = 1.0
    for slot in (Slot.PRE_PROCESS, Slot.POST_PROCESS):
        for d in (Direction.FORWARD, Direction.BACKWARD, Direction.WGRAD):
            times[(None, slot, d)] = 1.0
    assert Costs(times=times, moe=(False, True)).times == times
    profile = _profile()
    with pytest.raises(ConfigError, match=r"received 4 other key\(s\): \(0, <Slot.DISPATCH"):
        costs_from_profile(profile, num_layers=2, moe=[False, True])


def test_vpp_at_one_pipeline_rank_cuts_the_model_into_stages(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """vpp > 1 at pp=1 is not ignored: torch's interleaved order of vpp stages on the one
    rank (combined_1f1b pairs one stage's forward with another's backward)."""
    costs = _reference_costs(4)
    whole = plan(costs, Layout(microbatches=4), "combined_1f1b")
    staged = plan(costs, Layout(vpp=2, microbatches=4), "combined_1f1b")
    assert whole.torch_class is None
    assert staged.torch_class == "ScheduleInterleaved1F1B"
    assert {s.action for s in staged.spans} >= {"0F1+1B0", "1F0"}
    assert {s.rank for s in staged.spans} == {0}
    assert all(s.action.startswith("run(") for s in whole.spans)
    main(["plan", "--pp", "1", "--vpp", "2", "--microbatches", "2", "--schedule", "combined_1f1b"])
    assert "VPP=2" in capsys.readouterr().out


def test_the_summary_shows_the_stages_per_rank_a_schedule_runs() -> None:
    """A V schedule runs two stages per rank whatever ``vpp`` says, a one-stage schedule
    one: the summary line shows what runs (it printed the layout's VPP=1 for dualpipev)."""
    costs = _reference_costs(8)
    for schedule, vpp, shown in (("dualpipev", 1, 2), ("zbv", 1, 2), ("1f1b", 1, 1)):
        text = plan(costs, Layout(pp=2, vpp=vpp, microbatches=4), schedule).summary()
        assert f"PP=2 DP=1 VPP={shown} " in text, (schedule, text)
    text = plan(costs, Layout(pp=2, vpp=2, microbatches=4), "interleaved_1f1b").summary()
    assert "VPP=2 " in text


def test_a_step_of_more_microbatches_than_the_planner_takes_is_refused() -> None:
    """10**9 microbatches ran until killed (every node of every microbatch is replayed)."""
    assert Layout(microbatches=65536).microbatches == 65536
    with pytest.raises(ConfigError, match=r"Layout.microbatches: expected at most 65536 "):
        Layout(microbatches=10**9)
    with pytest.raises(ConfigError, match=r"Layout.microbatches: expected an int >= 1"):
        Layout(microbatches=0)
    with pytest.raises(ConfigError, match=r"Layout.microbatches: expected at most 65536 "):
        Layout().replace(microbatches=65537)


def test_layout_first_gpu_takes_a_rank_of_the_layout() -> None:
    """A rank outside the pipeline gave a GPU outside the layout (-8, 16), ``True`` rank 1."""
    layout = Layout(pp=2, ep=8)
    assert [layout.first_gpu(r) for r in range(2)] == [0, 8]
    for rank in (-1, 2, True):
        with pytest.raises(
            ConfigError, match=r"^Layout\.first_gpu: pp_rank must be an int in \[0, pp-1=1\]"
        ):
            layout.first_gpu(rank)


def test_load_profile_refuses_nan_ms_and_bool_layers() -> None:
    row = {"layer": 0, "slot": "mlp", "direction": "F", "ms": float("nan")}
    with pytest.raises(ConfigError, match="NaN and infinities are not durations"):
        load_profile([row])
    with pytest.raises(ConfigError, match="expected a layer index >= 0 or null"):
        load_profile([row | {"layer": True, "ms": 1.0}])


def test_fit_contention_refuses_a_step_contention_does_not_change() -> None:
    """A serial step's prediction is the same at any contention: the fit returned ~0."""
    costs = costs_from_profile(_profile(), num_layers=2)
    serial = plan(costs, Layout(), "serial").step_ms
    with pytest.raises(ConfigError, match="grows with contention"):
        fit_contention(costs, Layout(), "serial", serial)
    with pytest.raises(ConfigError, match="measured_ms must be the measured step's"):
        fit_contention(costs, Layout(), "combined_1f1b", _bad("10"))
    with pytest.raises(ConfigError, match="fit_contention: costs must be a Costs"):
        fit_contention(_bad(None), Layout(), "combined_1f1b", 10.0)
    for upper in (-1.0, float("nan"), True):  # named Costs.comm_contention before
        with pytest.raises(ConfigError, match=r"^fit_contention: upper must be a finite real"):
            fit_contention(costs, Layout(), "combined_1f1b", 10.0, upper=_bad(upper))


def test_costs_from_model_checks_its_arguments() -> None:
    """Each was a bare AttributeError (a preset's name for the model, no layout)."""
    model, machine = ModelSpec.preset("deepseek-v2-lite", seq_len=512), Machine.preset("h100")
    assert costs_from_model(model, machine, Layout()).num_layers == model.num_layers
    cases: list[tuple[Callable[[], object], str]] = [
        (
            lambda: costs_from_model(_bad("deepseek-v2-lite"), machine, Layout()),
            "model must be a ModelSpec",
        ),
        (lambda: costs_from_model(model, _bad("h100"), Layout()), "machine must be a Machine"),
        (lambda: costs_from_model(model, machine, _bad(None)), "layout must be a Layout"),
    ]
    for call, message in cases:
        with pytest.raises(ConfigError, match=rf"^costs_from_model: {message}"):
            call()


def _bad(value: object) -> Any:
    """``value`` typed ``Any``: a misuse the type checkers would flag, made at run time."""
    return value
