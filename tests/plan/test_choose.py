"""Choosing a schedule: the fastest within the budget, honest reasons, runnable answers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from moe_overlap.__main__ import main
from moe_overlap.errors import ConfigError
from moe_overlap.plan import (
    CHOICE_SPACE,
    QUICK_CHOICE_SPACE,
    ActivationModel,
    Costs,
    Recompute,
    SearchResult,
    SearchSpace,
    choose_schedule,
    costs_from_profile,
    load_profile,
    search_schedules,
)
from moe_overlap.plan._choose import pick
from moe_overlap.steps import Direction, NodeSchedule, Slot
from tests.engine.test_node_schedule import run_both

ROOT = Path(__file__).resolve().parents[2]
ROUND9 = json.loads((ROOT / "benchmarks/results/round9/results.json").read_text())["results"]
FRONTIER = json.loads((ROOT / "benchmarks/results/frontier_choice/frontier.json").read_text())
"""``python benchmarks/frontier.py --out DIR --one-event``: the frontier of the space
``choose_schedule`` searches (plus chunks and partial recomputation), timed as the engine
runs (one event per microbatch)."""
#: The frontier's configurations: (name, expert FFN, microbatches).
CONFIGS = [("main N=4", 2048, 4), ("main N=8", 2048, 8), ("comm~compute N=4", 4096, 4)]
BUDGETS = [0.86, 0.9, 1.0, 1.1, 1.2, 1.25, 1.5, None]
PRE, MLP = Slot.PRE_DISPATCH, Slot.MLP


def _row(ffn: int, n: int) -> dict[str, Any]:
    return next(r for r in ROUND9 if r["config"]["ffn"] == ffn and r["microbatches"] == n)


def _setup(ffn: int, n: int) -> tuple[Costs, ActivationModel]:
    """A row's profile and activation model as ``benchmarks/frontier.py`` fitted them."""
    row = _row(ffn, n)
    profile = load_profile(row["order_search"]["serial_slot_durations"])
    costs = costs_from_profile(profile, num_layers=4, comm_contention=FRONTIER["comm_contention"])
    act = FRONTIER["activations"]
    local = float(row["config"]["local_experts"])

    def params(f: int) -> float:
        return 4.0 * 4096 * 4096 + local * 3.0 * 4096 * f

    memory = ActivationModel.of_layer(
        hidden=4096,
        moe_ffn=ffn,
        top_k=8,
        static_units=float(act["static_units_main"]) * params(ffn) / params(2048),
        recompute_saves=act["recompute_saves"],
    )
    return costs, memory


@pytest.fixture(scope="module")
def quick() -> dict[str, SearchResult]:
    """Each configuration searched in the quick space."""
    out: dict[str, SearchResult] = {}
    for name, ffn, n in CONFIGS:
        costs, memory = _setup(ffn, n)
        out[name] = search_schedules(costs, n, memory, QUICK_CHOICE_SPACE)
    return out


