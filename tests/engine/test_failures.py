"""A node failing mid-schedule: position in the error, plans released, next step correct."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import pytest
import torch
from torch import Tensor

from moe_overlap import (
    Microbatch,
    ModelChunkSchedulePlan,
    ScheduleError,
    ScheduleOptions,
    TransformerLayerNode,
    combined_1f1b,
)
from moe_overlap.protocols import SlotFn
from moe_overlap.steps import Slot

from .test_parity import assert_same
from .toy_model import (
    DelayedLinear,
    ToyConfig,
    ToyLayer,
    ToyModel,
    grads,
    make_microbatches,
    plain_step,
)


def register_hook(t: Tensor, hook: Callable[[Tensor], Tensor]) -> None:
    """``Tensor.register_hook`` is untyped in torch; give it a type here."""
    register: Callable[[Callable[[Tensor], Tensor]], object] = t.register_hook
    register(hook)


class Boom(RuntimeError):
    pass


class Trap:
    """Raise once when (slot, direction) is reached for microbatch ``mb``."""

    def __init__(self, slot: Slot, direction: str, mb: int) -> None:
        self.slot, self.direction, self.mb = slot, direction, mb
        self.armed = True

    def hit(self, slot: Slot, direction: str, mb: int | None) -> bool:
        if self.armed and (slot, direction, mb) == (self.slot, self.direction, self.mb):
            self.armed = False
            return True
        return False


def install(model: ToyModel, trap: Trap, layer_index: int) -> None:
    """Wrap the layer's slots so the trap fires in forward, backward or wgrad."""
    layer = model.decoder.layers[layer_index]
    assert isinstance(layer, ToyLayer)
    slots = {
        Slot.PRE_DISPATCH: "slot_pre_dispatch",
        Slot.DISPATCH: "slot_dispatch",
        Slot.MLP: "slot_mlp",
        Slot.COMBINE: "slot_combine",
    }
    for slot, attr in slots.items():
        original = getattr(layer, attr)

        def wrapped(
            node: TransformerLayerNode,
            inputs: tuple[Tensor, ...],
            /,
            *,
            _slot: Slot = slot,
            _orig: SlotFn = original,
        ) -> Tensor | tuple[Tensor, ...]:
            mb = getattr(node, "microbatch_index", None)
            if trap.hit(_slot, "forward", mb):
                raise Boom(f"forward of {_slot.value}")
            out: Tensor | tuple[Tensor, ...] = _orig(node, inputs)
            first = out[0] if isinstance(out, tuple) else out
            if first.requires_grad and trap.direction == "backward" and trap.slot is _slot:

                def hook(g: Tensor) -> Tensor:
                    if trap.hit(_slot, "backward", mb):
                        raise Boom(f"backward of {_slot.value}")
                    return g

                register_hook(first, hook)
            return out

        setattr(layer, attr, wrapped)
    if trap.direction == "wgrad":
        lin = layer.attn if trap.slot is Slot.PRE_DISPATCH else layer.up[0]
        assert isinstance(lin, DelayedLinear)
        original_dw = lin.backward_dw
        state = {"calls": 0}

        def failing_dw() -> None:
            mb = state["calls"]
            state["calls"] += 1
            if trap.hit(trap.slot, "wgrad", mb):
                raise Boom("wgrad")
            original_dw()

        lin.backward_dw = failing_dw  # type: ignore[method-assign]


def tag_microbatches(plan: ModelChunkSchedulePlan) -> None:
    for lp in plan.layers:
        for node in lp.nodes.values():
            node.microbatch_index = plan.microbatch_index  # type: ignore[attr-defined]  # pyright: ignore[reportAttributeAccessIssue]


def discard_pending(model: ToyModel) -> None:
    for m in model.modules():
        if isinstance(m, DelayedLinear):
            m.pending.clear()


CASES = [
    (Slot.PRE_DISPATCH, "forward", 1),
    (Slot.DISPATCH, "forward", 2),
    (Slot.MLP, "forward", 0),
    (Slot.COMBINE, "forward", 1),
    (Slot.PRE_DISPATCH, "backward", 1),
    (Slot.DISPATCH, "backward", 0),
    (Slot.MLP, "backward", 2),
    (Slot.COMBINE, "backward", 1),
    (Slot.PRE_DISPATCH, "wgrad", 1),
    (Slot.MLP, "wgrad", 0),
]


