"""Contention per node kind: a dispatch or combine slowed by the compute beside it
(``StepTimes.contention_by_kind``), a compute node by the communication beside it
(``StepTimes.compute_contention_by_kind``), their replay and their fits."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from moe_overlap.errors import ConfigError
from moe_overlap.plan import (
    COMPUTE_CONTENTION_KINDS,
    CONTENTION_KINDS,
    QUICK_CHOICE_SPACE,
    ContentionKind,
    Costs,
    Layout,
    MeasuredSpan,
    Recompute,
    ScheduleGraph,
    SearchStep,
    StepTimes,
    choose_schedule,
    fit_compute_contention_by_kind,
    fit_contention,
    fit_contention_by_kind,
    parse_contention_by_kind,
    plan,
    replay_order,
    search_schedules,
    today_orders,
)
from moe_overlap.plan._contention import place_streams
from moe_overlap.plan._list_schedule import ScheduleIds, list_schedule, replay_ids
from moe_overlap.steps import Direction, Slot, StreamKind
from tests.plan import main_profile
from tests.plan.main_profile import MEMORY

F, B, W, R = Direction.FORWARD, Direction.BACKWARD, Direction.WGRAD, Direction.RECOMPUTE
PRE, DISPATCH, MLP, COMBINE = Slot.PRE_DISPATCH, Slot.DISPATCH, Slot.MLP, Slot.COMBINE
COMP, COMM = StreamKind.COMP, StreamKind.COMM
GIVEN = {(DISPATCH, F): 0.05, (DISPATCH, B): 0.1, (COMBINE, F): 0.2, (COMBINE, B): 0.7}
COMPUTE = {
    (PRE, F): 0.5,
    (PRE, B): 0.05,
    (PRE, W): 0.3,
    (MLP, F): 0.02,
    (MLP, B): 0.1,
    (MLP, W): 0.25,
    (MLP, R): 0.4,
}
"""Compute coefficients of the kinds the list-scheduled orders run beside communication."""


@pytest.fixture(scope="module")
def costs() -> Costs:
    return main_profile.main_costs().replace(comm_contention=0.0)


def _orders(costs: Costs) -> list[tuple[ScheduleGraph, list[SearchStep | None]]]:
    """Today's orders (joins and all) and list-scheduled ones with several microbatches in
    flight, delayed weight gradients, early recompute, chunks, with and without one event."""
    out: list[tuple[ScheduleGraph, list[SearchStep | None]]] = []
    for one_event in (False, True):
        base = ScheduleGraph(microbatches=4, moe=costs.moe, one_event=one_event)
        out += [(base, list(o)) for o in today_orders(base).values()]
        graph = base.replace(
            chunks=2,
            delay_wgrad=True,
            recompute=Recompute((MLP,)).triples(4, len(costs.moe)),
            early_recompute=True,
        )
        order, _, _ = list_schedule(graph, _times(costs, graph), MEMORY, in_flight=3)
        out.append((graph, list[SearchStep | None](order)))
    return out


def _bad(value: object) -> Any:
    """``value`` typed ``Any``: a misuse the type checkers would flag, made at run time."""
    return value


def _times(
    costs: Costs, graph: ScheduleGraph, by_kind: object = None, compute: object = None
) -> StepTimes:
    return StepTimes(
        times=costs.times,
        chunks=graph.chunks,
        chunk_overhead_ms=0.1,
        delay_wgrad=graph.delay_wgrad,
        contention_by_kind=_bad(by_kind),
        compute_contention_by_kind=_bad(compute),
    )


def test_all_coefficients_0_is_the_replay_without_contention(costs: Costs) -> None:
    """Every span bit for bit, in the replay and the list scheduler's integer replay."""
    for graph, order in _orders(costs):
        want = replay_order(order, graph, _times(costs, graph), MEMORY)
        for by_kind in ({}, dict.fromkeys(CONTENTION_KINDS, 0.0)):
            got = replay_order(order, graph, _times(costs, graph, by_kind), MEMORY)
            assert got == want
            g = ScheduleIds(graph, _times(costs, graph, by_kind), MEMORY)
            index = {s: i for i, s in enumerate(g.steps)}
            ids = [index[s] for s in order if s is not None]
            if None not in order:
                assert replay_ids(g, ids, 1.0) == (want.step_ms, want.peak_units)


