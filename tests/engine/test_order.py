"""Step orders as data (issue 27, part 1): the rules, the search, and bit-identity of every
order the rules accept."""

from __future__ import annotations

import copy
import itertools
import random
import re
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import cast

import pytest
import torch

from moe_overlap import ConfigError, ScheduleOptions, TypeHintError, combined_1f1b
from moe_overlap.engine import DEBUG
from moe_overlap.steps import (
    ChunkShape,
    Direction,
    LayerShape,
    PairKind,
    PairOrder,
    Role,
    ScheduleMode,
    ScheduleOrder,
    Slot,
    SlotKey,
    Step,
    StreamKind,
    backward_pair_steps,
    chunk_steps,
    forward_pair_steps,
    layer_pair_steps,
    makespan,
    predict_ms,
    search_order,
)

from .test_parity import STACKS, assert_same
from .toy_model import ToyConfig, ToyModel, grads, make_microbatches, plain_step

F, B, W = Direction.FORWARD, Direction.BACKWARD, Direction.WGRAD


def _shape(
    kinds: str = "mm", *, delay: bool = False, order: ScheduleOrder | None = None
) -> ChunkShape:
    return ChunkShape(
        layers=tuple(
            LayerShape(
                index=i, is_moe=k == "m", delay_wgrad=delay, has_mtp_post=k == "t", order=order
            )
            for i, k in enumerate(kinds)
        )
    )


def _all_orders(kind: PairKind) -> list[PairOrder]:
    from moe_overlap.engine._order_search import valid_orders
    from moe_overlap.engine.core._order import template

    full = [s for s in PairOrder.megatron(kind).steps if s in template(kind)]
    return [PairOrder(kind, o) for o in valid_orders(kind, full)]


# -- the data -------------------------------------------------------------------------------


def test_megatron_orders_are_the_step_lists_of_before() -> None:
    assert str(PairOrder.megatron(PairKind.MIXED)).split()[1:4] == [
        "b.combine.B",
        "f.pre_dispatch.F",
        "b.mlp.B",
    ]
    assert PairOrder.megatron(PairKind.MIXED, early_attn_release=True).releases_attention_early()
    assert not PairOrder.megatron(PairKind.MIXED).releases_attention_early()
    for kind in PairKind:
        order = PairOrder.megatron(kind)
        assert order.is_megatron
        assert PairOrder.parse(kind, str(order)) == order


def test_schedule_order_round_trips_through_its_text() -> None:
    mixed = _all_orders(PairKind.MIXED)[3]
    order = ScheduleOrder(mixed=mixed)
    assert ScheduleOrder.parse(str(order)) == order
    assert ScheduleOrder.parse(str(ScheduleOrder())) == ScheduleOrder()
    assert order.of(PairKind.MIXED) == mixed
    assert order.of(PairKind.FORWARDS).is_megatron


@pytest.mark.parametrize(
    ("kind", "text", "match"),
    [
        (PairKind.MIXED, "drop", "expected exactly the steps"),
        (PairKind.MIXED, None, "each step once"),
        (PairKind.FORWARDS, "x.mlp.F", "expected 'role.slot.D'"),
        (PairKind.MIXED, "f.L0.mlp.F@comp", r"PairOrder\(MIXED\): expected 'role.slot.D'"),
        (PairKind.MIXED, "F1", r"expected 'role.slot.D' .*received 'F1'"),
        (PairKind.MIXED, "b.mlp", "expected 'role.slot.D'"),
        (PairKind.MIXED, "swap:b.mlp.B,b.combine.B", r"b.combine.B before b.mlp.B \(a microbatch"),
        (PairKind.MIXED, "swap:b.mlp.W,b.mlp.B", "b.mlp.B before b.mlp.W"),
        (PairKind.FORWARDS, "swap:f.mtp_post.F,g.mtp_post.F", "first forward's step"),
        (PairKind.BACKWARDS, "swap:b.mlp.W,c.mlp.B", "b.mlp.W before c.mlp.B"),
    ],
)
def test_orders_that_could_change_a_bit_are_refused(
    kind: PairKind, text: str | None, match: str
) -> None:
    steps = [str(s) for s in PairOrder.megatron(kind).steps]
    if text is None:
        steps.append(steps[0])
    elif text == "drop":
        steps.pop()
    elif text.startswith("swap:"):
        a, b = text.removeprefix("swap:").split(",")
        i, j = steps.index(a), steps.index(b)
        steps[i], steps[j] = steps[j], steps[i]
    else:
        steps[0] = text
    with pytest.raises(ConfigError, match=match):
        PairOrder(kind, steps)


