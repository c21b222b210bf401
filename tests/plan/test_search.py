"""The schedule search: today's schedules as members, exact orders only, a small case solved."""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from moe_overlap.errors import ConfigError
from moe_overlap.plan import (
    ActivationModel,
    Costs,
    Layout,
    Recompute,
    ScheduleGraph,
    SearchSpace,
    SearchStep,
    StepTimes,
    check_exact,
    choose_schedule,
    fit_activations,
    node_schedule,
    plan,
    replay_order,
    search_schedules,
    today_orders,
)
from moe_overlap.plan._list_schedule import (
    RULES,
    ScheduleIds,
    improve,
    list_schedule,
    replay_ids,
    schedule_ids,
)
from moe_overlap.steps import Direction, Slot, StreamKind
from tests.plan import main_profile
from tests.plan.main_profile import MEMORY

F, B, W = Direction.FORWARD, Direction.BACKWARD, Direction.WGRAD
PRE, DISPATCH, MLP, COMBINE = Slot.PRE_DISPATCH, Slot.DISPATCH, Slot.MLP, Slot.COMBINE


@pytest.fixture(scope="module")
def main_costs() -> Costs:
    return main_profile.main_costs()


def _times(costs: Costs, graph: ScheduleGraph) -> StepTimes:
    return StepTimes(
        times=costs.times,
        chunks=graph.chunks,
        chunk_overhead_ms=0.2,
        comm_contention=costs.comm_contention,
        delay_wgrad=graph.delay_wgrad,
    )


@pytest.mark.parametrize("n", [1, 2, 4])
def test_todays_schedules_are_members_with_the_planners_step_times(
    main_costs: Costs, n: int
) -> None:
    graph = ScheduleGraph(microbatches=n, moe=main_costs.moe)
    times = _times(main_costs, graph)
    names = {"serial": "serial", "overlapped": "combined_1f1b", "fill_drain": "fill_drain"}
    for name, order in today_orders(graph).items():
        check_exact(order, graph)
        replayed = replay_order(order, graph, times, MEMORY).step_ms
        planned = plan(main_costs, Layout(microbatches=n), names[name]).step_ms
        assert replayed == pytest.approx(planned, rel=1e-12), name


def test_the_search_returns_todays_points_and_only_exact_orders(main_costs: Costs) -> None:
    costs = main_costs.replace(
        moe=(True, True), times={k: v for k, v in main_costs.times.items() if k[0] in (0, 1, None)}
    )
    space = SearchSpace(
        chunks=(1, 2),
        recompute=(Recompute(), Recompute((MLP,), (0,))),
        in_flight=(1, 2, 3),
        memory_caps=(None, 1.2),
        rules=("oldest", "critical"),
        slack_ms=(0.0, 1.0),
    )
    res = search_schedules(costs, 3, MEMORY, space)
    for name in ("serial", "overlapped", "fill_drain"):
        schedule = {"overlapped": "combined_1f1b"}.get(name, name)
        want = plan(costs, Layout(microbatches=3), schedule).step_ms
        assert res.today[name].step_ms == pytest.approx(want, rel=1e-12)
    assert res.today["serial"].memory == 1.0
    assert res.today["fill_drain"].memory > res.today["overlapped"].memory > 1.0
    assert res.frontier and res.tried
    for point in res.frontier:
        check_exact(point.order, point.graph)
        times = _times(costs, point.graph)
        assert replay_order(point.order, point.graph, times, MEMORY).step_ms == pytest.approx(
            point.step_ms
        )
    # the frontier: faster as memory grows, and nothing searched beats it on both
    pairs = [(p.memory, p.step_ms) for p in res.frontier]
    assert all(a[1] > b[1] and a[0] <= b[0] for a, b in itertools.pairwise(pairs))
    best = min(p.step_ms for p in res.frontier)
    assert best < res.today["fill_drain"].step_ms
    # the sweep's own timings may miss a contention, never more
    assert min(ms for ms, _ in res.tried) >= best / (1 + costs.comm_contention)


def _graph(**kw: object) -> ScheduleGraph:
    return ScheduleGraph(microbatches=2, moe=(True, True)).replace(**kw)


def _swap(order: list[SearchStep | None], a: SearchStep, b: SearchStep) -> list[SearchStep | None]:
    i, j = order.index(a), order.index(b)
    out = list(order)
    out[i], out[j] = out[j], out[i]
    return out


