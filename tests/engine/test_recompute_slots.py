"""Recomputed layer slots (``ScheduleOptions.recompute``, ``R`` steps): bit-identical to
plain ``backward()`` and to the schedule that keeps its activations, whatever the mode,
delayed wgrad or the place of the ``R`` steps; the activations are gone after forward; the
misuses are refused."""

from __future__ import annotations

import copy
import dataclasses
import random
import weakref
from typing import Any, Literal, cast

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from moe_overlap import (
    ConfigError,
    IntegrationError,
    Microbatch,
    ModelChunkSchedulePlan,
    NodeStateError,
    ScheduleError,
    ScheduleNode,
    ScheduleOptions,
    SlotContext,
    TransformerLayerNode,
    TypeHintError,
    combined_1f1b,
)
from moe_overlap.engine import DEBUG, release_storage
from moe_overlap.engine._guards import BaseGuard, attach
from moe_overlap.models import GPTMoEModel
from moe_overlap.steps import (
    ChunkShape,
    Direction,
    LayerShape,
    PairKind,
    PairOrder,
    Role,
    ScheduleOrder,
    Slot,
    Step,
    backward_pair_steps,
    layer_pair_steps,
)
from moe_overlap.streams import CpuEvent, CpuStream, stream_order_check
from tests.models._helpers import SMALL, assert_matches_plain
from tests.torch_state import seeded as _seeded

from .test_order import sample_orders
from .test_parity import assert_same
from .toy_model import ToyConfig, ToyLayer, ToyModel, grads, make_microbatches, plain_step

KINDS = "mdt"
"""MoE, dense and MTP layers: every kind of layer plan."""
MODES = ("serial", "overlapped", "fill_drain")
Name = Literal["pre_dispatch", "mlp"]
RECOMPUTE: dict[str, tuple[Name, ...]] = {
    "mlp": ("mlp",),
    "pre_dispatch": ("pre_dispatch",),
    "both": ("pre_dispatch", "mlp"),
}
R = Direction.RECOMPUTE


def with_recomputes(order: PairOrder, where: str, seed: int = 0) -> PairOrder:
    """``order`` with every recompute step its kind allows: all first (``early``), or each
    at a random place before its backward (``random``)."""
    from moe_overlap.engine.core._order import optional

    steps = list(order.steps)
    rng = random.Random(seed)
    for r in sorted(optional(order.kind), key=str):
        if where == "early":
            steps.insert(0, r)
        else:
            steps.insert(rng.randint(0, steps.index(r._replace(direction=Direction.BACKWARD))), r)
    return PairOrder(order.kind, steps)


def recompute_order(where: str | None, seed: int = 0) -> ScheduleOrder:
    """Megatron-Core's orders (``early``) or random valid ones (``random``), with ``R`` steps."""
    if where is None:
        return ScheduleOrder()
    base = sample_orders(seed) if where == "random" else ScheduleOrder()
    return ScheduleOrder(
        mixed=with_recomputes(base.of(PairKind.MIXED), where, seed),
        forwards=base.forwards,
        backwards=with_recomputes(base.of(PairKind.BACKWARDS), where, seed + 1),
    )


class _Timer:
    def __init__(self, log: list[tuple[Step, str]], step: Step) -> None:
        self.log, self.step = log, step

    def start(self, stream: object) -> None:
        del stream
        self.log.append((self.step, "start"))

    def stop(self, stream: object) -> None:
        del stream
        self.log.append((self.step, "stop"))


class Steps:
    """A StepObserver recording every step run and each timer call."""

    def __init__(self) -> None:
        self.steps: list[Step] = []
        self.timed: list[tuple[Step, str]] = []

    def timer(self, step: Step, microbatch: int | None) -> _Timer:
        del microbatch
        self.steps.append(step)
        return _Timer(self.timed, step)


def _run(
    mode: str,
    recompute: tuple[Name, ...],
    delay: bool,
    order: ScheduleOrder,
    *,
    kinds: str = KINDS,
    n_mb: int = 4,
) -> tuple[ToyModel, list[Tensor], Steps]:
    config = ToyConfig(shared_expert=True)
    model = ToyModel(config, kinds)
    model.set_delay(delay)
    options = ScheduleOptions(delay_wgrad_compute=delay, order=order, recompute=recompute)
    observer = Steps()
    mbs = make_microbatches(n_mb, config)
    losses = combined_1f1b(
        model,
        mbs,
        options=options,
        observer=observer,
        overlap=mode != "serial",
        fill_drain=mode == "fill_drain",
    )
    assert model.pending_wgrad == 0
    return model, losses, observer