@pytest.mark.parametrize("config", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_the_choice_is_the_fastest_schedule_within_each_budget(
    quick: dict[str, SearchResult], config: tuple[str, int, int]
) -> None:
    """Within every budget: the frontier's fastest point that fits, never faster than the
    committed frontier's (a larger space, chunks and partial recomputation too)."""
    found = quick[config[0]]
    committed = next(c for c in FRONTIER["configs"] if c["name"] == config[0])["frontier"]
    for budget in BUDGETS:
        choice = pick(found, budget)
        fits = [p for p in found.frontier if budget is None or p.memory <= budget + 1e-9]
        assert choice.chosen is min(fits, key=lambda p: p.step_ms), budget
        assert budget is None or choice.memory <= budget + 1e-9
        best = min(p["step_ms"] for p in committed if budget is None or p["memory"] <= budget)
        assert choice.step_ms >= best - 1e-6, budget
        if choice.runner_up is not None:
            assert choice.runner_up.step_ms >= choice.step_ms
            assert budget is None or choice.runner_up.memory <= budget + 1e-9
        if choice.over_budget is not None:
            assert choice.over_budget.step_ms < choice.step_ms
            assert budget is not None and choice.over_budget.memory > budget
    assert pick(found, None).bound == ("balanced" if "comm~" in config[0] else "communication")


def test_with_the_default_space_the_choice_is_the_committed_frontier_s_best() -> None:
    """Main configuration, 4 microbatches: within 1.25x memory and at any memory the
    choice is the committed frontier's best point (``benchmarks/frontier.py
    --one-event``)."""
    costs, memory = _setup(2048, 4)
    found = search_schedules(costs, 4, memory, CHOICE_SPACE)
    cfg = FRONTIER["configs"][0]
    within = pick(found, 1.25)
    assert within.step_ms == pytest.approx(cfg["targets"]["best_ms"], rel=1e-9)
    assert within.memory == pytest.approx(cfg["targets"]["best_memory"], rel=1e-9)
    assert within.kind == "searched"
    assert (within.options.delay_wgrad_compute, within.options.recompute) == (True, (PRE, MLP))
    assert within.runner_up_label == "fill/drain + recompute"
    assert "communication-bound" in within.reason
    assert "than fill/drain + recompute" in within.reason
    anywhere = pick(found, None)
    assert anywhere.step_ms == pytest.approx(min(p["step_ms"] for p in cfg["frontier"]))


def _scaled_comm(costs: Costs, scale: float) -> Costs:
    comm = (Slot.DISPATCH, Slot.COMBINE)
    return costs.replace(
        times={k: v * scale if k[1] in comm else v for k, v in costs.times.items()}
    )


def test_compute_bound_and_no_communication_say_so() -> None:
    costs, memory = _setup(2048, 4)
    little = choose_schedule(_scaled_comm(costs, 0.1), 4, memory, space=QUICK_CHOICE_SPACE)
    assert little.bound == "compute"
    assert little.reason.startswith("compute-bound (233.8 ms of compute, 43.4 ms of comm")
    assert little.step_ms < little.serial.step_ms
    assert little.step_ms >= little.serial.comp_ms - 1e-9  # never below the compute
    assert little.summary().startswith(f"choice within any peak memory: {little.label}\n")
    none = choose_schedule(_scaled_comm(costs, 0.0), 4, memory, space=QUICK_CHOICE_SPACE)
    assert (none.kind, none.bound, none.over_budget) == ("serial", "no communication", None)
    assert "nothing beats serial at any memory" in none.reason
    assert none.call == "combined_1f1b(model, microbatches, overlap=False)"


def test_a_budget_below_every_overlapping_schedule_leaves_serial() -> None:
    costs, memory = _setup(2048, 4)
    space = SearchSpace(chunks=(1,), recompute=(Recompute(),), in_flight=(2, 3), rules=("oldest",))
    choice = choose_schedule(costs, 4, memory, budget=1.0, space=space)
    assert choice.kind == "serial"
    assert choice.over_budget is not None and choice.over_budget.memory > 1.0
    assert "the budget leaves serial the fastest; a budget of 1.025x would allow combined 1F1B" in (
        choice.reason
    )
    low = choose_schedule(costs, 4, memory, budget=0.9, space=space)
    assert low.kind == "serial_recompute"
    with pytest.raises(ConfigError, match=r"budget: expected at least .* 0\.850x .*received 0\.5"):
        choose_schedule(costs, 4, memory, budget=0.5, space=space)


def test_refused_inputs_name_what_was_expected() -> None:
    costs, memory = _setup(2048, 4)
    with pytest.raises(ConfigError, match=r"choose_schedule: microbatches must be an int >= 1"):
        choose_schedule(costs, 0, memory)
    with pytest.raises(ConfigError, match=r"choose_schedule: budget must be"):
        choose_schedule(costs, 4, memory, budget=0.0)
    with pytest.raises(ConfigError, match=r"choose_schedule: costs must be a Costs"):
        choose_schedule("costs", 4, memory)  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    with pytest.raises(ConfigError, match=r"space\.chunks: expected \(1,\), received \(1, 2\)"):
        choose_schedule(costs, 4, memory, space=SearchSpace(chunks=(1, 2)))
    partial = SearchSpace(chunks=(1,), recompute=(Recompute((MLP,), (0,)),))
    with pytest.raises(ConfigError, match=r"space\.recompute: expected whole slots"):
        choose_schedule(costs, 4, memory, space=partial)


@pytest.mark.parametrize("budget", [None, 1.2, 1.1])
def test_the_chosen_schedule_runs_bit_identical(budget: float | None) -> None:
    """Two MoE layers, three microbatches: the choice (a searched order with recomputation,
    one with delayed weight gradients too, today's overlapped) on the toy model matches
    plain backward() bit for bit, run as the choice says."""
    costs, memory = _setup(2048, 4)
    two = costs.replace(
        moe=(True, True), times={k: v for k, v in costs.times.items() if k[0] in (0, 1, None)}
    )
    choice = choose_schedule(two, 3, memory, budget=budget, space=QUICK_CHOICE_SPACE)
    assert choice.kind == ("overlapped" if budget == 1.1 else "searched")
    assert NodeSchedule.parse(str(choice.schedule)) == choice.schedule
    delay = bool(choice.options.delay_wgrad_compute)
    assert delay == (budget == 1.2)
    run_both(
        "mm", choice.schedule, delay=delay, recompute=tuple(map(Slot, choice.options.recompute))
    )


def test_the_command_line_prints_the_choice_and_writes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(_row(2048, 4)["order_search"]["serial_slot_durations"]))
    args = ["plan", "--choose", "--profile", str(profile), "--layers", "4"]
    args += ["--microbatches", "4", "--contention", "0.055", "--quick"]
    sizes = ["--hidden", "4096", "--moe-ffn", "2048", "--top-k", "8"]
    extra = ["--memory-budget", "1.25", "--static-share", "0.6", "--out", str(tmp_path)]
    assert main([*args, *sizes, *extra]) == 0
    out = capsys.readouterr().out
    assert "choice within 1.25x the serial step's peak memory: searched order" in out
    assert "runner-up: fill/drain + recompute" in out
    data = json.loads((tmp_path / "choice.json").read_text())
    assert data["kind"] == "searched" and data["memory"] <= 1.25
    assert len(NodeSchedule.parse(data["schedule"]).steps) == 208
    with pytest.raises(SystemExit):
        main([*args, "--memory-budget", "1.25"])
    assert "--profile needs --hidden --moe-ffn --top-k" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*args, *sizes, "--pp", "2"])
    assert "expected one pipeline rank (--pp 1 --vpp 1), received --pp 2" in (
        capsys.readouterr().err
    )


