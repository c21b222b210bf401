"""A whole schedule as node steps (``combined_1f1b(schedule=...)``): the rules as data, then
bit-identity to plain per-microbatch backward() for today's orders, the planner's and
random exact ones, any number of microbatches in flight."""

from __future__ import annotations

import copy
import json
import random
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from moe_overlap import (
    ConfigError,
    Microbatch,
    ScheduleError,
    ScheduleOptions,
    SlotContext,
    TypeHintError,
    combined_1f1b,
    make_streams,
)
from moe_overlap.engine import DEBUG
from moe_overlap.plan import ScheduleGraph, node_schedule, today_orders
from moe_overlap.steps import (
    ChunkShape,
    Direction,
    LayerShape,
    NodeSchedule,
    Slot,
    Step,
    check_node_order,
    format_steps,
    microbatch_node_steps,
)

from .test_parity import assert_same
from .toy_model import ToyConfig, ToyLayer, ToyModel, grads, make_microbatches, plain_step

_W = Direction.WGRAD


def _shape(kinds: str, delay: bool = False) -> ChunkShape:
    return ChunkShape(
        layers=tuple(
            LayerShape(index=i, is_moe=k == "m", delay_wgrad=delay) for i, k in enumerate(kinds)
        )
    )


def random_order(shape: ChunkShape, n: int, seed: int, *, in_flight: int = 3) -> NodeSchedule:
    """A random exact order of ``n`` microbatches' steps, at most ``in_flight`` started and
    not finished at once: each pick is a microbatch's next step (or an owed ``W``) that the
    rules allow; the oldest unfinished microbatch can always go on, so it never sticks."""
    rng = random.Random(seed)
    orders = [microbatch_node_steps(shape, mb)[0] for mb in range(n)]
    plain = [[s for s in o if s.direction is not _W] for o in orders]
    wgrads = [{(s.layer, s.slot): s for s in o if s.direction is _W} for o in orders]
    pos = [0] * n
    owed: list[dict[tuple[int | None, Slot | None], Step]] = [{} for _ in range(n)]
    fwd_done: dict[tuple[int | None, Slot | None], int] = {}
    bwd_done: dict[tuple[int | None, Slot | None], int] = {}
    out: list[Step] = []

    def allowed(mb: int, step: Step) -> bool:
        key = (step.layer, step.slot)
        if step.direction is Direction.FORWARD:
            return fwd_done.get(key, -1) == mb - 1
        if step.direction is Direction.BACKWARD:  # earlier ones done with the slot, W too
            return bwd_done.get(key, -1) == mb - 1 and all(key not in owed[m] for m in range(mb))
        return True

    while any(pos[mb] < len(plain[mb]) or owed[mb] for mb in range(n)):
        started = [mb for mb in range(n) if 0 < pos[mb] < len(plain[mb]) or owed[mb]]
        choices: list[tuple[int, Step]] = []
        for mb in range(n):
            choices += [(mb, w) for w in owed[mb].values()]
            if pos[mb] < len(plain[mb]) and (pos[mb] > 0 or len(started) < in_flight):
                step = plain[mb][pos[mb]]
                if allowed(mb, step):
                    choices.append((mb, step))
        mb, step = rng.choice(choices)
        key = (step.layer, step.slot)
        out.append(step)
        if step.direction is _W:
            del owed[mb][key]
            continue
        pos[mb] += 1
        if step.direction is Direction.FORWARD:
            fwd_done[key] = mb
        else:
            bwd_done[key] = mb
            if key in wgrads[mb]:
                owed[mb][key] = wgrads[mb][key]
    return NodeSchedule(out)