CASES = [
    (mode, name, delay, where)
    for mode in MODES
    for name in RECOMPUTE
    for delay in (False, True)
    for where in ((None,) if mode == "serial" else (None, "early", "random"))
]


@pytest.mark.parametrize(("mode", "name", "delay", "where"), CASES)
def test_recomputed_slots_are_bit_identical(
    mode: str, name: str, delay: bool, where: str | None
) -> None:
    """Equal to plain per-microbatch backward() and to the same schedule keeping its
    activations; ``where``: R steps none (recompute at the backward), first, or random."""
    config = ToyConfig(shared_expert=True)
    ref = ToyModel(config, KINDS)
    want = plain_step(ref, make_microbatches(4, config))
    order = recompute_order(where, seed=len(name) + 10 * delay)
    kept, kept_losses, _ = _run(mode, (), delay, order)
    model, losses, observer = _run(mode, RECOMPUTE[name], delay, order)
    assert all(torch.equal(a, b) for a, b in zip(losses, want, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(losses, kept_losses, strict=True))
    assert_same(grads(model), grads(ref))
    assert_same(grads(model), grads(kept))
    r_steps = [s for s in observer.steps if s.direction is R]
    if where is None or mode == "serial":
        assert not r_steps  # recomputed at the backward
    else:
        assert r_steps
        assert {s.slot for s in r_steps} == {Slot(s) for s in RECOMPUTE[name]}
        assert {s.layer for s in r_steps} <= {0, 1, 2}
        for s in r_steps:  # timed like the other directions
            assert observer.timed.count((s, "start")) == observer.timed.count((s, "stop")) > 0


def test_an_order_s_r_steps_of_slots_not_recomputed_are_left_out() -> None:
    order = recompute_order("early")
    _, _, observer = _run("overlapped", (), False, order)
    assert not [s for s in observer.steps if s.direction is R]
    shape = LayerShape(index=3, is_moe=True, order=order, recompute=(Slot.MLP,))
    steps = [str(s) for s in layer_pair_steps(shape, shape)]
    assert steps[0] == "b.L3.mlp.R@comp"  # the order lists b.pre_dispatch.R first
    assert "b.L3.pre_dispatch.R@comp" not in steps
    assert not [s for s in layer_pair_steps(shape, None) if s.direction is R]  # f alone
    chunk = ChunkShape(layers=(shape,))
    drained = [str(s) for s in backward_pair_steps(chunk, chunk)]
    assert sorted(s for s in drained if s.endswith(".R@comp")) == [
        "b.L3.mlp.R@comp",
        "c.L3.mlp.R@comp",
    ]
    with pytest.raises(ConfigError, match=r"LayerShape\(index=0\): expected recompute to hold"):
        LayerShape(index=0, is_moe=True, recompute=(Slot.DISPATCH,))


def test_guards_see_the_recompute_enter_and_leave_its_node() -> None:
    entered: list[tuple[str, str]] = []
    left: list[str] = []

    class Watch(BaseGuard):
        def node_entered(self, node: ScheduleNode, direction: str) -> None:
            entered.append((node.name, direction))

        def node_left(self, node: ScheduleNode) -> None:
            left.append(node.name)

    detach = attach(Watch(), debug=False)
    try:
        _, _, observer = _run("overlapped", ("pre_dispatch", "mlp"), True, recompute_order("early"))
    finally:
        detach()
    r_steps = [s for s in observer.steps if s.direction is R]
    recomputes = [name for name, direction in entered if direction == "recompute"]
    assert len(recomputes) == len(r_steps) > 0
    assert set(recomputes) == {"pre_dispatch_computation", "mlp"}
    assert len(entered) == len(left)


# -- the activations go ----------------------------------------------------------------------


class _Box:
    """What autograd keeps for one saved tensor (alive as long as the graph holding it)."""

    __slots__ = ("__weakref__", "t")

    def __init__(self, t: Tensor) -> None:
        self.t = t


class _SavedBytes(Steps):
    """Tags each tensor autograd saves with the step running (its timer started)."""

    def __init__(self) -> None:
        super().__init__()
        self.running: Step | None = None
        self.saved: list[tuple[Step | None, weakref.ref[_Box], int]] = []

    def timer(self, step: Step, microbatch: int | None) -> _Timer:
        outer = self

        class Tagging(_Timer):
            def start(self, stream: object) -> None:
                outer.running = step

            def stop(self, stream: object) -> None:
                outer.running = None

        super().timer(step, microbatch)
        return Tagging(self.timed, step)

    def pack(self, t: Tensor) -> _Box:
        box = _Box(t.detach())  # not t: its graph would hold the box, a cycle gc cannot see
        self.saved.append((self.running, weakref.ref(box), t.numel() * t.element_size()))
        return box

    @staticmethod
    def unpack(box: _Box) -> Tensor:
        return box.t

    def alive(self, slot: Slot, direction: Direction) -> int:
        """Bytes still saved by the graphs of ``slot``'s steps in ``direction``."""
        return sum(
            n
            for step, ref, n in self.saved
            if step is not None
            and step.slot is slot
            and step.direction is direction
            and ref() is not None
        )


@pytest.mark.parametrize("name", sorted(RECOMPUTE))
def test_a_recomputed_slot_s_activations_are_gone_after_forward(name: str) -> None:
    config = ToyConfig(shared_expert=True)
    ref = ToyModel(config, "mm")
    model = copy.deepcopy(ref)
    mbs = make_microbatches(1, config)
    want = plain_step(ref, mbs)
    held: dict[tuple[Name, ...], dict[Slot, int]] = {}
    for recompute in ((), RECOMPUTE[name]):
        observer = _SavedBytes()
        # free_input off: the boxes hold tensors over the inputs a freeing slot would
        # release, which its check would (rightly) refuse.
        options = ScheduleOptions(recompute=recompute, free_input=False)
        plan = ModelChunkSchedulePlan(model, mbs[0], options=options, index=0)
        with torch.autograd.graph.saved_tensors_hooks(observer.pack, observer.unpack):
            loss = ModelChunkSchedulePlan.run(plan, None, observer=observer)
            assert loss is not None
            held[recompute] = {
                s: observer.alive(s, Direction.FORWARD) for s in (Slot.PRE_DISPATCH, Slot.MLP)
            }
            ModelChunkSchedulePlan.run(None, plan, torch.ones_like(loss), observer=observer)
        assert torch.equal(loss.detach(), want[0])
        assert not [ref for _, ref, _ in observer.saved if ref() is not None]  # all freed
        if recompute:
            assert_same(grads(model), grads(ref))
        for p in model.parameters():
            p.grad = None
    kept, dropped = held[()], held[RECOMPUTE[name]]
    for slot in (Slot.PRE_DISPATCH, Slot.MLP):
        assert kept[slot] > 0  # what the test would see if the graph stayed
        if slot.value in RECOMPUTE[name]:
            assert dropped[slot] == 0, f"{slot.value}: {dropped[slot]} bytes still saved"
        else:
            assert dropped[slot] == kept[slot]


def test_a_recomputed_slot_keeps_its_inputs() -> None:
    config = ToyConfig()  # four local experts: mlp frees its input unless recomputed
    model = ToyModel(config, "m")
    (mb,) = make_microbatches(1, config)
    plain = ModelChunkSchedulePlan(model, mb)
    kept = ModelChunkSchedulePlan(model, mb, options=ScheduleOptions(recompute=("mlp",)))
    frees, node = plain.layers[0].nodes[Slot.MLP], kept.layers[0].nodes[Slot.MLP]
    assert frees.free_input and not node.free_input
    assert isinstance(node, TransformerLayerNode)
    assert node.recomputes
    plain.release_state()
    kept.release_state()


# -- refusals ----------------------------------------------------------------------------------


def _plan(recompute: tuple[Name, ...] = ("mlp",)) -> tuple[ModelChunkSchedulePlan, ToyModel]:
    config = ToyConfig()
    model = ToyModel(config, "m")
    (mb,) = make_microbatches(1, config)
    options = ScheduleOptions(recompute=recompute)
    return ModelChunkSchedulePlan(model, mb, options=options, index=0), model


_PHASE = (
    r"node 'mlp': a recompute step \(R\) expected a forwarded node not yet recomputed .*but it is "
)


def test_recompute_runs_once_between_forward_and_backward() -> None:
    plan, _ = _plan()
    mlp = plan.layers[0].nodes[Slot.MLP]
    pre = plan.layers[0].nodes[Slot.PRE_DISPATCH]
    with pytest.raises(NodeStateError, match=_PHASE + "new"):
        mlp.recompute()
    loss = ModelChunkSchedulePlan.run(plan, None)
    assert loss is not None
    mlp.recompute()
    with pytest.raises(NodeStateError, match=_PHASE + "recomputed"):
        mlp.recompute()
    with pytest.raises(NodeStateError, match="expected a node whose slot is recomputed"):
        pre.recompute()  # a slot that keeps its activations
    ModelChunkSchedulePlan.run(None, plan, torch.ones_like(loss))
    with pytest.raises(NodeStateError, match=_PHASE + "done"):
        mlp.recompute()


def test_a_recompute_waits_for_its_microbatch_s_event_and_records_none() -> None:
    """Only the slot's own backward, later on the same stream, reads a recompute, so the
    microbatch's next steps on the other stream (its combine backward) do not wait for it:
    the recompute records no event (the planner's model of an early recompute)."""
    plan, _ = _plan()
    loss = ModelChunkSchedulePlan.run(plan, None)
    assert loss is not None
    mlp = plan.layers[0].nodes[Slot.MLP]
    calls: list[str] = []

    class Spy(CpuEvent):
        __slots__ = ()

        def wait(self, stream: CpuStream | None = None) -> None:
            calls.append("wait")
            super().wait(stream)

        def record(self, stream: CpuStream | None = None) -> None:
            calls.append("record")
            super().record(stream)

    event, mlp.event = mlp.event, Spy()
    try:
        mlp.recompute()
    finally:
        mlp.event = event
    assert calls == ["wait"]
    ModelChunkSchedulePlan.run(None, plan, torch.ones_like(loss))


def test_a_recompute_leaves_the_layer_state_as_it_found_it() -> None:
    plan, _ = _plan(("pre_dispatch",))
    loss = ModelChunkSchedulePlan.run(plan, None)
    assert loss is not None
    state = plan.layers[0].layer_state
    route, probs, residual = state.extras["route"], state.dispatched_probs, state.residual
    assert residual is None  # combine dropped it
    plan.layers[0].nodes[Slot.PRE_DISPATCH].recompute()  # keeps it again, then undone
    assert (state.residual, state.extras["route"], state.dispatched_probs) == (None, route, probs)
    assert not state.fresh
    ModelChunkSchedulePlan.run(None, plan, torch.ones_like(loss))


@pytest.mark.parametrize("done", ["released", "written in place"])
def test_an_input_released_or_written_since_the_forward_is_refused(done: str) -> None:
    plan, _ = _plan()
    loss = ModelChunkSchedulePlan.run(plan, None)
    assert loss is not None
    mlp = plan.layers[0].nodes[Slot.MLP]
    (x,) = mlp.inputs
    assert x is not None
    if done == "released":
        release_storage(x)
    else:
        with torch.no_grad():
            x.mul_(1.0)  # the same values: only the version counter says it
    with pytest.raises(IntegrationError, match=f"node 'mlp': recompute: input 0 .* was {done}"):
        mlp.recompute()
    plan.release_state()


class _Fickle(ToyLayer):
    """Hands on something else the second time a slot runs (``how``)."""

    how: str = ""
    runs: tuple[int, int] = (0, 0)

    def slot_pre_dispatch(
        self, node: SlotContext, inputs: tuple[Tensor, ...], /
    ) -> Tensor | tuple[Tensor, ...]:
        self.runs = (self.runs[0] + 1, self.runs[1])
        if self.runs[0] > 1 and self.how == "detach":
            (x,) = inputs
            node.detach(x.double())
        return super().slot_pre_dispatch(node, inputs)

    def slot_mlp(
        self, node: SlotContext, inputs: tuple[Tensor, ...], /
    ) -> Tensor | tuple[Tensor, ...]:
        self.runs = (self.runs[0], self.runs[1] + 1)
        out = super().slot_mlp(node, inputs)
        assert isinstance(out, Tensor)
        if self.runs[1] == 1 or self.how == "detach":
            return out
        return out[:, :-1] if self.how == "shape" else (out, out)


@pytest.mark.parametrize(
    ("how", "slot", "match"),
    [
        (
            "detach",
            "pre_dispatch",
            r"node.detach call 0 is float64\[2, 8, 16\] .*the forward's was float32",
        ),
        ("shape", "mlp", r"output 0 is float32\[32, 15\].*the forward's was float32\[32, 16\]"),
        ("count", "mlp", "called node.detach 0 times and returned 2 tensors, its forward 0 and 1"),
    ],
)
def test_a_slot_that_hands_on_something_else_the_second_time_is_refused(
    how: str, slot: Name, match: str
) -> None:
    config = ToyConfig()
    model = ToyModel(config, "m")
    layer = model.decoder.layers[0]
    layer.__class__ = _Fickle
    assert isinstance(layer, _Fickle)
    layer.how = how
    options = ScheduleOptions(recompute=(slot,))
    with pytest.raises(
        ScheduleError, match=f"failed with IntegrationError: .*recompute: .*{match}"
    ):
        combined_1f1b(model, make_microbatches(1, config), options=options)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (
            ("dispatch",),
            "item 0 is str 'dispatch': dispatch is communication: recomputing it would repeat an all-to-all",
        ),
        ((Slot.COMBINE,), "combine is communication"),
        (
            ("mtp_post",),
            "mtp_post: the schedule recomputes the pre_dispatch and mlp slots of a layer only",
        ),
        (("attention",), "item 0 is str 'attention': not a slot's name"),
        ("mlp", r"received str 'mlp'; e.g. recompute=\('pre_dispatch', 'mlp'\)"),
        ((1,), "item 0 is int 1"),
    ],
)
def test_recompute_options_are_checked(value: object, match: str) -> None:
    given: Any = value
    hinted = isinstance(value, tuple) and all(
        isinstance(v, Slot) or v in ("pre_dispatch", "mlp")
        for v in cast("tuple[object, ...]", value)
    )
    if DEBUG and not hinted:  # debug mode: beartype refuses what the annotation does not allow
        with pytest.raises(TypeHintError, match="parameter recompute="):
            ScheduleOptions(recompute=given)
        return
    with pytest.raises(
        ConfigError,
        match=r"ScheduleOptions.recompute: expected a collection of the layer slots to recompute.*"
        + match,
    ):
        ScheduleOptions(recompute=given)