def test_check_exact_refuses_each_broken_rule() -> None:
    graph = _graph(delay_wgrad=True)
    order: list[SearchStep | None] = list(graph.steps())  # microbatch 0, then 1: serial
    check_exact(order, graph)
    f0 = SearchStep(0, 1, MLP, F, StreamKind.COMP)
    f1 = f0._replace(microbatch=1)
    # microbatch 1's forward of layer 1's mlp before microbatch 0's
    m1 = [s for s in order if s is not None and s.microbatch == 1]
    m0 = [s for s in order if s is not None and s.microbatch == 0]
    a, c = m0.index(f0), m1.index(f1) + 1
    early = m0[:a] + m1[:c] + m0[a:] + m1[c:]
    with pytest.raises(ConfigError, match=r"L1\.mlp\.F0@comp.*forwards in microbatch order"):
        check_exact(early, graph)
    # microbatch 0's delayed weight gradient after microbatch 1's backward of that slot
    w0 = SearchStep(0, 0, MLP, W, StreamKind.COMP)
    late_w = [s for s in order if s != w0]
    late_w.insert(late_w.index(SearchStep(1, 0, MLP, B, StreamKind.COMP)) + 1, w0)
    with pytest.raises(ConfigError, match=r"L0\.mlp\.W0.*before the next microbatch's backward"):
        check_exact(late_w, graph)
    # a microbatch's own order
    d = SearchStep(0, 0, DISPATCH, F, StreamKind.COMM)
    pre = SearchStep(0, 0, PRE, F, StreamKind.COMP)
    with pytest.raises(ConfigError, match=r"dispatch\.F0@comm.*its own steps in order"):
        check_exact(_swap(order, d, pre), graph)
    with pytest.raises(ConfigError, match="twice"):
        check_exact([*order, order[0]], graph)
    with pytest.raises(ConfigError, match="missing"):
        check_exact(order[:-1], graph)
    with pytest.raises(ConfigError, match="not a step of this graph"):
        check_exact([*order, f0._replace(layer=7)], graph)


def test_recompute_and_chunks_change_the_steps_not_the_rules() -> None:
    graph = _graph(chunks=2, recompute=frozenset({(0, 1, MLP), (1, 0, PRE)}))
    steps = list(graph.steps())
    assert SearchStep(0, 1, MLP, F, StreamKind.COMP, None, True) in steps
    assert SearchStep(1, 0, DISPATCH, B, StreamKind.COMM, 1) in steps
    check_exact(steps, graph)
    rec = SearchStep(0, 1, MLP, F, StreamKind.COMP, None, True)
    first_b = SearchStep(0, 1, MLP, B, StreamKind.COMP, 0)
    with pytest.raises(ConfigError, match=r"L1\.mlp\[0\]\.B0.*its own steps in order"):
        check_exact(_swap(list(steps), rec, first_b), graph)
    with pytest.raises(ConfigError, match="only the pre-dispatch and the mlp can be recomputed"):
        _graph(recompute=frozenset({(0, 0, DISPATCH)}))


def _all_orders(g: ScheduleIds) -> Iterator[list[int]]:
    """Every issue order the exactness rules allow (brute force)."""
    waiting = list(g.n_issue)
    placed: list[int] = []

    def walk() -> Iterator[list[int]]:
        if len(placed) == len(g.steps):
            yield list(placed)
            return
        for i in range(len(g.steps)):
            if not waiting[i] and i not in placed:
                placed.append(i)
                for j in g.issue_succ[i]:
                    waiting[j] -= 1
                yield from walk()
                for j in g.issue_succ[i]:
                    waiting[j] += 1
                placed.pop()

    yield from walk()


SMALL = [
    {PRE: (2.6, 7.6), DISPATCH: (7.3, 1.2), MLP: (1.2, 4.8), COMBINE: (7.6, 3.7)},
    {PRE: (1.5, 4.1), DISPATCH: (6.0, 5.9), MLP: (3.1, 5.8), COMBINE: (7.3, 6.6)},
    {PRE: (3.0, 6.0), DISPATCH: (2.0, 2.0), MLP: (6.0, 12.0), COMBINE: (2.5, 2.0)},
]