def with_recomputes(
    schedule: NodeSchedule,
    shape: ChunkShape,
    seed: int,
    recompute: tuple[Slot, ...] = (Slot.PRE_DISPATCH, Slot.MLP),
) -> NodeSchedule:
    """``schedule`` with an ``R`` step for every slot of ``recompute`` of each layer, each at
    a random place after its forward (and the previous microbatch's ``R`` of that slot) and
    before its backward."""
    rng = random.Random(seed)
    steps = list(schedule.steps)

    def at(direction: Direction, mb: int, layer: int | None, slot: Slot | None) -> int:
        key = (direction, mb, layer, slot)
        return next(
            k for k, s in enumerate(steps) if (s.direction, s.microbatch, s.layer, s.slot) == key
        )

    for mb in range(schedule.microbatches):
        for r in microbatch_node_steps(shape, mb, recompute=recompute)[1]:
            lo = at(Direction.FORWARD, mb, r.layer, r.slot)
            if mb:
                lo = max(lo, at(Direction.RECOMPUTE, mb - 1, r.layer, r.slot))
            steps.insert(rng.randint(lo + 1, at(Direction.BACKWARD, mb, r.layer, r.slot)), r)
    return NodeSchedule(steps)


def run_both(
    stack: str,
    schedule: NodeSchedule,
    *,
    delay: bool = False,
    recompute: tuple[Slot, ...] = (),
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> None:
    """``schedule`` on a toy model of ``stack``, against plain per-microbatch backward():
    the same losses and gradients, bit for bit (on CUDA: the streams of ``make_streams``,
    hidden 64, 4 x 64 tokens per microbatch)."""
    cuda = device == "cuda"
    config = ToyConfig(hidden=64, shared_expert=True) if cuda else ToyConfig(shared_expert=True)
    ref = ToyModel(config, stack).to(device=device, dtype=dtype)
    model = copy.deepcopy(ref)
    mbs = make_microbatches(
        schedule.microbatches, config, **({"batch": 4, "seq": 64} if cuda else {})
    )
    mbs = [
        Microbatch(
            input_ids=_to(m.input_ids, device),
            position_ids=_to(m.position_ids, device),
            labels=_to(m.labels, device),
        )
        for m in mbs
    ]
    want = plain_step(ref, mbs)
    model.set_delay(delay)
    options = ScheduleOptions(delay_wgrad_compute=delay, recompute=recompute)
    got = combined_1f1b(
        model, mbs, options=options, streams=make_streams(device), schedule=schedule
    )
    if cuda:
        torch.cuda.synchronize()
    assert model.pending_wgrad == 0
    assert all(torch.equal(a, b.float()) for a, b in zip(got, want, strict=True))
    assert_same(grads(model), grads(ref))


def _to(t: torch.Tensor | None, device: str) -> torch.Tensor | None:
    return None if t is None else t.to(device)


def frontier_options(schedule: NodeSchedule) -> dict[str, Any]:
    """What a searched order needs: delayed weight gradients when it has ``W`` steps, the
    pre-dispatch and mlp recomputed when it has ``R`` steps."""
    directions = {s.direction for s in schedule.steps}
    return {
        "delay": Direction.WGRAD in directions,
        "recompute": (Slot.PRE_DISPATCH, Slot.MLP) if Direction.RECOMPUTE in directions else (),
    }


def test_a_schedule_round_trips_through_its_text() -> None:
    steps, _ = microbatch_node_steps(_shape("dm", delay=True), 1)
    schedule = NodeSchedule(steps)
    assert NodeSchedule.parse(str(schedule)) == schedule
    assert str(schedule).split()[:3] == [
        "pre_process.F1@comp",
        "L0.pre_dispatch.F1@comp",
        "L0.mlp.F1@comp",
    ]
    assert "L1.dispatch.F1@comm" in str(schedule)
    assert schedule.microbatches == 2
    with pytest.raises(AttributeError):
        schedule.steps = ()


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("b.L0.mlp.F0", "a role"),
        ("L0.mlp.F", "no microbatch"),
        ("F0", "no slot"),
        ("L0.mlp.H0", "direction H"),
        ("L0.pre_process.F0", "layer on pre/post-process"),
        ("mlp.F0", "layer slot without a layer"),
        ("L0.nope.F0", "unknown slot"),
    ],
)
def test_malformed_steps_are_refused(text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        NodeSchedule(text)


def _plain_order(shape: ChunkShape, n: int) -> list[Step]:
    return [s for mb in range(n) for s in microbatch_node_steps(shape, mb)[0]]


def _move(
    steps: list[Step], a: str, *, before: str | None = None, after: str | None = None
) -> NodeSchedule:
    """``steps`` with step ``a`` taken out and put back before or after another."""
    out = [s for s in steps if str(s) != a]
    moved = next(s for s in steps if str(s) == a)
    at = next(k for k, s in enumerate(out) if str(s) == (before or after))
    out.insert(at if before else at + 1, moved)
    return NodeSchedule(out)


def _two_microbatches(shape: ChunkShape) -> list[Step]:
    """Microbatches 0 and 1 forward step by step side by side, then 0's backward, 1's."""
    (f0, b0), (f1, b1) = ((_split(microbatch_node_steps(shape, mb)[0])) for mb in range(2))
    return [s for pair in zip(f0, f1, strict=True) for s in pair] + b0 + b1


def _split(steps: list[Step]) -> tuple[list[Step], list[Step]]:
    k = next(i for i, s in enumerate(steps) if s.direction is not Direction.FORWARD)
    return steps[:k], steps[k:]


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda s: NodeSchedule(s[:-1]), "received 1 missing"),
        (lambda s: NodeSchedule([*s, s[0]]), "twice"),
        (
            lambda s: _move(s, "L0.mlp.F0@comp", before="L0.pre_dispatch.F0@comp"),
            "plain backward\\(\\)'s order",
        ),
        (
            lambda s: _move(s, "L0.pre_dispatch.F1@comp", before="L0.pre_dispatch.F0@comp"),
            "forwards in microbatch order",
        ),
        (
            lambda s: _move(s, "L1.mlp.W0@comp", after="L1.mlp.B1@comp"),
            "before the next microbatch",
        ),
        (lambda s: _move(s, "L1.mlp.W0@comp", before="L1.mlp.B0@comp"), "needs its backward"),
        (lambda s: NodeSchedule([t._replace(stream=None) for t in s]), None),
        (lambda s: NodeSchedule(["pre_process.F0@comm", *s[1:]]), "comp stream"),
        (lambda s: NodeSchedule([*s, Step.parse("L7.mlp.F0")]), "does not have"),
        (lambda s: NodeSchedule([*s, Step.parse("L1.mlp.R0")]), "R only for recomputed"),
    ],
)
def test_orders_that_are_not_exact_are_refused_naming_the_rule(edit, match) -> None:  # type: ignore[no-untyped-def]
    shape = _shape("dm", delay=True)
    schedule = edit(_two_microbatches(shape))
    if match is None:
        check_node_order(schedule, [shape, shape])  # steps without their streams are fine
        return
    with pytest.raises(ConfigError, match=match):
        check_node_order(schedule, [shape, shape])