def test_recompute_options_are_stored_as_slots_in_the_layer_s_order() -> None:
    assert ScheduleOptions().recompute == ()
    assert ScheduleOptions(recompute=("mlp", "pre_dispatch", "mlp")).recompute == (
        Slot.PRE_DISPATCH,
        Slot.MLP,
    )
    assert ScheduleOptions(recompute=(Slot.MLP,)).recompute == (Slot.MLP,)


@pytest.mark.parametrize(
    ("kind", "edit", "match"),
    [
        (
            PairKind.MIXED,
            "after:b.mlp.R,b.mlp.B",
            r"b.mlp.R before b.mlp.B \(a slot is recomputed before its backward",
        ),
        (
            PairKind.BACKWARDS,
            "after:c.pre_dispatch.R,c.pre_dispatch.B",
            "c.pre_dispatch.R before c.pre_dispatch.B",
        ),
        (
            PairKind.MIXED,
            "add:f.mlp.R",
            r"and any of \['b.mlp.R', 'b.pre_dispatch.R'\].*not of this kind \['f.mlp.R'\]",
        ),
        (PairKind.MIXED, "add:b.combine.R", r"not of this kind \['b.combine.R'\]"),
        (PairKind.FORWARDS, "add:g.mlp.R", r"not of this kind \['g.mlp.R'\]"),
        (PairKind.MIXED, "twice:b.mlp.R", "expected each step once, received b.mlp.R twice"),
    ],
)
def test_orders_with_misplaced_recompute_steps_are_refused(
    kind: PairKind, edit: str, match: str
) -> None:
    steps = [str(s) for s in PairOrder.megatron(kind).steps]
    how, _, arg = edit.partition(":")
    if how == "after":
        r, b = arg.split(",")
        steps.insert(steps.index(b) + 1, r)
    elif how == "add":
        steps.insert(0, arg)
    else:
        steps[:0] = [arg, arg]
    with pytest.raises(ConfigError, match=match):
        PairOrder(kind, steps)