@pytest.mark.parametrize("ms", SMALL)
def test_a_small_case_brute_force_and_the_heuristic_agree(
    ms: dict[Slot, tuple[float, float]],
) -> None:
    """Two microbatches of one MoE layer: every exact order replayed against the list
    scheduler's rules followed by the local search (the first case needs the second
    microbatch staggered)."""
    graph = ScheduleGraph(microbatches=2, moe=(True,), pre_post=False)
    times = StepTimes(
        times={(0, s, d): v[k] for s, v in ms.items() for k, d in enumerate((F, B))},
        comm_contention=0.05,
    )
    g = ScheduleIds(graph, times, MEMORY)
    factor = 1.05
    brute = min(replay_ids(g, ids, factor)[0] for ids in _all_orders(g))
    found = []
    for rule, flight, slack, stagger in itertools.product(RULES, (1, 2), (0.0, 2.0), (0, 3)):
        ids, _, _ = schedule_ids(g, times, rule, flight, slack, None, None, stagger)
        found.append(improve(g, ids, factor, max_units=1e9, window=16, passes=16)[1])
    assert min(found) == pytest.approx(brute)
    assert brute < replay_ids(g, list(range(len(g.steps))), factor)[0]  # not just serial


def test_the_list_scheduler_reports_what_the_replay_gives(main_costs: Costs) -> None:
    graph = ScheduleGraph(
        microbatches=3,
        moe=main_costs.moe,
        chunks=2,
        delay_wgrad=True,
        recompute=Recompute((PRE, MLP), (0,)).triples(3, 4),
        early_recompute=True,
    )
    times = _times(main_costs, graph)
    for rule in RULES:
        order, ms, units = list_schedule(graph, times, MEMORY, rule=rule, in_flight=3)
        check_exact(order, graph)
        r = replay_order(order, graph, times, MEMORY)
        assert (r.step_ms, r.peak_units) == pytest.approx((ms, units))


def test_fit_activations_recovers_a_known_model(main_costs: Costs) -> None:
    truth = ActivationModel.of_layer(
        hidden=4096, moe_ffn=2048, top_k=8, static_units=120.0, recompute_saves=0.4
    )
    graph = ScheduleGraph(microbatches=4, moe=main_costs.moe)
    times = StepTimes(times=main_costs.times, comm_contention=main_costs.comm_contention)
    rc = graph.replace(recompute=Recompute((PRE, MLP)).triples(4, 4))
    unit = 0.05  # GB per unit

    def gb(order_name: str, g: ScheduleGraph) -> float:
        peak = replay_order(today_orders(g)[order_name], g, times, truth).peak_units
        return unit * (truth.static_units + peak)

    start = ActivationModel.of_layer(hidden=4096, moe_ffn=2048, top_k=8)
    fitted, got_unit = fit_activations(
        start,
        main_costs,
        4,
        serial=gb("serial", graph),
        fill_drain=gb("fill_drain", graph),
        serial_recompute=gb("serial", rc),
    )
    assert got_unit == pytest.approx(unit)
    assert fitted.static_units == pytest.approx(truth.static_units)
    assert fitted.recompute_saves == pytest.approx(truth.recompute_saves, abs=1e-6)
    with pytest.raises(ConfigError, match="fill/drain peak above the serial one"):
        fit_activations(start, main_costs, 4, serial=10.0, fill_drain=9.0)


def test_refused_inputs_name_what_was_expected(main_costs: Costs) -> None:
    with pytest.raises(ConfigError, match=r"ScheduleGraph\.chunks: expected an int >= 1"):
        ScheduleGraph(microbatches=2, moe=(True,), chunks=0)
    with pytest.raises(ConfigError, match=r"microbatch in 0\.\.1.*received \(2, 0, "):
        ScheduleGraph(microbatches=2, moe=(True,), recompute=frozenset({(2, 0, MLP)}))
    with pytest.raises(ConfigError, match=r"SearchSpace\.rules: expected a collection"):
        SearchSpace(rules=("fastest",))
    with pytest.raises(ConfigError, match=r"SearchSpace\.memory_caps"):
        SearchSpace(memory_caps=(0.0,))
    with pytest.raises(ConfigError, match=r"ActivationModel\.wgrad_keeps: expected a share"):
        ActivationModel(units={MLP: 1.0}, wgrad_keeps=1.5)
    with pytest.raises(ConfigError, match=r"StepTimes\.wgrad_share: expected Slot keys"):
        StepTimes(times={}, wgrad_share={MLP: 2.0})
    with pytest.raises(ConfigError, match=r"search_schedules: microbatches must be an int >= 1"):
        search_schedules(main_costs, 0, MEMORY)
    graph = ScheduleGraph(microbatches=2, moe=(True,))
    times = StepTimes(times=main_costs.times)
    with pytest.raises(ConfigError, match="check_exact: step 0"):
        replay_order(list(reversed(list(graph.steps()))), graph, times, MEMORY)