def test_the_plain_order_and_the_random_ones_pass_the_rules() -> None:
    shape = _shape("mdm", delay=True)
    check_node_order(NodeSchedule(_plain_order(shape, 3)), [shape] * 3)
    for seed in range(20):
        check_node_order(random_order(shape, 4, seed), [shape] * 4)


@pytest.mark.parametrize("stack", ["dm", "mm", "mdm"])
@pytest.mark.parametrize("name", ["serial", "overlapped", "fill_drain"])
def test_today_s_orders_from_the_planner_are_bit_identical(stack: str, name: str) -> None:
    graph = ScheduleGraph(microbatches=3, moe=tuple(k == "m" for k in stack))
    run_both(stack, node_schedule(today_orders(graph)[name]))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("delay", [False, True])
def test_random_exact_orders_are_bit_identical(seed: int, delay: bool) -> None:
    stack = ["mdm", "mm", "dm"][seed % 3]
    shape = _shape(stack, delay=delay)
    in_flight = 2 + seed % 3  # 2, 3, 4 microbatches in flight
    run_both(stack, random_order(shape, 4, seed, in_flight=in_flight), delay=delay)


def test_the_schedule_replaces_overlap_and_fill_drain_and_must_match_the_microbatches() -> None:
    config = ToyConfig()
    model = ToyModel(config, "dm")
    schedule = NodeSchedule(_plain_order(_shape("dm"), 2))
    mbs = make_microbatches(2, config)
    with pytest.raises(ConfigError, match="overlap and fill_drain left at their defaults"):
        combined_1f1b(model, mbs, schedule=schedule, fill_drain=True)
    with pytest.raises(ConfigError, match="a schedule of the 3 microbatches given"):
        combined_1f1b(model, make_microbatches(3, config), schedule=schedule)
    # Debug mode: beartype refuses the wrong type first (the library's TypeHintError).
    error, match = (
        (TypeHintError, r"combined_1f1b\(\) parameter schedule=")
        if DEBUG
        else (ConfigError, "a NodeSchedule")
    )
    with pytest.raises(error, match=match):
        combined_1f1b(model, mbs, schedule=str(schedule))  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    with pytest.raises(ConfigError, match="does not have"):  # a dense layer has no dispatch
        combined_1f1b(model, mbs, schedule=NodeSchedule(_plain_order(_shape("mm"), 2)))
    assert all(p.grad is None for p in model.parameters())  # refused before any step ran