def test_orders_with_recompute_steps_round_trip() -> None:
    order = recompute_order("random", seed=3)
    assert ScheduleOrder.parse(str(order)) == order
    mixed = order.of(PairKind.MIXED)
    assert PairOrder.parse(PairKind.MIXED, str(mixed)) == mixed
    assert {str(s) for s in mixed.steps if s.direction is R} == {"b.mlp.R", "b.pre_dispatch.R"}
    assert not mixed.is_megatron


# -- compositions --------------------------------------------------------------------------------


class _Dropout(ToyLayer):
    """A toy layer with dropout in its attention and its dense mlp (the random state)."""

    def _attention(self, x_BSH: Tensor, rot_SH: Tensor | None) -> Tensor:
        return F.dropout(super()._attention(x_BSH, rot_SH), p=0.3, training=True)

    def _dense_mlp(self, a_BSH: Tensor) -> Tensor:
        return F.dropout(super()._dense_mlp(a_BSH), p=0.3, training=True)


def dropout_model(config: ToyConfig, kinds: str) -> ToyModel:
    model = ToyModel(config, kinds)
    for layer in model.decoder.layers:
        if type(layer) is ToyLayer:
            layer.__class__ = _Dropout
    return model


@pytest.mark.parametrize("where", [None, "early"])
def test_dropout_recomputes_the_same_mask(where: str | None) -> None:
    """(With ``fill_drain`` a forward that draws is refused: tests/engine/test_random_draws.py.)"""
    config = ToyConfig()
    ref = dropout_model(config, "mdm")
    mbs = make_microbatches(3, config)
    runs: list[tuple[ToyModel, list[Tensor], Tensor]] = []
    cases: list[tuple[tuple[Name, ...], int]] = [((), 0), (("pre_dispatch", "mlp"), 0), ((), 1)]
    for recompute, seed in cases:
        model = copy.deepcopy(ref)
        options = ScheduleOptions(recompute=recompute, order=recompute_order(where))
        with _seeded(seed):
            losses = combined_1f1b(model, mbs, options=options)
            after = torch.get_rng_state()  # the recompute puts the caller's state back
        runs.append((model, losses, after))
    (kept, kept_losses, kept_rng), (model, losses, rng), (_, other_losses, _) = runs
    assert all(torch.equal(a, b) for a, b in zip(losses, kept_losses, strict=True))
    assert_same(grads(model), grads(kept))
    assert torch.equal(rng, kept_rng)
    assert not all(torch.equal(a, b) for a, b in zip(losses, other_losses, strict=True))