def test_the_command_line_chooses_with_contention_per_kind(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--contention-by-kind`` and ``--compute-contention-by-kind`` give the choice of
    ``choose_schedule`` with those coefficients in ``Costs`` (another than without them),
    printed and recorded in choice.json."""
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(_row(2048, 4)["order_search"]["serial_slot_durations"]))
    args = ["plan", "--choose", "--profile", str(profile), "--layers", "4", "--quick"]
    args += ["--microbatches", "2", "--hidden", "4096", "--moe-ffn", "2048", "--top-k", "8"]
    args += ["--contention-by-kind", "combine.B=0.739", "dispatch.F=0.029"]
    args += ["--compute-contention-by-kind", "pre_dispatch.F=0.518", "--out", str(tmp_path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    comm = {(Slot.COMBINE, Direction.BACKWARD): 0.739, (Slot.DISPATCH, Direction.FORWARD): 0.029}
    comp = {(Slot.PRE_DISPATCH, Direction.FORWARD): 0.518}
    plain = costs_from_profile(
        load_profile(_row(2048, 4)["order_search"]["serial_slot_durations"]), num_layers=4
    )
    costs = plain.replace(contention_by_kind=comm, compute_contention_by_kind=comp)
    memory = ActivationModel.of_layer(hidden=4096, moe_ffn=2048, top_k=8)
    want = choose_schedule(costs, 2, memory, space=QUICK_CHOICE_SPACE)
    without = choose_schedule(plain, 2, memory, space=QUICK_CHOICE_SPACE)
    assert (want.schedule, want.step_ms) != (without.schedule, without.step_ms)
    assert want.summary() in out
    assert "contention per kind (a kind not named: 0): combine.B=0.739 dispatch.F=0.029 " in out
    assert "pre_dispatch.F=0.518 (compute)" in out
    data = json.loads((tmp_path / "choice.json").read_text())
    assert data["schedule"] == str(want.schedule) and data["step_ms"] == want.step_ms
    assert data["memory"] == want.memory
    assert data["comm_contention"] == 0.0
    assert data["contention_by_kind"] == {"combine.B": 0.739, "dispatch.F": 0.029}
    assert data["compute_contention_by_kind"] == {"pre_dispatch.F": 0.518}