def _refused(match: str, function: str, parameter: str) -> AbstractContextManager[object]:
    """Expect the error of a wrongly typed argument: the library's ``ConfigError`` saying
    ``match``; in debug mode beartype's ``TypeHintError`` naming ``function`` and
    ``parameter``, raised before the library's own check."""
    if DEBUG:
        return pytest.raises(
            TypeHintError, match=rf"{re.escape(function)}\(\) parameter {parameter}="
        )
    return pytest.raises(ConfigError, match=match)


def test_options_refuse_an_order_that_contradicts_early_release() -> None:
    late = ScheduleOrder(mixed=PairOrder.megatron(PairKind.MIXED))
    with pytest.raises(ConfigError, match="early release"):
        ScheduleOptions(ep_overlap_early_attn_memory_release=True, order=late)
    with _refused("ScheduleOptions.order", "ScheduleOptions.__init__", "order"):
        ScheduleOptions(order="megatron")  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    with pytest.raises(ConfigError, match="kind PairKind.FORWARDS"):
        ScheduleOrder(forwards=PairOrder.megatron(PairKind.MIXED))


def test_plans_built_with_different_orders_are_refused() -> None:
    other = ScheduleOrder(mixed=_all_orders(PairKind.MIXED)[0])
    f = LayerShape(index=0, is_moe=True)
    b = LayerShape(index=0, is_moe=True, order=other)
    with pytest.raises(ConfigError, match="one ScheduleOptions.order"):
        layer_pair_steps(f, b)


@pytest.mark.parametrize("kind", list(PairKind))
def test_every_valid_order_keeps_each_microbatch_s_own_walk(kind: PairKind) -> None:
    """Whatever the order, each microbatch's steps are those of it running alone, in order."""
    shape = _shape("mdm", delay=True)
    alone_f = [
        (s.layer, s.slot, s.direction) for s in chunk_steps(shape, None) if s.layer is not None
    ]
    alone_b = [
        (s.layer, s.slot, s.direction) for s in chunk_steps(None, shape) if s.layer is not None
    ]
    orders = _all_orders(kind)
    assert len(orders) > 10
    for order in random.Random(0).sample(orders, 10):
        o = _shape("mdm", delay=True, order=ScheduleOrder(**{_FIELD[kind]: order}))
        steps = _RUNS[kind](o)
        for role in {s.role for s in steps}:
            walk = [
                (s.layer, s.slot, s.direction)
                for s in steps
                if s.role is role and s.layer is not None
            ]
            want = alone_f if role in (Role.F, Role.F2) else alone_b
            if kind is PairKind.MIXED:
                # a paired chunk run leaves the first layer's pre-dispatch wgrad to the chunk
                assert sorted(walk, key=str) == sorted(want, key=str)
            else:
                assert [w for w in walk if w[2] is not W] == [w for w in want if w[2] is not W]
                assert set(walk) == set(want)


_RUNS: dict[PairKind, Callable[[ChunkShape], list[Step]]] = {
    PairKind.MIXED: lambda o: chunk_steps(o, o),
    PairKind.FORWARDS: lambda o: forward_pair_steps(o, o),
    PairKind.BACKWARDS: lambda o: backward_pair_steps(o, o),
}
_FIELD = {PairKind.MIXED: "mixed", PairKind.FORWARDS: "forwards", PairKind.BACKWARDS: "backwards"}


# -- the replay and the search --------------------------------------------------------------


def test_makespan_lets_a_weight_gradient_wait_on_its_stream_only() -> None:
    steps = [
        Step(B, role=Role.B, layer=0, slot=Slot.MLP, stream=StreamKind.COMP),
        Step(W, role=Role.B, layer=0, slot=Slot.MLP, stream=StreamKind.COMP),
        Step(B, role=Role.B, layer=0, slot=Slot.DISPATCH, stream=StreamKind.COMM),
    ]
    ms: dict[Slot | None, dict[Direction, float]] = {
        Slot.MLP: {B: 2.0, W: 5.0},
        Slot.DISPATCH: {B: 3.0},
    }
    # dispatch.B waits for mlp.B (2 ms), not for the weight gradient (ends at 7 ms).
    assert makespan(steps, lambda s: ms[s.slot][s.direction]) == 7.0
    steps[1] = steps[1]._replace(direction=F)  # a node step: the chain waits for it
    assert makespan(steps, lambda s: ms[s.slot].get(s.direction, 5.0)) == 10.0
    with pytest.raises(ConfigError, match="replay: expected node steps.*received F1"):
        makespan([Step(F, 1)], lambda s: 1.0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, "1", True])