def _gpt_batches() -> list[Microbatch]:
    g = torch.Generator().manual_seed(0)
    xs = [torch.randint(0, 64, (2, 8), generator=g) for _ in range(3)]
    return [Microbatch(input_ids=x, labels=x.roll(-1, 1)) for x in xs]


@pytest.mark.parametrize("delay", [False, True])
@pytest.mark.parametrize("chunks", [1, 2])
def test_the_reference_model_recomputes_exactly(delay: bool, chunks: int) -> None:
    """Delayed wgrad also recomputes parts inside the slots (both ways compose)."""
    config = dataclasses.replace(
        SMALL,
        recompute=("attention", "norm", "activation") if delay else (),
        delay_wgrad_compute=delay,
        moe_shared_expert_hidden_size=16,
        dispatcher="loopback" if chunks > 1 else "alltoall",
        moe_a2a_chunks=chunks,
    )
    torch.manual_seed(0)
    model = GPTMoEModel(config)
    plain = copy.deepcopy(model)
    mbs = _gpt_batches()
    recompute: tuple[Name, ...] = ("pre_dispatch", "mlp") if chunks == 1 else ("pre_dispatch",)
    options = dataclasses.replace(
        model.schedule_options(), recompute=recompute, order=recompute_order("random", 5)
    )
    losses = combined_1f1b(model, mbs, options=options, fill_drain=True)
    assert_matches_plain(model, plain, mbs, losses)