def test_two_streams_by_hand() -> None:
    """A 4 ms compute step A beside a 3 ms combine X (c = 1: half speed beside compute):
    X does 2 ms of its work by 4 ms and the last 1 ms alone, ending at 5; compute B reads X
    (5 to 7); dispatch Y (2 ms, c = 1) from 5 runs beside B to 7 (1 ms of work) and alone
    to 8. Compute issued after X slows it: X's end depends on A, issued before it, as much
    as Y's on B, issued after it."""
    comm = [False, True, False, True]
    ms = [4.0, 3.0, 2.0, 2.0]
    lost = [0.0, 0.5, 0.0, 0.5]
    deps: list[list[int]] = [[], [], [1], []]
    assert place_streams(comm, ms, lost, deps) == [(0.0, 4.0), (0.0, 5.0), (5.0, 7.0), (5.0, 8.0)]
    # issued first, X still sees A
    order = [1, 0, 3, 2]
    spans = place_streams(
        [comm[i] for i in order],
        [ms[i] for i in order],
        [lost[i] for i in order],
        [[], [], [], [0]],
    )
    assert spans == [(0.0, 5.0), (0.0, 4.0), (5.0, 8.0), (5.0, 7.0)]
    # c = 0: each step its own length, after its stream's previous one
    assert place_streams(comm, ms, [0.0] * 4, deps) == [
        (0.0, 4.0),
        (0.0, 3.0),
        (4.0, 6.0),  # after A on its stream
        (3.0, 5.0),
    ]
    with pytest.raises(ConfigError, match="place_streams: expected each step's deps earlier"):
        place_streams([False, False], [1.0, 1.0], [0.0, 0.0], [[1], []])


def _beside(lo: float, hi: float, comp: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(hi, e) - max(lo, s)) for s, e in comp)


def test_every_communication_step_lasts_what_the_model_says(costs: Costs) -> None:
    """In each replayed order each communication step takes its time alone plus
    ``c / (1 + c)`` of its time beside compute (placed anywhere in the order), and each
    compute step its time alone."""
    slowed = 0
    for graph, order in _orders(costs):
        times = _times(costs, graph, GIVEN)
        r = replay_order(order, graph, times, MEMORY)
        comp = [(lo, hi) for s, lo, hi in r.spans if s.stream is COMP]
        for s, lo, hi in r.spans:
            want = times.base_ms(s)
            if s.stream is COMM:
                c = GIVEN[(s.slot, s.direction)]
                beside = _beside(lo, hi, comp)
                want += beside * c / (1.0 + c)
                slowed += beside > 0
            assert hi - lo == pytest.approx(want, rel=1e-9, abs=1e-9), s
    assert slowed > 100  # beside compute in every order but the serial ones


@pytest.mark.parametrize("kind", CONTENTION_KINDS, ids=lambda k: f"{k[0].value}.{k[1].value}")
def test_a_larger_coefficient_never_shortens_the_step(costs: Costs, kind: ContentionKind) -> None:
    comm: list[float] = []
    for graph, order in _orders(costs):
        steps = [
            replay_order(order, graph, _times(costs, graph, {**GIVEN, kind: c}), MEMORY)
            for c in (0.0, 0.1, 0.5, 1.0, 3.0)
        ]
        ms = [r.step_ms for r in steps]
        comm = [r.comm_ms for r in steps]
        assert ms == sorted(ms), (graph, ms)
        assert comm == sorted(comm), (graph, comm)
    # the overlapped order of four microbatches: every kind runs beside compute somewhere
    assert comm[-1] > comm[0]