@pytest.mark.parametrize(("slot", "direction", "mb"), CASES)
def test_failure_in_each_slot(slot: Slot, direction: str, mb: int) -> None:
    config = ToyConfig()
    ref = ToyModel(config, "mm")
    model = copy.deepcopy(ref)
    model.set_delay(True)
    install(model, Trap(slot, direction, mb), layer_index=1)
    mbs = make_microbatches(3, config)
    plans: list[ModelChunkSchedulePlan] = []

    def on_plan(plan: ModelChunkSchedulePlan) -> None:
        plans.append(plan)
        tag_microbatches(plan)

    options = ScheduleOptions(delay_wgrad_compute=True)
    with pytest.raises(ScheduleError) as info:
        combined_1f1b(model, mbs, options=options, on_plan=on_plan)
    err = info.value
    assert isinstance(err.__cause__, Boom)
    role = "forward" if direction == "forward" else "backward"
    assert f"{role} microbatch {mb}, layer 1, slot {slot.value}, {direction}" in str(err)
    assert "<-- ERROR HERE" in str(err)
    assert err.position in str(err)
    assert all(p.released for p in plans), "every plan is released after a failure"

    # The model trains correctly on the next step once the failed step's grads are dropped.
    model.zero_grad(set_to_none=True)
    discard_pending(model)
    next_mbs = make_microbatches(3, config, seed=7)
    plain_step(ref, next_mbs)
    losses = combined_1f1b(model, next_mbs, options=options)
    assert len(losses) == 3
    assert_same(grads(model), grads(ref))


def test_failure_in_preprocess_names_the_model() -> None:
    config = ToyConfig()
    model = ToyModel(config, "m")

    def bad_preprocess(*args: object, **kwargs: object) -> tuple[object, ...]:
        return (torch.ones(1),)

    model._preprocess = bad_preprocess  # type: ignore[method-assign]
    with pytest.raises(ScheduleError, match=r"ToyModel\._preprocess: expected a 6-tuple") as info:
        combined_1f1b(model, make_microbatches(1, config))
    assert "slot pre_process, forward" in str(info.value)


def test_non_scalar_loss_is_rejected() -> None:
    config = ToyConfig()
    model = ToyModel(config, "m")
    mbs: Sequence[Microbatch] = [
        Microbatch(input_ids=mb.input_ids, position_ids=mb.position_ids)
        for mb in make_microbatches(2, config)
    ]
    with pytest.raises(Exception, match="must return a scalar loss") as info:
        combined_1f1b(model, mbs)
    assert type(info.value).__name__ == "IntegrationError"


def test_a_consensus_group_of_one_rank_changes_nothing() -> None:
    """One rank: nothing can be in flight elsewhere, so the failure is raised as it is and
    the next step is exact (the multi-rank votes: ``tests/models/test_ep_failures.py``)."""
    import torch.distributed as dist
    from torch.distributed import HashStore  # type: ignore[attr-defined]  # pyright: ignore[reportPrivateImportUsage]

    config = ToyConfig()
    ref = ToyModel(config, "mm")
    model = copy.deepcopy(ref)
    install(model, Trap(Slot.MLP, "forward", 1), layer_index=1)
    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        group = dist.new_group([0], backend="gloo")
        assert isinstance(group, dist.ProcessGroup)
        with pytest.raises(ScheduleError) as info:
            combined_1f1b(
                model, make_microbatches(3, config), on_plan=tag_microbatches, consensus_group=group
            )
        assert isinstance(info.value.__cause__, Boom)
        assert "combined_1f1b step" not in str(info.value)  # its own error, unchanged
        model.zero_grad(set_to_none=True)
        next_mbs = make_microbatches(3, config, seed=7)
        plain_step(ref, next_mbs)
        combined_1f1b(model, next_mbs, consensus_group=group)
        assert_same(grads(model), grads(ref))
    finally:
        dist.destroy_process_group()