def test_the_chunked_dispatcher_s_mlp_refuses_to_run_again() -> None:
    config = dataclasses.replace(SMALL, dispatcher="loopback", moe_a2a_chunks=2)
    model = GPTMoEModel(config)
    options = dataclasses.replace(model.schedule_options(), recompute=("mlp",))
    with pytest.raises(
        ScheduleError, match="chunk 1's tokens were released .*cannot be recomputed"
    ):
        combined_1f1b(model, _gpt_batches(), options=options)


def test_recompute_runs_clean_under_the_stream_order_checker() -> None:
    config = dataclasses.replace(SMALL, dispatcher="loopback")
    model = GPTMoEModel(config)
    options = dataclasses.replace(
        model.schedule_options(),
        recompute=("pre_dispatch", "mlp"),
        order=recompute_order("random", 7),
    )
    with stream_order_check() as checker:
        losses = combined_1f1b(model, _gpt_batches(), options=options, fill_drain=True)
    assert all(bool(torch.isfinite(loss)) for loss in losses)
    assert checker.cross_stream_storages > 0


def test_backward_pair_roles_are_the_backward_roles() -> None:
    from moe_overlap.engine.core._order import optional

    assert {s.role for s in optional(PairKind.BACKWARDS)} == {Role.B, Role.B2}
    assert {s.role for s in optional(PairKind.MIXED)} == {Role.B}
    assert not optional(PairKind.FORWARDS)