def test_the_fit_recovers_the_coefficients_the_model_placed(costs: Costs) -> None:
    """Spans from the model's own replay give back its coefficients; a kind never beside
    compute is reported and gets 0, as does one no slower than alone."""
    for graph, order in _orders(costs)[-1:]:  # the list-scheduled order, one event
        times = _times(costs, graph, GIVEN)
        r = replay_order(order, graph, times, MEMORY)
        spans = [
            MeasuredSpan(s.slot, s.direction, s.stream, lo, hi, times.base_ms(s))
            for s, lo, hi in r.spans
        ]
        fit = fit_contention_by_kind(spans)
        assert fit.coefficients == pytest.approx(GIVEN, rel=1e-9)
        assert fit.unseen == () and fit.clamped == ()
        again = replay_order(order, graph, _times(costs, graph, fit.coefficients), MEMORY)
        assert again.step_ms == pytest.approx(r.step_ms, rel=1e-12)
    serial = ScheduleGraph(microbatches=2, moe=costs.moe)
    r = replay_order(today_orders(serial)["serial"], serial, _times(costs, serial, GIVEN), MEMORY)
    fit = fit_contention_by_kind(
        [MeasuredSpan(s.slot, s.direction, s.stream, lo, hi, hi - lo) for s, lo, hi in r.spans]
    )
    assert fit.unseen == CONTENTION_KINDS and set(fit.coefficients.values()) == {0.0}
    faster = [
        MeasuredSpan(MLP, F, COMP, 0.0, 4.0),
        MeasuredSpan(COMBINE, B, COMM, 0.0, 4.0, 5.0),  # faster than alone: 0
        MeasuredSpan(DISPATCH, F, COMM, 4.0, 6.0, 2.0),  # never beside compute: 0
    ]
    fit = fit_contention_by_kind(faster)
    assert fit.clamped == ((COMBINE, B),)
    assert (DISPATCH, F) in fit.unseen and fit.coefficients[(COMBINE, B)] == 0.0
    assert fit.beside_ms[(COMBINE, B)] == 4.0 and fit.alone_ms[(COMBINE, B)] == 5.0


def test_the_fit_refuses_what_contention_does_not_explain() -> None:
    comp = MeasuredSpan(MLP, F, COMP, 0.0, 1.0)
    cases: list[tuple[object, str]] = [
        ("spans", "fit_contention_by_kind: spans must be a sequence of MeasuredSpan, received str"),
        ([(MLP, F, COMP, 0.0, 1.0)], r"spans\[0\]: expected a MeasuredSpan, received tuple"),
        ([MeasuredSpan(MLP, F, COMP, 1.0, 0.0)], r"spans\[0\]\.end_ms"),
        ([MeasuredSpan(MLP, F, COMM, 0.0, 1.0, 1.0)], r"spans\[0\]: expected a compute span"),
        ([MeasuredSpan(COMBINE, W, COMM, 0.0, 1.0, 1.0)], r"spans\[0\]: expected a compute"),
        ([comp, MeasuredSpan(COMBINE, F, COMM, 0.0, 1.0)], r"spans\[1\]\.alone_ms"),
        ([comp, MeasuredSpan(COMBINE, F, COMM, 0.0, 3.0, 1.0)], r"combine\.F: expected the nodes"),
        ([MeasuredSpan(MLP, F, COMP, math.nan, 1.0)], r"spans\[0\]\.start_ms"),
    ]
    for spans, message in cases:
        with pytest.raises(ConfigError, match=message):
            fit_contention_by_kind(_bad(spans))


