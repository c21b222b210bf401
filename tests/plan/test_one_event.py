"""``ScheduleGraph.one_event``: the planner's replay with each microbatch's steps in issue
order, as the engine's one event per microbatch runs them."""

from __future__ import annotations

import pytest

from moe_overlap.errors import ConfigError
from moe_overlap.plan import (
    Costs,
    Recompute,
    ScheduleGraph,
    SearchSpace,
    SearchStep,
    StepTimes,
    check_exact,
    replay_order,
    search_schedules,
    today_orders,
)
from moe_overlap.plan._list_schedule import RULES, ScheduleIds, list_schedule, replay_ids
from moe_overlap.steps import Direction, Slot, StreamKind
from tests.plan import main_profile
from tests.plan.main_profile import MEMORY

F, B, W = Direction.FORWARD, Direction.BACKWARD, Direction.WGRAD
PRE, DISPATCH, MLP, COMBINE = Slot.PRE_DISPATCH, Slot.DISPATCH, Slot.MLP, Slot.COMBINE
COMP, COMM = StreamKind.COMP, StreamKind.COMM


@pytest.fixture(scope="module")
def main_costs() -> Costs:
    return main_profile.main_costs()


def _times(costs: Costs, graph: ScheduleGraph) -> StepTimes:
    return StepTimes(
        times=costs.times,
        comm_contention=costs.comm_contention,
        delay_wgrad=graph.delay_wgrad,
    )


def test_a_recompute_waits_for_its_microbatch_s_event_and_delays_nothing() -> None:
    """One microbatch, one MoE layer, its mlp recomputed early. With ``one_event`` a
    recompute waits for the microbatch's forward or backward step issued before it (the
    engine's event) but records nothing: issued before the combine backward it runs beside
    it, as without ``one_event``; issued after it, it waits for it."""
    graph = ScheduleGraph(
        microbatches=1,
        moe=(True,),
        pre_post=False,
        recompute=frozenset({(0, 0, MLP)}),
        early_recompute=True,
    )
    times = StepTimes(
        times={(0, s, d): 1.0 for s in (PRE, DISPATCH, MLP, COMBINE) for d in (F, B)},
    )
    forward = [SearchStep(0, 0, s, F, st) for s, st in ((PRE, COMP), (DISPATCH, COMM))]
    forward += [SearchStep(0, 0, MLP, F, COMP), SearchStep(0, 0, COMBINE, F, COMM)]
    recompute = SearchStep(0, 0, MLP, F, COMP, recompute=True)
    combine = SearchStep(0, 0, COMBINE, B, COMM)
    backward = [SearchStep(0, 0, s, B, st) for s, st in ((MLP, COMP), (DISPATCH, COMM))]
    first = [*forward, recompute, combine, *backward, SearchStep(0, 0, PRE, B, COMP)]
    after = [*forward, combine, recompute, *backward, SearchStep(0, 0, PRE, B, COMP)]
    for order in (first, after):
        check_exact(order, graph)

    def span(order: list[SearchStep], one_event: bool, step: SearchStep) -> tuple[float, float]:
        g = graph.replace(one_event=one_event)
        spans = replay_order(order, g, times, MEMORY).spans
        return next((lo, hi) for s, lo, hi in spans if s == step)

    for one_event in (False, True):
        assert span(first, one_event, recompute) == span(first, one_event, combine) == (4, 5)
    assert span(after, False, recompute) == span(after, False, combine) == (4.0, 5.0)
    assert span(after, True, combine) == (4.0, 5.0)
    assert span(after, True, recompute) == (5.0, 6.0)
    ms = {
        (name, one): replay_order(order, graph.replace(one_event=one), times, MEMORY).step_ms
        for name, order in (("first", first), ("after", after))
        for one in (False, True)
    }
    assert ms == {
        ("first", False): 8.0,
        ("first", True): 8.0,
        ("after", False): 8.0,
        ("after", True): 9.0,
    }


@pytest.mark.parametrize("n", [1, 2, 4])
def test_orders_without_early_recompute_replay_the_same(main_costs: Costs, n: int) -> None:
    """Today's orders (plain, and with pre-dispatch and mlp recomputed before their
    backward): each microbatch's steps already wait for one another in issue order."""
    base = ScheduleGraph(microbatches=n, moe=main_costs.moe)
    rc = base.replace(recompute=Recompute((PRE, MLP)).triples(n, 4))
    for graph in (base, rc):
        times = _times(main_costs, graph)
        for name, order in today_orders(graph).items():
            plain = replay_order(order, graph, times, MEMORY)
            chained = replay_order(order, graph.replace(one_event=True), times, MEMORY)
            assert chained.step_ms == pytest.approx(plain.step_ms, rel=1e-12), name
            assert chained.spans == plain.spans, name


def test_the_list_scheduler_reports_what_the_replay_gives(main_costs: Costs) -> None:
    """With ``one_event`` the list scheduler and its integer replay time an order as
    :func:`replay_order` does (an early recompute is where they differ from without)."""
    graph = ScheduleGraph(
        microbatches=3,
        moe=main_costs.moe,
        delay_wgrad=True,
        recompute=Recompute((PRE, MLP)).triples(3, 4),
        early_recompute=True,
        one_event=True,
    )
    times = _times(main_costs, graph)
    g = ScheduleIds(graph, times, MEMORY)
    index = {s: i for i, s in enumerate(g.steps)}
    slower = 0
    for rule in RULES:
        order, ms, units = list_schedule(graph, times, MEMORY, rule=rule, in_flight=3)
        check_exact(order, graph)
        r = replay_order(order, graph, times, MEMORY)
        assert (r.step_ms, r.peak_units) == pytest.approx((ms, units))
        ids = [index[s] for s in order]
        assert replay_ids(g, ids, 1.0 + times.comm_contention) == pytest.approx((ms, units))
        free = replay_order(order, graph.replace(one_event=False), times, MEMORY).step_ms
        assert free <= ms + 1e-9  # waiting for more never makes a step shorter
        slower += free < ms - 1e-9
    assert slower  # some rule issues a recompute ahead of its combine backward


def test_the_search_times_its_orders_with_one_event(main_costs: Costs) -> None:
    costs = main_costs.replace(
        moe=(True, True), times={k: v for k, v in main_costs.times.items() if k[0] in (0, 1, None)}
    )
    space = SearchSpace(
        chunks=(1,),
        delay_wgrad=(True,),
        recompute=(Recompute((PRE, MLP)),),
        early_recompute=(True,),
        in_flight=(2,),
        stagger=(0,),
        memory_caps=(None,),
        rules=("oldest", "backward"),
        slack_ms=(0.0,),
        one_event=True,
    )
    res = search_schedules(costs, 2, MEMORY, space)
    assert res.frontier
    for point in res.frontier:
        assert point.graph.one_event
        times = StepTimes(
            times=costs.times,
            wgrad_share=dict(space.wgrad_share),
            recompute_cost=space.recompute_cost,
            comm_contention=costs.comm_contention,
            delay_wgrad=point.graph.delay_wgrad,
        )
        got = replay_order(point.order, point.graph, times, MEMORY).step_ms
        assert got == pytest.approx(point.step_ms)


def test_a_one_event_that_is_not_a_bool_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"ScheduleGraph\.one_event: expected a bool"):
        ScheduleGraph(microbatches=1, moe=(True,), one_event=1)  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    with pytest.raises(ConfigError, match=r"SearchSpace\.one_event: expected a bool"):
        SearchSpace(one_event="yes")  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