def test_replay_refuses_a_duration_that_is_not_milliseconds(bad: object) -> None:
    # NaN, inf and negative times were replayed as they were; a str failed in float's +.
    step = Step(F, 0, role=Role.F, layer=0, slot=Slot.MLP, stream=StreamKind.COMP)
    with pytest.raises(
        ConfigError, match=r"replay: duration\(f\.L0\.mlp\.F0@comp\) must be a finite"
    ):
        makespan([step], lambda s: cast(float, bad))


def _random_durations(seed: int, layers: int) -> dict[SlotKey, float]:
    rng = random.Random(seed)
    out: dict[SlotKey, float] = {}
    for layer in range(layers):
        for slot, direction in itertools.product(
            (Slot.PRE_DISPATCH, Slot.DISPATCH, Slot.MLP, Slot.COMBINE), (F, B)
        ):
            out[(layer, slot, direction)] = rng.choice([1.0, 2.0, 5.0, 9.0])
        for slot in (Slot.PRE_DISPATCH, Slot.MLP):
            out[(layer, slot, W)] = rng.choice([1.0, 4.0])
    return out


def test_search_finds_the_shortest_order_and_keeps_megatron_s_on_ties() -> None:
    shape = _shape("mm", delay=True)
    gained = set[PairKind]()
    for seed in range(40):
        durations = _random_durations(seed, 2)
        found = search_order(shape, durations)
        for kind in PairKind:
            assert found.found_ms[kind] <= found.megatron_ms[kind]
            chosen = found.order.of(kind)
            if found.found_ms[kind] == found.megatron_ms[kind]:
                assert chosen.is_megatron
            else:
                gained.add(kind)
        # the whole step replays no slower with the found order, in every mode
        for mode in ScheduleMode:
            assert (
                predict_ms(shape, durations, 4, mode, order=found.order)
                <= predict_ms(shape, durations, 4, mode) + 1e-9
            )
    assert gained == set(PairKind)


def test_search_brute_force_agrees_on_one_layer() -> None:
    shape = _shape("m", delay=True)
    durations = _random_durations(3, 1)
    found = search_order(shape, durations)
    for kind in PairKind:
        field = _FIELD[kind]
        best = min(
            makespan(
                _RUNS[kind](_shape("m", delay=True, order=ScheduleOrder(**{field: order}))),
                lambda s: (
                    0.0 if s.slot is None else durations.get((s.layer, s.slot, s.direction), 0.0)
                ),
            )
            for order in _all_orders(kind)
        )
        assert found.found_ms[kind] == pytest.approx(best)


def test_search_with_early_release_keeps_orders_that_release_early() -> None:
    found = search_order(_shape("mm"), _random_durations(5, 2), early_attn_release=True)
    assert found.order.of(PairKind.MIXED, early_attn_release=True).releases_attention_early()
    # a shape built with early release (a plan's) says so itself
    early = ChunkShape(
        layers=tuple(LayerShape(index=i, is_moe=True, early_attn_release=True) for i in range(2))
    )
    found = search_order(early, _random_durations(5, 2))
    assert found.order.of(PairKind.MIXED, early_attn_release=True).releases_attention_early()


def test_search_refuses_bad_durations() -> None:
    with _refused("durations key", "search_order", "durations"):
        search_order(_shape(), {("0", Slot.MLP, F): 1.0})  # type: ignore[dict-item]  # pyright: ignore[reportArgumentType]
    with pytest.raises(ConfigError, match=">= 0"):
        search_order(_shape(), {(0, Slot.MLP, F): -1.0})
    with _refused("ChunkShape", "search_order", "shape"):
        search_order("mm", {})  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]


# -- every order the rules accept is exact ---------------------------------------------------


def sample_orders(seed: int) -> ScheduleOrder:
    """A random valid order of each kind."""
    rng = random.Random(seed)
    return ScheduleOrder(**{_FIELD[k]: rng.choice(_all_orders(k)) for k in PairKind})


@pytest.mark.parametrize("stack", sorted(STACKS))
@pytest.mark.parametrize("delay", [False, True])
@pytest.mark.parametrize("fill_drain", [False, True])
def test_any_valid_order_is_bit_identical(stack: str, delay: bool, fill_drain: bool) -> None:
    config = ToyConfig(shared_expert=True)
    ref = ToyModel(config, STACKS[stack])
    mbs = make_microbatches(4, config)
    want = plain_step(ref, mbs)
    for seed in range(2):
        model = copy.deepcopy(ref)
        for p in model.parameters():
            p.grad = None
        model.set_delay(delay)
        order = sample_orders(seed + 10 * delay + 100 * fill_drain)
        options = ScheduleOptions(delay_wgrad_compute=delay, order=order)
        got = combined_1f1b(model, mbs, options=options, fill_drain=fill_drain)
        assert model.pending_wgrad == 0
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        assert_same(grads(model), grads(ref))