def test_refused_coefficients_name_what_was_expected(costs: Costs) -> None:
    cases: list[tuple[object, str]] = [
        (
            [((DISPATCH, F), 0.1)],
            r"StepTimes\.contention_by_kind: expected a mapping of \(Slot, Direction\) .* or None",
        ),
        (
            {(MLP, F): 0.1},
            r"expected keys among \(dispatch\.F, dispatch\.B, combine\.F, combine\.B\)",
        ),
        ({DISPATCH: 0.1}, "expected keys among"),
        ({(DISPATCH, W): 0.1}, "expected keys among"),
        ({(DISPATCH, F): -0.1}, r"\[dispatch\.F\].*>= 0"),
        ({(COMBINE, B): math.inf}, r"\[combine\.B\].*finite"),
        ({(COMBINE, B): math.nan}, r"\[combine\.B\]"),
        ({(COMBINE, B): True}, r"\[combine\.B\]"),
        ({(COMBINE, B): "0.1"}, r"\[combine\.B\]"),
    ]
    for by_kind, message in cases:
        with pytest.raises(ConfigError, match=message):
            StepTimes(times={}, contention_by_kind=_bad(by_kind))
        with pytest.raises(ConfigError, match=message.replace("StepTimes", "Costs")):
            costs.replace(contention_by_kind=by_kind)
    with pytest.raises(ConfigError, match="StepTimes: expected one contention model"):
        StepTimes(times={}, comm_contention=0.1, contention_by_kind={})
    with pytest.raises(ConfigError, match="Costs: expected one contention model"):
        costs.replace(comm_contention=0.1, contention_by_kind=GIVEN)
    by_kind = costs.replace(contention_by_kind=GIVEN)
    layout = Layout(microbatches=4)
    with pytest.raises(ConfigError, match="plan: expected costs with contention_by_kind=None"):
        plan(by_kind, layout, "combined_1f1b")
    with pytest.raises(ConfigError, match="fit_contention: expected costs with contention_by"):
        fit_contention(by_kind, layout, "combined_1f1b", 500.0)


def test_the_search_and_the_choice_time_orders_with_it(costs: Costs) -> None:
    """Every frontier point is the replay of its order with the coefficients (the search
    asserts its own estimate against it too); stronger contention, slower frontier."""
    space = dataclasses.replace(
        QUICK_CHOICE_SPACE, in_flight=(2, 3), memory_caps=(None,), rules=("oldest",)
    )
    found = {
        name: search_schedules(costs.replace(contention_by_kind=k), 4, MEMORY, space)
        for name, k in (("none", {}), ("given", GIVEN))
    }
    for name, result in found.items():
        by_kind = {} if name == "none" else GIVEN
        for p in result.frontier:
            times = _times(costs, p.graph, by_kind)
            times = dataclasses.replace(times, chunk_overhead_ms=0.0, recompute_cost=1.0)
            assert replay_order(p.order, p.graph, times, MEMORY).step_ms == pytest.approx(p.step_ms)
    fastest = {k: min(p.step_ms for p in r.frontier) for k, r in found.items()}
    assert fastest["given"] > fastest["none"]
    plain = search_schedules(costs, 4, MEMORY, space)
    assert [p.step_ms for p in plain.frontier] == [p.step_ms for p in found["none"].frontier]
    choice = choose_schedule(costs.replace(contention_by_kind=GIVEN), 4, MEMORY, space=space)
    assert choice.chosen.step_ms >= fastest["given"] - 1e-9


# ------------------------------------------------------------- compute slowed beside the comm


def _compute_kind(s: SearchStep) -> ContentionKind:
    return (s.slot, R if s.recompute else s.direction)