def test_step_times_refuse_nan_and_malformed_times() -> None:
    """A NaN node time replayed every order as 0 ms (max() over NaN): refused."""
    for times, message in [
        ({(0, MLP, F): float("nan")}, "StepTimes.times: the milliseconds of"),
        ({(0, MLP, F): -1.0}, "StepTimes.times: the milliseconds of"),
        ({(0, MLP, F): "1"}, "StepTimes.times: the milliseconds of"),
        ({"x": 1.0}, "StepTimes.times: expected keys (layer >= 0 or None, Slot, Direction)"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            StepTimes(times=_bad(times))


@pytest.mark.parametrize(
    "key",
    [
        (1, MLP, Direction.RECOMPUTE),
        (1, Slot.PRE_FORWARD, Direction.HOOK),
        (1, Slot.MTP_POST, F),
        (1, Slot.PRE_PROCESS, F),
        (None, MLP, F),
    ],
)
def test_step_times_refuse_times_no_replay_reads(key: tuple[int | None, Slot, Direction]) -> None:
    """Each was taken and never read (its milliseconds dropped without a word), as
    ``Costs.times`` refuses them; a dispatch or combine of a layer the graph makes dense,
    by the replay that knows it."""
    times: dict[tuple[int | None, Slot, Direction], float] = {(0, MLP, F): 1.0, (1, MLP, F): 1.0}
    with pytest.raises(ConfigError, match=r"StepTimes.times: expected only keys a replay") as e:
        StepTimes(times={**times, key: 1.0})
    assert repr(key) in str(e.value) and "drop them" in str(e.value)
    graph = ScheduleGraph(microbatches=1, moe=(False, True))
    order = today_orders(graph)["serial"]
    for slot in (DISPATCH, COMBINE):
        dense = StepTimes(times={**times, (0, slot, B): 1.0, (1, slot, B): 1.0})
        with pytest.raises(ConfigError, match=r"replay_order: times\.times: expected only") as e:
            replay_order(order, graph, dense, MEMORY)
        assert f"received 1 other key(s): (0, <Slot.{slot.name}" in str(e.value)
        assert "or set graph.moe for the layers that dispatch" in str(e.value)
    moe = StepTimes(times={**times, (1, DISPATCH, B): 1.0, (1, COMBINE, W): 1.0})
    assert replay_order(order, graph, moe, MEMORY).step_ms == 4.0


def test_replay_order_refuses_times_of_layers_past_the_graph() -> None:
    """A layer the graph does not have was taken and its milliseconds dropped (the step
    timed as if it were not there), as ``Costs.times`` refuses it."""
    graph = ScheduleGraph(microbatches=1, moe=(True,))
    order = today_orders(graph)["serial"]
    times: dict[tuple[int | None, Slot, Direction], float] = {(0, MLP, F): 1.0, (0, MLP, B): 2.0}
    assert replay_order(order, graph, StepTimes(times=times), MEMORY).step_ms == 3.0
    extra = StepTimes(times={**times, (1, MLP, F): 5.0, (3, DISPATCH, B): 1.0})
    with pytest.raises(
        ConfigError, match=r"replay_order: times\.times: expected layers 0\.\.0"
    ) as e:
        replay_order(order, graph, extra, MEMORY)
    assert "(graph.moe has 1 layers), received 2 key(s) of other layers: (1, <Slot.MLP" in str(
        e.value
    )
    assert "give graph.moe for every layer the times cover" in str(e.value)


def test_today_orders_refuses_a_graph_today_s_schedules_do_not_run() -> None:
    """A chunked graph, or one with delayed weight gradients or early recomputation, gave
    orders without those steps (not orders of the graph); a graph of another type was a
    bare AttributeError."""
    graph = ScheduleGraph(microbatches=2, moe=(True,))
    for other in (
        graph.replace(chunks=2),
        graph.replace(delay_wgrad=True),
        graph.replace(recompute=frozenset({(0, 0, MLP)}), early_recompute=True),
    ):
        with pytest.raises(ConfigError, match=r"^today_orders: graph: expected a graph of today"):
            today_orders(other)
    with pytest.raises(ConfigError, match=r"^today_orders: graph must be a ScheduleGraph"):
        today_orders(_bad(None))
    assert set(today_orders(graph.replace(one_event=True))) == {
        "serial",
        "overlapped",
        "fill_drain",
    }


def test_a_microbatch_outside_the_graph_has_no_steps() -> None:
    """Its steps were made up (microbatch 5 or -1 of a 2-microbatch graph)."""
    graph = ScheduleGraph(microbatches=2, moe=(True,))
    assert {s.microbatch for s, _ in graph.microbatch_steps(1)} == {1}
    for mb in (2, -1, True):
        with pytest.raises(
            ConfigError,
            match=r"^ScheduleGraph\.microbatch_steps: mb must be an int in \[0, microbatches-1=1\]",
        ):
            graph.microbatch_steps(mb)


def test_keys_no_step_reads_are_refused() -> None:
    """A share of a slot without weight-gradient steps and the units of a slot no step runs
    were taken and dropped (the replay as if they were not given)."""
    times: dict[tuple[int | None, Slot, Direction], float] = {
        (0, MLP, F): 1.0,
        (0, MLP, B): 2.0,
        (0, COMBINE, B): 2.0,
    }
    StepTimes(times=times, wgrad_share={MLP: 0.5, PRE: 0.0})
    with pytest.raises(ConfigError, match=r"^StepTimes\.wgrad_share: expected keys Slot\.PRE_DISP"):
        StepTimes(times=times, wgrad_share={MLP: 0.5, COMBINE: 0.5})
    ActivationModel(units={MLP: 1.0, Slot.PRE_PROCESS: 1.0, Slot.POST_PROCESS: 2.0})
    for slot in (Slot.MTP_POST, Slot.PRE_FORWARD):
        with pytest.raises(ConfigError, match=r"^ActivationModel\.units: expected keys among") as e:
            ActivationModel(units={MLP: 1.0, slot: 4.0})
        assert f"post_process), received {slot!r}; drop it" in str(e.value)


def test_search_arguments_are_checked_before_use() -> None:
    """Each was a bare AttributeError, TypeError, ValueError or ZeroDivisionError."""
    graph = ScheduleGraph(microbatches=2, moe=(True,))
    order = today_orders(graph)["serial"]
    times = StepTimes(times={(0, MLP, F): 1.0})
    costs = Costs(times={(0, MLP, F): 1.0, (0, MLP, B): 2.0}, moe=(True,))
    cases: list[tuple[Callable[[], object], str]] = [
        (lambda: replay_order(order, graph, _bad(None), MEMORY), "replay_order: times must be"),
        (lambda: replay_order(order, graph, times, _bad(None)), "replay_order: memory must be"),
        (lambda: check_exact(_bad(None), graph), "check_exact: order must be a sequence"),
        (lambda: check_exact(_bad([[1]]), graph), "received it not a step of this graph (a list"),
        (lambda: node_schedule(_bad(None)), "node_schedule: order must be a sequence"),
        (
            lambda: ActivationModel.of_layer(hidden=0, moe_ffn=8, top_k=2),
            "ActivationModel.of_layer: hidden must be an int >= 1",
        ),
        (
            lambda: ActivationModel.of_layer(hidden=8, moe_ffn=8, top_k=True),
            "ActivationModel.of_layer: top_k must be an int >= 1",
        ),
        (
            lambda: SearchSpace(wgrad_share=_bad(((MLP, "0.5"),))),
            "SearchSpace.wgrad_share: expected",
        ),
        (
            lambda: SearchSpace(wgrad_share=_bad(((MLP, 0.5, 1),))),
            "SearchSpace.wgrad_share: expected",
        ),
        (
            lambda: SearchSpace(wgrad_share=((MLP, 0.1), (MLP, 0.9))),
            "SearchSpace.wgrad_share: expected each slot once",
        ),
        (
            lambda: SearchSpace(recompute=(_unchecked(MLP),)),
            "SearchSpace.recompute: item 0 must",
        ),
        (
            lambda: SearchSpace(recompute=(_unchecked((MLP,), 0),)),
            "SearchSpace.recompute: item 0 must",
        ),
        (
            lambda: search_schedules(costs, 2, MEMORY, today_recompute=_bad("mlp")),
            "search_schedules: today_recompute must be a Recompute",
        ),
        (
            lambda: search_schedules(costs, 2, MEMORY, progress=_bad(3)),
            "search_schedules: progress must be",
        ),
        (
            lambda: fit_activations(MEMORY, costs, 4, serial=_bad("1"), fill_drain=2.0),
            "fit_activations: serial must be a measured peak",
        ),
        (
            lambda: fit_activations(MEMORY, costs, 4, serial=1.0, fill_drain=float("inf")),
            "fit_activations: fill_drain must be a measured peak",
        ),
        (
            lambda: fit_activations(
                MEMORY,
                costs,
                4,
                serial=1.0,
                fill_drain=2.0,
                serial_recompute=0.9,
                recompute=_bad("mlp"),
            ),
            "fit_activations: recompute must be a Recompute",
        ),
    ]
    for call, message in cases:
        with pytest.raises(ConfigError, match=re.escape(message)):
            call()
    assert str(Recompute(_bad(("mlp",)))) == "mlp"


def test_recompute_is_checked_at_construction() -> None:
    """A Recompute of wrong fields was made, printed and compared, and refused only where
    a search or a fit used it; each use site keeps its own refusal."""
    expected = (
        "Recompute must be a Recompute: a tuple of Slot s (Slot.PRE_DISPATCH, Slot.MLP), "
        "then layers and microbatches each None (all) or a tuple of ints >= 0"
    )
    bad: list[Callable[[], object]] = [
        lambda: Recompute(_bad(MLP)),
        lambda: Recompute(_bad(("attention",))),
        lambda: Recompute((DISPATCH,)),
        lambda: Recompute((MLP,), _bad(0)),
        lambda: Recompute((MLP,), _bad((True,))),
        lambda: Recompute((MLP,), None, _bad((-1,))),
    ]
    for call in bad:
        with pytest.raises(ConfigError, match=re.escape(expected)):
            call()
    made = Recompute((PRE, MLP), (0, 1), (2,))
    assert tuple(made) == ((PRE, MLP), (0, 1), (2,)) and str(made) == "pre_dispatch+mlp@L0,1@mb2"
    costs = Costs(times={(0, MLP, F): 1.0, (0, MLP, B): 2.0}, moe=(True,))
    with pytest.raises(ConfigError, match=re.escape("fit_activations: recompute must be a")):
        fit_activations(
            MEMORY,
            costs,
            4,
            serial=1.0,
            fill_drain=2.0,
            serial_recompute=0.9,
            recompute=_unchecked((DISPATCH,)),
        )
    with pytest.raises(ConfigError, match=re.escape("search_schedules: today_recompute must")):
        search_schedules(costs, 2, MEMORY, today_recompute=_unchecked((MLP,), "0"))


def test_search_refuses_more_microbatches_than_the_planner_takes() -> None:
    """10**9 microbatches ran until killed."""
    costs = Costs(times={(0, MLP, F): 1.0, (0, MLP, B): 2.0}, moe=(True,))
    cases: list[tuple[Callable[[], object], str]] = [
        (
            lambda: ScheduleGraph(microbatches=10**9, moe=(True,)),
            "ScheduleGraph.microbatches: expected at most 65536 microbatches",
        ),
        (
            lambda: search_schedules(costs, 65537, MEMORY),
            "search_schedules: microbatches must be at most 65536 microbatches",
        ),
        (
            lambda: choose_schedule(costs, 10**9, MEMORY),
            "choose_schedule: microbatches must be at most 65536 microbatches",
        ),
        (
            lambda: fit_activations(MEMORY, costs, 10**9, serial=1.0, fill_drain=2.0),
            "fit_activations: microbatches must be at most 65536 microbatches",
        ),
    ]
    for call, message in cases:
        with pytest.raises(ConfigError, match=re.escape(message)):
            call()
    assert ScheduleGraph(microbatches=65536, moe=(True,)).microbatches == 65536


def _unchecked(*fields: object) -> Any:
    """A Recompute of ``fields`` made without its construction check (``tuple.__new__``):
    the use sites refuse it too."""
    return tuple.__new__(Recompute, (*fields, None, None, None)[:3])


def _bad(value: object) -> Any:
    """``value`` typed ``Any``: a misuse the type checkers would flag, made at run time."""
    return value
