"""The error catalogue: every misuse, its exception type and message, and that the model
still trains correctly on the next step. ``docs/errors.md`` lists the same case ids."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

import moe_overlap as mo
from moe_overlap import (
    ConfigError,
    CpuEvent,
    CpuStream,
    IntegrationError,
    LayerArgs,
    LayerState,
    Microbatch,
    ModelChunkSchedulePlan,
    NodeStateError,
    PlanReleasedError,
    ScheduleError,
    ScheduleNode,
    Step,
    StreamError,
    TransformerLayerNode,
    WgradError,
    combined_1f1b,
    make_streams,
    weak_method,
)
from moe_overlap._streams import use_stream

from .test_parity import assert_same
from .toy_model import ToyConfig, ToyLayer, ToyModel, grads, make_microbatches, plain_step

CONFIG = ToyConfig()


@dataclass
class Ctx:
    model: ToyModel
    mbs: list[Microbatch]


def cpu() -> CpuStream:
    return CpuStream()


def plan(ctx: Ctx, i: int = 0) -> ModelChunkSchedulePlan:
    mb = ctx.mbs[i]
    return ModelChunkSchedulePlan(
        ctx.model, mb.input_ids, mb.position_ids, None, labels=mb.labels, microbatch=i
    )


def patch(obj: object, name: str, value: object) -> None:
    setattr(obj, name, value)


def layer0(ctx: Ctx) -> ToyLayer:
    layer = ctx.model.decoder.layers[0]
    assert isinstance(layer, ToyLayer)
    return layer


# --- the misuses ---------------------------------------------------------------------------


def preprocess_wrong_arity(ctx: Ctx) -> None:
    patch(ctx.model, "_preprocess", lambda *a, **k: (torch.ones(1), None))
    combined_1f1b(ctx.model, ctx.mbs)


def preprocess_not_a_tuple(ctx: Ctx) -> None:
    patch(ctx.model, "_preprocess", lambda *a, **k: torch.ones(1))
    combined_1f1b(ctx.model, ctx.mbs)


def preprocess_decoder_input_not_tensor(ctx: Ctx) -> None:
    patch(ctx.model, "_preprocess", lambda *a, **k: ([1.0], None, None, None, None, None))
    combined_1f1b(ctx.model, ctx.mbs)


def preprocess_bad_rotary(ctx: Ctx) -> None:
    patch(ctx.model, "_preprocess", lambda *a, **k: (torch.ones(1), "rope", None, None, None, None))
    combined_1f1b(ctx.model, ctx.mbs)


def postprocess_not_tensor(ctx: Ctx) -> None:
    patch(ctx.model, "_postprocess", lambda *a, **k: 3.0)
    combined_1f1b(ctx.model, ctx.mbs)


def postprocess_not_scalar(ctx: Ctx) -> None:
    mbs = [Microbatch(input_ids=m.input_ids, position_ids=m.position_ids) for m in ctx.mbs]
    combined_1f1b(ctx.model, mbs)  # no labels: _postprocess returns logits


def slot_returns_non_tensor(ctx: Ctx) -> None:
    patch(layer0(ctx), "slot_mlp", lambda node, inputs: "oops")
    combined_1f1b(ctx.model, ctx.mbs)


def slot_raises(ctx: Ctx) -> None:
    def boom(node: TransformerLayerNode, inputs: tuple[Tensor, ...]) -> Tensor:
        raise RuntimeError("expert kernel failed")

    patch(layer0(ctx), "slot_dispatch", boom)
    combined_1f1b(ctx.model, ctx.mbs)


def hook_raises(ctx: Ctx) -> None:
    p0 = plan(ctx)

    def bad_hook(stage: int | None) -> None:
        raise RuntimeError("p2p recv failed")

    ModelChunkSchedulePlan.run(p0, None, pre_forward=bad_hook)


def model_missing_members(ctx: Ctx) -> None:
    combined_1f1b(object(), ctx.mbs)  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]


def layer_missing_slot(ctx: Ctx) -> None:
    class NoCombine(torch.nn.Module):
        is_moe = True

    ctx.model.decoder.layers.append(NoCombine())
    try:
        combined_1f1b(ctx.model, ctx.mbs)
    finally:
        del ctx.model.decoder.layers[-1]


def no_microbatches(ctx: Ctx) -> None:
    combined_1f1b(ctx.model, [])


def microbatch_wrong_type(ctx: Ctx) -> None:
    bad: Any = [{"input_ids": ctx.mbs[0].input_ids}]
    combined_1f1b(ctx.model, bad)


def backward_plan_without_grad(ctx: Ctx) -> None:
    p0 = plan(ctx)
    ModelChunkSchedulePlan.run(None, p0)


def plan_reused_after_release(ctx: Ctx) -> None:
    p0 = plan(ctx)
    loss = ModelChunkSchedulePlan.run(p0, None)
    assert loss is not None
    ModelChunkSchedulePlan.run(None, p0, b_grad=torch.ones_like(loss))
    ModelChunkSchedulePlan.run(p0, None)


def backward_before_forward(ctx: Ctx) -> None:
    ScheduleNode(lambda x: x, cpu, CpuEvent(), name="n").backward(torch.ones(1))


def node_run_twice(ctx: Ctx) -> None:
    node = ScheduleNode(lambda x: x * 2, cpu, CpuEvent(), name="n")
    node.forward(torch.ones(1, requires_grad=True))
    node.forward(torch.ones(1, requires_grad=True))


def grad_count_mismatch(ctx: Ctx) -> None:
    node = ScheduleNode(lambda x: x * 2, cpu, CpuEvent(), name="n")
    node.forward(torch.ones(1, requires_grad=True))
    node.backward(torch.ones(1), torch.ones(1))


def backward_dw_twice(ctx: Ctx) -> None:
    node = TransformerLayerNode(
        cpu,
        CpuEvent(),
        LayerState(),
        mo.ChunkState(),
        lambda n, i: i[0],
        "mlp",
        None,
        LayerArgs(config=CONFIG, delay_wgrad_compute=True),
    )
    node.backward_dw()
    node.backward_dw()


def unknown_extra_args_key(ctx: Ctx) -> None:
    LayerArgs.from_mapping({"config": CONFIG, "is_moe": True, "num_experts": 8})


def extra_args_wrong_type(ctx: Ctx) -> None:
    LayerArgs.from_mapping({"config": CONFIG, "is_first_layer": 1})


def extra_args_without_config(ctx: Ctx) -> None:
    LayerArgs.from_mapping({"is_moe": True})


def unknown_slot_name(ctx: Ctx) -> None:
    Step.parse("f.L0.attention.F@comp")


def streams_for_another_device(ctx: Ctx) -> None:
    make_streams("meta")


def event_stream_mismatch(ctx: Ctx) -> None:
    fake: Any = object()
    with use_stream(CpuStream(), fake):
        pass


def unrecorded_event_timing(ctx: Ctx) -> None:
    CpuEvent().elapsed_time(CpuEvent())


def weak_method_on_function(ctx: Ctx) -> None:
    weak_method(print)


def layer_state_missing_key(ctx: Ctx) -> None:
    LayerState().take("route", object)


def layer_state_wrong_kind(ctx: Ctx) -> None:
    state = LayerState()
    state.stash("route", 1)
    state.take("route", str)


@dataclass(frozen=True)
class Case:
    fn: Callable[[Ctx], None]
    raises: type[BaseException]
    match: str
    cause: type[BaseException] | None = None

    @property
    def id(self) -> str:
        return self.fn.__name__


CASES = [
    Case(
        preprocess_wrong_arity,
        ScheduleError,
        r"ToyModel\._preprocess: expected a 6-tuple.*length 2",
        IntegrationError,
    ),
    Case(
        preprocess_not_a_tuple,
        ScheduleError,
        r"_preprocess: expected a PreprocessOutput or a 6-tuple.*received Tensor",
        IntegrationError,
    ),
    Case(
        preprocess_decoder_input_not_tensor,
        ScheduleError,
        r"decoder_input must be a Tensor, received list",
        IntegrationError,
    ),
    Case(
        preprocess_bad_rotary,
        ScheduleError,
        r"rotary_pos_emb must be a Tensor or None, received str",
        IntegrationError,
    ),
    Case(
        postprocess_not_tensor,
        ScheduleError,
        r"ToyModel\._postprocess: expected a Tensor, received float",
        IntegrationError,
    ),
    Case(
        postprocess_not_scalar, IntegrationError, r"must return a scalar loss.*shape \(2, 8, 32\)"
    ),
    Case(
        slot_returns_non_tensor,
        ScheduleError,
        r"'mlp': forward must return a Tensor or a tuple of Tensors, received str",
        IntegrationError,
    ),
    Case(
        slot_raises,
        ScheduleError,
        r"forward microbatch 0, layer 0, slot dispatch, forward.*expert kernel failed",
        RuntimeError,
    ),
    Case(hook_raises, ScheduleError, r"slot pre_forward, hook.*p2p recv failed", RuntimeError),
    Case(
        model_missing_members,
        IntegrationError,
        r"object is not a PreprocessableModel; missing members: \['pre_process'",
    ),
    Case(
        layer_missing_slot,
        IntegrationError,
        r"layers\[2\]: NoCombine is not a SchedulableLayer; missing members: \['config'",
    ),
    Case(no_microbatches, ConfigError, r"expected at least one microbatch"),
    Case(
        microbatch_wrong_type, ConfigError, r"microbatches\[0\] must be a Microbatch, received dict"
    ),
    Case(backward_plan_without_grad, IntegrationError, r"a backward plan needs b_grad"),
    Case(plan_reused_after_release, PlanReleasedError, r"microbatch 0 was released"),
    Case(backward_before_forward, NodeStateError, r"node 'n': backward must run after forward"),
    Case(
        node_run_twice,
        NodeStateError,
        r"node 'n': forward expected a new node, but it is forwarded",
    ),
    Case(
        grad_count_mismatch,
        NodeStateError,
        r"expected 1 output grads \(one per forward output\), received 2",
    ),
    Case(backward_dw_twice, WgradError, r"layer node 'mlp': backward_dw called twice"),
    Case(unknown_extra_args_key, ConfigError, r"unknown extra_args keys \['num_experts'\]"),
    Case(
        extra_args_wrong_type,
        ConfigError,
        r"extra_args\['is_first_layer'\] must be a bool, received int 1",
    ),
    Case(
        extra_args_without_config,
        ConfigError,
        r"extra_args\['config'\] must have moe_token_dispatcher_type",
    ),
    Case(unknown_slot_name, ConfigError, r"unknown slot or stream in 'f\.L0\.attention\.F@comp'"),
    Case(
        streams_for_another_device, StreamError, r"expected a 'cpu' or 'cuda' device, received meta"
    ),
    Case(event_stream_mismatch, StreamError, r"paired with a CUDA event"),
    Case(unrecorded_event_timing, StreamError, r"both events must be recorded first"),
    Case(
        weak_method_on_function,
        IntegrationError,
        r"expected a bound method, received <built-in function print>",
    ),
    Case(layer_state_missing_key, IntegrationError, r"nothing stashed under 'route'"),
    Case(layer_state_wrong_kind, IntegrationError, r"'route' holds a int, expected a str"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_misuse(case: Case) -> None:
    ref = ToyModel(CONFIG, "mm")
    model = copy.deepcopy(ref)
    ctx = Ctx(model, make_microbatches(2, CONFIG))
    with pytest.raises(case.raises, match=re.compile(case.match, re.DOTALL)) as info:
        case.fn(ctx)
    assert isinstance(info.value, mo.MoeOverlapError)
    if case.cause is not None:
        assert isinstance(info.value.__cause__, case.cause)
    # The user fixes the misuse (patches removed); the same model object then trains
    # exactly on the next step once the failed step's grads are dropped.
    undo_patches(ctx.model)
    ctx.model.zero_grad(set_to_none=True)
    mbs = make_microbatches(3, CONFIG, seed=5)
    plain_step(ref, mbs)
    combined_1f1b(ctx.model, mbs)
    assert_same(grads(ctx.model), grads(ref))


def undo_patches(model: ToyModel) -> None:
    for name in ("_preprocess", "_postprocess"):
        model.__dict__.pop(name, None)
    for layer in model.decoder.layers:
        for name in ("slot_pre_dispatch", "slot_dispatch", "slot_mlp", "slot_combine"):
            layer.__dict__.pop(name, None)


def test_catalogue_is_documented() -> None:
    doc = Path(__file__).resolve().parents[1] / "docs" / "errors.md"
    if not doc.exists():
        pytest.fail("docs/errors.md is missing")
    text = doc.read_text()
    missing = [c.id for c in CASES if f"`{c.id}`" not in text]
    assert missing == [], f"cases not in docs/errors.md: {missing}"


def test_at_least_twenty_cases() -> None:
    assert len(CASES) >= 20