def test_compute_coefficients_0_are_today_s_replay_bit_for_bit(costs: Costs) -> None:
    """With every compute coefficient 0 (none given, or all given 0) each span equals the
    replay per communication kind alone, in the replay, the integer replay and the list
    scheduler; with no communication coefficient either, the replay without contention."""
    for graph, order in _orders(costs):
        for by_kind in (GIVEN, None):
            want = replay_order(order, graph, _times(costs, graph, by_kind or {}), MEMORY)
            for zero in ({}, dict.fromkeys(COMPUTE_CONTENTION_KINDS, 0.0)):
                times = _times(costs, graph, by_kind, zero)
                assert replay_order(order, graph, times, MEMORY) == want
                g = ScheduleIds(graph, times, MEMORY)
                index = {s: i for i, s in enumerate(g.steps)}
                if None not in order:
                    ids = [index[s] for s in order if s is not None]
                    assert replay_ids(g, ids, 1.0) == (want.step_ms, want.peak_units)
    graph = _orders(costs)[-1][0]
    zero = dict.fromkeys(COMPUTE_CONTENTION_KINDS, 0.0)
    scheduled = list_schedule(graph, _times(costs, graph, GIVEN), MEMORY, in_flight=3)
    assert list_schedule(graph, _times(costs, graph, GIVEN, zero), MEMORY, in_flight=3) == scheduled


def test_both_streams_slowed_by_hand() -> None:
    """A 4 ms compute step A (c = 1) beside a 3 ms combine X (c = 1): both at half speed to
    6, where X ends (3 ms of work) and dispatch Y (4 ms, c = 0: never slowed) follows it to
    10; A, 1 ms of work left, still beside the communication stream, ends at 8. Compute B
    (2 ms, c = 1) reads X and follows A: half speed beside Y to 10 (1 ms of work), the
    rest alone to 11. With B's coefficient 0 it ends at 10; with every compute coefficient
    0 the spans are the communication-only ones: A alone, X half speed to 4 and alone to 5."""
    comm = [False, True, False, True]
    ms = [4.0, 3.0, 2.0, 4.0]
    deps: list[list[int]] = [[], [], [1], []]
    assert place_streams(comm, ms, [0.5, 0.5, 0.5, 0.0], deps) == [
        (0.0, 8.0),
        (0.0, 6.0),
        (8.0, 11.0),
        (6.0, 10.0),
    ]
    assert place_streams(comm, ms, [0.5, 0.5, 0.0, 0.0], deps)[2] == (8.0, 10.0)
    assert place_streams(comm, ms, [0.0, 0.5, 0.0, 0.0], deps) == [
        (0.0, 4.0),
        (0.0, 5.0),
        (5.0, 7.0),
        (5.0, 9.0),
    ]


def test_every_step_lasts_what_the_model_says_on_both_streams(costs: Costs) -> None:
    """Each step takes its time alone plus ``c / (1 + c)`` of its time beside the other
    stream, compute steps by their own kind (a recompute as ``R``)."""
    slowed = 0
    for graph, order in _orders(costs):
        times = _times(costs, graph, GIVEN, COMPUTE)
        r = replay_order(order, graph, times, MEMORY)
        busy = {k: [(lo, hi) for s, lo, hi in r.spans if s.stream is k] for k in (COMP, COMM)}
        for s, lo, hi in r.spans:
            c = GIVEN[(s.slot, s.direction)] if s.stream is COMM else COMPUTE.get(_compute_kind(s))
            beside = _beside(lo, hi, busy[COMM if s.stream is COMP else COMP])
            want = times.base_ms(s) + beside * (c or 0.0) / (1.0 + (c or 0.0))
            slowed += s.stream is COMP and bool(c) and beside > 0
            assert hi - lo == pytest.approx(want, rel=1e-9, abs=1e-9), s
        plain = replay_order(order, graph, _times(costs, graph, GIVEN), MEMORY)
        assert r.comp_ms >= plain.comp_ms
    assert slowed > 100