def test_a_verdict_is_remembered_for_the_same_schedule_shapes_and_slots_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A training loop's later steps skip the walk of the rules; another model's shapes or
    other recomputed slots are walked again, and a schedule wrong for them is refused."""
    from moe_overlap.engine import _node_order_check as ns

    monkeypatch.setattr(ns, "_EXACT", {})
    walks: list[int] = []
    walk = ns._check_node_order

    def counted(*args: Any) -> None:
        walks.append(1)
        walk(*args)

    monkeypatch.setattr(ns, "_check_node_order", counted)
    shape = _shape("mm")
    schedule = NodeSchedule(_plain_order(shape, 2))
    for _ in range(3):
        ns.check_node_order(schedule, [shape, shape])
    assert len(walks) == 1
    ns.check_node_order(NodeSchedule(str(schedule)), [shape, shape])  # an equal schedule
    assert len(walks) == 1
    with pytest.raises(ConfigError, match="does not have"):  # a dense layer: no dispatch
        ns.check_node_order(schedule, [_shape("dm")] * 2)
    text = str(schedule)
    assert "L1.mlp.B0" in text
    recomputing = NodeSchedule(text.replace("L1.mlp.B0", "L1.mlp.R0 L1.mlp.B0", 1))
    ns.check_node_order(recomputing, [shape, shape], recompute=[Slot.MLP])
    with pytest.raises(ConfigError, match="does not have"):  # R only for recomputed slots
        ns.check_node_order(recomputing, [shape, shape])
    assert len(walks) == 4


def test_a_failing_step_names_itself_and_the_next_step_is_exact() -> None:
    config = ToyConfig()
    ref = ToyModel(config, "mm")
    model = copy.deepcopy(ref)
    mbs = make_microbatches(3, config)
    schedule = random_order(_shape("mm"), 3, seed=5)
    layer = model.decoder.layers[1]
    assert isinstance(layer, ToyLayer)
    original = layer.slot_mlp

    def failing(node: SlotContext, inputs: tuple[torch.Tensor, ...], /) -> object:
        if node.chunk_state.microbatch is mbs[1]:
            raise RuntimeError("mlp failed on purpose")
        return original(node, inputs)

    layer.slot_mlp = failing  # type: ignore[method-assign,assignment]  # pyright: ignore[reportAttributeAccessIssue]
    with pytest.raises(ScheduleError, match=r"L1\.mlp\.F1") as info:
        combined_1f1b(model, mbs, schedule=schedule)
    assert "microbatch 1, layer 1, slot mlp, forward" in str(info.value)
    del layer.slot_mlp
    model.zero_grad(set_to_none=True)
    got = combined_1f1b(model, mbs, schedule=schedule)
    want = plain_step(ref, mbs)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert_same(grads(model), grads(ref))


def test_a_timeline_records_every_step_of_a_schedule() -> None:
    from moe_overlap.timeline import Timeline

    config = ToyConfig()
    model = ToyModel(config, "dm")
    schedule = random_order(_shape("dm"), 3, seed=2)
    timeline = Timeline()
    combined_1f1b(model, make_microbatches(3, config), schedule=schedule, observer=timeline)
    spans = timeline.spans()
    assert [(s.step, s.microbatch) for s in spans] == [(s, s.microbatch) for s in schedule.steps]
    assert {s.role for s in spans} == {None}
    assert spans[0].label == "mb0.pre_process.F"


_RESULTS = Path(__file__).resolve().parents[2] / "benchmarks/results"
_FRONTIERS = ("frontier", "frontier_one_event", "frontier_choice", "frontier_by_kind")
"""The committed frontiers: the planner's defaults; searched as the engine runs with the
benchmark slice's weight-gradient shares; ``choose_schedule``'s default space; as the second
with a contention per communication kind."""


def _frontier_orders() -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for folder in _FRONTIERS:
        configs = json.loads((_RESULTS / folder / "frontier.json").read_text(encoding="utf-8"))
        out += [(f"{folder}:{c['name']}", c["best_order"]) for c in configs["configs"]]
    return out


@pytest.mark.parametrize(("name", "order"), _frontier_orders(), ids=lambda v: v[:28])
def test_the_planner_s_best_schedules_run_bit_identical(name: str, order: str) -> None:
    """Each committed frontier's best orders (up to four microbatches in flight, delayed
    weight gradients, recomputation started early), as searched, on a four-layer MoE model."""
    schedule = NodeSchedule.parse(order)
    run_both("mmmm", schedule, **frontier_options(schedule))


def test_r_steps_are_checked_against_the_recomputed_slots() -> None:
    shape = _shape("dm")
    steps = _two_microbatches(shape)
    early = _move(
        [*steps, Step.parse("L1.mlp.R0@comp")], "L1.mlp.R0@comp", before="post_process.B0@comp"
    )
    check_node_order(early, [shape, shape], recompute=[Slot.MLP])
    late = _move([*steps, Step.parse("L1.mlp.R0")], "L1.mlp.R0", after="L1.mlp.B0@comp")
    with pytest.raises(ConfigError, match="a recompute is for its backward"):
        check_node_order(late, [shape, shape], recompute=[Slot.MLP])
    first = _move([*steps, Step.parse("L1.mlp.R0")], "L1.mlp.R0", before="L1.mlp.F0@comp")
    with pytest.raises(ConfigError, match="reruns a forward that ran"):
        check_node_order(first, [shape, shape], recompute=[Slot.MLP])


class _Owing(torch.nn.Module):
    """A module that owes one delayed weight gradient."""

    @property
    def pending_wgrad(self) -> int:
        return 1


def test_only_a_live_claim_s_weight_gradient_may_be_owed_while_a_schedule_runs() -> None:
    """Inside a node schedule a microbatch may start while a live plan still owes a ``W``
    step; any other owed weight gradient is still refused, and outside nothing is owed."""
    from moe_overlap import WgradError
    from moe_overlap.engine._owed_wgrad import node_schedule_running
    from moe_overlap.wgrad import check_wgrad_done, claim_wgrad

    model = torch.nn.Sequential(_Owing(), _Owing())
    with node_schedule_running():
        with claim_wgrad(model[0]), pytest.raises(WgradError, match=r"'1 \(_Owing\)': 1}"):
            check_wgrad_done(model, when="when a microbatch starts")
        with claim_wgrad(model[0], model[1]):
            check_wgrad_done(model, when="when a microbatch starts")
    with claim_wgrad(model[0], model[1]), pytest.raises(WgradError, match="_Owing"):
        check_wgrad_done(model, when="when combined_1f1b returns")


def test_hand_made_steps_and_misused_checks_are_refused() -> None:
    """Steps of the wrong kinds printed as other steps (``FTrue``) or crashed later; the
    checks' arguments raised bare AttributeErrors and TypeErrors; a map of slots (as the
    driver passes them) is read once."""
    shape = _shape("m")
    plain, _ = microbatch_node_steps(shape, 0)
    good = NodeSchedule(plain)
    f = Direction.FORWARD
    for step, field in [
        (Step(_bad("F"), 0, layer=0, slot=Slot.MLP), "direction 'F'"),
        (Step(f, True, layer=0, slot=Slot.MLP), "microbatch True"),
        (Step(f, _bad("0"), layer=0, slot=Slot.MLP), "microbatch '0'"),
        (Step(f, -1, layer=0, slot=Slot.MLP), "microbatch -1"),
        (Step(f, 0, layer=-1, slot=Slot.MLP), "layer -1"),
        (Step(f, 0, layer=0, slot=_bad("mlp")), "slot 'mlp'"),
        (Step(f, 0, layer=0, slot=Slot.MLP, stream=_bad("comp")), "stream 'comp'"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(field)):
            NodeSchedule([step])
    cases: list[tuple[Any, str]] = [
        (lambda: check_node_order(_bad(str(good)), [shape]), "check_node_order: schedule must be"),
        (lambda: check_node_order(good, _bad(None)), "check_node_order: shapes must be"),
        (lambda: check_node_order(good, _bad(["x"])), "check_node_order: shapes must be"),
        (lambda: check_node_order(good, [shape], recompute=_bad("mlp")), "recompute must be"),
        (lambda: check_node_order(good, [shape], recompute=[Slot.DISPATCH]), "recompute must"),
        (lambda: microbatch_node_steps(shape, -1), "microbatch_node_steps: mb must be"),
        (lambda: microbatch_node_steps(shape, True), "microbatch_node_steps: mb must be"),
        (lambda: microbatch_node_steps(_bad(None), 0), "microbatch_node_steps: shape must be"),
        (lambda: format_steps(_bad(None)), "format_steps: steps must be a sequence"),
        # a mark past the steps, a bool mark, a negative or fractional context and a
        # context without a mark each printed something (or nothing) without a word
        (lambda: format_steps(good.steps, mark=-1), "format_steps: mark must be an int in [0,"),
        (lambda: format_steps(good.steps, mark=999), "format_steps: mark must be an int in [0,"),
        (lambda: format_steps(good.steps, mark=True), "format_steps: mark must be an int in [0,"),
        (lambda: format_steps(good.steps, mark=1, context=-2), "context must be an int >= 0"),
        (lambda: format_steps(good.steps, mark=1, context=_bad(1.5)), "context must be an int"),
        (lambda: format_steps(good.steps, context=2), "context must be given with mark"),
    ]
    for call, message in cases:
        with pytest.raises(ConfigError, match=re.escape(message)):
            call()
    recomputing = NodeSchedule(str(good).replace("L0.mlp.B0", "L0.mlp.R0 L0.mlp.B0", 1))
    check_node_order(recomputing, [shape], recompute=map(Slot, ["mlp"]))
    check_node_order(recomputing, [shape], recompute=_bad(["mlp"]))


def _bad(value: object) -> Any:
    """``value`` typed ``Any``: a misuse the type checkers would flag, made at run time."""
    return value