def test_the_compute_fit_recovers_the_coefficients_the_model_placed(costs: Costs) -> None:
    """Spans from the model's replay with both streams slowed give back both fits'
    coefficients; kinds the order never runs beside communication are reported unseen."""
    graph, order = _orders(costs)[-1]  # list-scheduled: W and R steps, one event
    times = _times(costs, graph, GIVEN, COMPUTE)
    r = replay_order(order, graph, times, MEMORY)
    spans = [
        MeasuredSpan(s.slot, _compute_kind(s)[1], s.stream, lo, hi, times.base_ms(s))
        if s.stream is COMP
        else MeasuredSpan(s.slot, s.direction, s.stream, lo, hi, times.base_ms(s))
        for s, lo, hi in r.spans
    ]
    fit = fit_compute_contention_by_kind(spans)
    assert fit.unseen == ((PRE, R),)  # not recomputed here
    assert set(fit.clamped) == set(COMPUTE_CONTENTION_KINDS) - {*COMPUTE, (PRE, R)}  # 0 given
    assert fit.coefficients == pytest.approx(
        {k: COMPUTE.get(k, 0.0) for k in COMPUTE_CONTENTION_KINDS}, rel=1e-9
    )
    assert fit_contention_by_kind(spans).coefficients == pytest.approx(GIVEN, rel=1e-9)
    again = _times(costs, graph, GIVEN, fit.coefficients)
    assert replay_order(order, graph, again, MEMORY).step_ms == pytest.approx(r.step_ms)
    faster = [
        MeasuredSpan(COMBINE, F, COMM, 0.0, 4.0),  # no alone_ms needed: not fitted here
        MeasuredSpan(MLP, B, COMP, 0.0, 4.0, 5.0),  # faster than alone: 0
        MeasuredSpan(MLP, R, COMP, 4.0, 6.0, 2.0),  # never beside communication: 0
    ]
    fit = fit_compute_contention_by_kind(faster)
    assert fit.clamped == ((MLP, B),) and (MLP, R) in fit.unseen
    assert fit.beside_ms[(MLP, B)] == 4.0 and fit.coefficients[(MLP, B)] == 0.0


def test_the_compute_fit_refuses_what_contention_does_not_explain() -> None:
    comm = MeasuredSpan(COMBINE, F, COMM, 0.0, 1.0)
    where = "fit_compute_contention_by_kind"
    cases: list[tuple[object, str]] = [
        ({"x": 1}, f"{where}: spans must be a sequence of MeasuredSpan, received dict"),
        ([comm, (MLP, F, COMP, 0.0, 1.0)], r"spans\[1\]: expected a MeasuredSpan"),
        ([MeasuredSpan(MLP, F, COMP, 0.0, 1.0)], r"spans\[0\]\.alone_ms"),
        ([MeasuredSpan(DISPATCH, F, COMP, 0.0, 1.0, 1.0)], r"spans\[0\]: expected a comm"),
        ([MeasuredSpan(MLP, Direction.HOOK, COMP, 0.0, 1.0, 1.0)], r"received .*HOOK"),
        ([comm, MeasuredSpan(MLP, F, COMP, 0.0, 3.0, 1.0)], r"mlp\.F: expected the nodes"),
    ]
    for spans, message in cases:
        with pytest.raises(ConfigError, match=message):
            fit_compute_contention_by_kind(_bad(spans))


def test_refused_compute_coefficients_name_what_was_expected(costs: Costs) -> None:
    cases: list[tuple[object, str]] = [
        (
            0.1,
            r"StepTimes\.compute_contention_by_kind: expected a mapping .* compute node .* or None",
        ),
        ({(DISPATCH, F): 0.1}, r"expected keys among \(pre_process\.F, .*mlp\.R, .*; the compute"),
        ({(Slot.POST_PROCESS, W): 0.1}, "expected keys among"),
        ({(MLP, Direction.HOOK): 0.1}, "expected keys among"),
        ({(MLP, R): -0.1}, r"\[mlp\.R\].*>= 0"),
        ({(PRE, W): math.inf}, r"\[pre_dispatch\.W\].*finite"),
        ({(MLP, F): math.nan}, r"\[mlp\.F\]"),
    ]
    for compute, message in cases:
        with pytest.raises(ConfigError, match=message):
            StepTimes(times={}, compute_contention_by_kind=_bad(compute))
        with pytest.raises(ConfigError, match=message.replace("StepTimes", "Costs")):
            costs.replace(compute_contention_by_kind=compute)
    with pytest.raises(ConfigError, match="StepTimes: expected one .* and compute_contention"):
        StepTimes(times={}, comm_contention=0.1, compute_contention_by_kind={})
    with pytest.raises(ConfigError, match="Costs: expected one contention model"):
        costs.replace(comm_contention=0.1, compute_contention_by_kind=COMPUTE)
    both = costs.replace(contention_by_kind=GIVEN, compute_contention_by_kind=COMPUTE)
    assert both.compute_contention_by_kind == COMPUTE
    compute_only = costs.replace(compute_contention_by_kind=COMPUTE)
    layout = Layout(microbatches=4)
    for where, call in (
        ("plan", lambda: plan(compute_only, layout, "combined_1f1b")),
        ("fit_contention", lambda: fit_contention(compute_only, layout, "combined_1f1b", 500.0)),
    ):
        with pytest.raises(
            ConfigError, match=f"{where}: expected costs with compute_contention_by_kind=None"
        ):
            call()


def test_the_search_times_orders_with_compute_contention(costs: Costs) -> None:
    """Every frontier point is its order's replay with both streams' coefficients; compute
    slowed too, no faster a frontier."""
    space = dataclasses.replace(
        QUICK_CHOICE_SPACE, in_flight=(2, 3), memory_caps=(None,), rules=("oldest",)
    )
    comm_only = search_schedules(costs.replace(contention_by_kind=GIVEN), 4, MEMORY, space)
    both = costs.replace(contention_by_kind=GIVEN, compute_contention_by_kind=COMPUTE)
    found = search_schedules(both, 4, MEMORY, space)
    for p in found.frontier:
        times = _times(costs, p.graph, GIVEN, COMPUTE)
        times = dataclasses.replace(times, chunk_overhead_ms=0.0, recompute_cost=1.0)
        assert replay_order(p.order, p.graph, times, MEMORY).step_ms == pytest.approx(p.step_ms)
    fastest = min(p.step_ms for p in found.frontier)
    assert fastest > min(p.step_ms for p in comm_only.frontier)
    choice = choose_schedule(both, 4, MEMORY, space=space)
    assert choice.chosen.step_ms >= fastest - 1e-9


def test_command_line_words_parse_in_order_or_are_refused_by_word() -> None:
    """``KIND=C`` words give the coefficients a ``Costs`` takes, in the order given; each
    bad word is refused naming the flag and the word."""
    got = parse_contention_by_kind("--f", ["combine.B=0.739", "dispatch.F=0"])
    assert list(got.items()) == [((COMBINE, B), 0.739), ((DISPATCH, F), 0.0)]
    assert parse_contention_by_kind("--f", ["mlp.R=1e-2"], compute=True) == {(MLP, R): 0.01}
    cases: list[tuple[object, bool, str]] = [
        ("combine.B=0.7", False, "--f: expected a sequence of KIND=C words, received str"),
        (["combine.B"], False, r"--f: expected KIND=C \(e\.g\. combine\.B=0\.7\)"),
        ([0.7], False, "--f: expected KIND=C .* received 0.7"),
        (["mlp.F=0.1"], False, "communication kinds .* received 'mlp.F=0.1'"),
        (["combine.B=0.1"], True, "compute kinds .* received 'combine.B=0.1'"),
        (["mlp.X=0.1"], True, "compute kinds .* received 'mlp.X=0.1'"),
        (["combine.B=x"], False, "a number, received 'combine.B=x'"),
        (["combine.B=-1"], False, ">= 0, received 'combine.B=-1'"),
        (["combine.B=nan"], False, "finite coefficient >= 0, received 'combine.B=nan'"),
        (["mlp.W=1", "mlp.W=2"], True, "each kind once, received mlp.W again in 'mlp.W=2'"),
    ]
    for words, compute, message in cases:
        with pytest.raises(ConfigError, match=message):
            parse_contention_by_kind("--f", _bad(words), compute=compute)
