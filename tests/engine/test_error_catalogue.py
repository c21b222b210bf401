"""The error catalogue: every misuse, its exception type and message, and that the model
still trains correctly on the next step. ``docs/errors.md`` lists the same case ids."""

from __future__ import annotations

import copy
import dataclasses
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
    IntegrationError,
    LayerArgs,
    LayerState,
    LayerStateAttributeError,
    Microbatch,
    ModelChunkSchedulePlan,
    NodeStateError,
    PlanReleasedError,
    ScheduleError,
    ScheduleNode,
    ScheduleOptions,
    StreamError,
    TransformerLayerNode,
    TypeHintError,
    WgradError,
    combined_1f1b,
    make_streams,
    weak_method,
)
from moe_overlap.engine import DEBUG
from moe_overlap.engine._use_stream import use_stream
from moe_overlap.megatron import layer_args
from moe_overlap.steps import Step, run_pair
from moe_overlap.streams import CpuEvent, CpuStream
from moe_overlap.wgrad import claim_wgrad
from tests.conftest import DebugPython

from .test_debug_mode import run as run_python
from .test_parity import assert_same
from .toy_model import (
    DelayedLinear,
    Route,
    ToyConfig,
    ToyLayer,
    ToyModel,
    grads,
    make_microbatches,
    plain_step,
)

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
        ctx.model,
        mb,
        index=i,
    )


def patch(obj: object, name: str, value: object) -> None:
    """Set what the types forbid: the misuse under test."""
    setattr(obj, name, value)


def bad(value: object) -> Any:
    """A value of the wrong type, passed where the types forbid it: the misuse under test."""
    return value


def layer0(ctx: Ctx) -> ToyLayer:
    layer = ctx.model.decoder.layers[0]
    assert isinstance(layer, ToyLayer)
    return layer


def moe_layer(ctx: Ctx) -> ToyLayer:
    layer = ctx.model.decoder.layers[1]
    assert isinstance(layer, ToyLayer) and layer.is_moe
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
        mo.ChunkState(mo.Microbatch()),
        lambda n, i: i[0],
        "mlp",
        None,
        LayerArgs(config=CONFIG, delay_wgrad_compute=True),
    )
    node.backward_dw()
    node.backward_dw()


def unknown_extra_args_key(ctx: Ctx) -> None:
    layer_args({"config": CONFIG, "is_moe": True, "num_experts": 8})


def extra_args_wrong_type(ctx: Ctx) -> None:
    layer_args({"config": CONFIG, "is_first_layer": 1})


def extra_args_without_config(ctx: Ctx) -> None:
    layer_args({"is_moe": True})


def unknown_slot_name(ctx: Ctx) -> None:
    Step.parse("f.L0.attention.F@comp")


def streams_for_another_device(ctx: Ctx) -> None:
    make_streams("meta")


def inputs_on_meta(ctx: Ctx) -> None:
    mbs = [
        dataclasses.replace(mb, input_ids=torch.empty(2, 8, dtype=torch.long, device="meta"))
        for mb in ctx.mbs
    ]
    combined_1f1b(ctx.model, mbs)


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


# --- gradients that would go missing (issue: never silently wrong) -------------------------


def delay_option_contradicts_layers(ctx: Ctx) -> None:
    ctx.model.set_delay(True)  # the layers delay and list their modules ...
    combined_1f1b(ctx.model, ctx.mbs, options=ScheduleOptions(delay_wgrad_compute=False))


def delay_option_without_delaying_layers(ctx: Ctx) -> None:
    combined_1f1b(ctx.model, ctx.mbs, options=ScheduleOptions(delay_wgrad_compute=True))


def share(model: ToyModel, owner: object, name: str, value: object) -> None:
    """Set ``owner.<name>`` to what another node uses; ``undo_patches`` puts it back."""
    model.__dict__.setdefault("_shared", []).append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)


def parameter_used_by_two_nodes(ctx: Ctx) -> None:
    model = ctx.model  # the output layer tied to the embedding: post- and pre-process use it
    share(model, model.output, "weight", model.embedding.weight)
    combined_1f1b(model, ctx.mbs)


def backed_by_hand(ctx: Ctx) -> None:
    """Microbatch 0 driven by hand: its forward run, then the run that backs it."""
    p0 = plan(ctx)
    loss = ModelChunkSchedulePlan.run(p0, None)
    assert loss is not None
    ModelChunkSchedulePlan.run(None, p0, b_grad=torch.ones_like(loss))


def parameter_used_by_two_nodes_by_hand(ctx: Ctx) -> None:
    model = ctx.model  # as parameter_used_by_two_nodes, the plans driven by hand
    share(model, model.output, "weight", model.embedding.weight)
    backed_by_hand(ctx)


def delayed_module_listed_by_two_layers(ctx: Ctx) -> None:
    layers = ctx.model.decoder.layers  # both layers list the one attention for delayed wgrad
    share(ctx.model, layers[1], "attn", layers[0].attn)
    ctx.model.set_delay(True)
    combined_1f1b(ctx.model, ctx.mbs, options=ScheduleOptions(delay_wgrad_compute=True))


def grad_hook_on_delayed_weight(ctx: Ctx) -> None:
    ctx.model.set_delay(True)  # autograd would run the hook before backward_dw computes
    weight = layer0(ctx).attn.weight
    hook = weight.register_post_accumulate_grad_hook(lambda p: None)  # type: ignore[no-untyped-call]
    ctx.model.__dict__.setdefault("_handles", []).append(hook)  # undo_patches removes it
    combined_1f1b(ctx.model, ctx.mbs)


def undeclared_delayed_module(ctx: Ctx) -> None:
    layer0(ctx).attn.delay = True  # delays, but the layer does not list it
    combined_1f1b(ctx.model, ctx.mbs)


def pending_wgrad_from_an_earlier_backward(ctx: Ctx) -> None:
    ctx.model.set_delay(True)
    ctx.model(ctx.mbs[0]).backward()  # plain backward: wgrad left pending
    combined_1f1b(ctx.model, ctx.mbs)


def step_under_no_grad(ctx: Ctx) -> None:
    with torch.no_grad():
        combined_1f1b(ctx.model, ctx.mbs)


def freeze(model: ToyModel) -> None:
    """Freeze every parameter; ``undo_patches`` unfreezes them."""
    for p in model.parameters():
        share(model, p, "requires_grad", False)


def every_parameter_frozen(ctx: Ctx) -> None:
    freeze(ctx.model)  # plain loss.backward(): "element 0 of tensors does not require grad"
    combined_1f1b(ctx.model, ctx.mbs)


def loss_no_trainable_parameter_reaches(ctx: Ctx) -> None:
    freeze(ctx.model)  # the one trainable parameter is used by nothing
    ctx.model.register_parameter("unused", None)
    share(ctx.model, ctx.model, "unused", torch.nn.Parameter(torch.zeros(1)))
    combined_1f1b(ctx.model, ctx.mbs)


def every_parameter_frozen_by_hand(ctx: Ctx) -> None:
    freeze(ctx.model)
    backed_by_hand(ctx)


def loss_no_trainable_parameter_reaches_by_hand(ctx: Ctx) -> None:
    freeze(ctx.model)
    ctx.model.register_parameter("unused", None)
    share(ctx.model, ctx.model, "unused", torch.nn.Parameter(torch.zeros(1)))
    backed_by_hand(ctx)


def step_under_inference_mode(ctx: Ctx) -> None:
    with torch.inference_mode():
        combined_1f1b(ctx.model, ctx.mbs)


def step_under_inference_mode_with_enable_grad(ctx: Ctx) -> None:
    with torch.inference_mode(), torch.enable_grad():  # grad mode on, nothing recorded
        combined_1f1b(ctx.model, ctx.mbs)


def run_under_no_grad(ctx: Ctx) -> None:
    p0 = plan(ctx)
    with torch.no_grad():
        ModelChunkSchedulePlan.run(p0, None)


def slot_output_cut_from_graph(ctx: Ctx) -> None:
    layer = layer0(ctx)

    def cut(node: TransformerLayerNode, inputs: tuple[Tensor, ...]) -> Tensor:
        out = ToyLayer.slot_mlp(layer, node, inputs)
        assert isinstance(out, Tensor)
        return out.detach()

    patch(layer, "slot_mlp", cut)
    combined_1f1b(ctx.model, ctx.mbs)


def slot_output_cut_with_delayed_wgrad(ctx: Ctx) -> None:
    ctx.model.set_delay(True)
    layer = layer0(ctx)

    def cut(node: TransformerLayerNode, inputs: tuple[Tensor, ...]) -> Tensor | tuple[Tensor, ...]:
        with torch.no_grad():
            return ToyLayer.slot_mlp(layer, node, inputs)

    patch(layer, "slot_mlp", cut)
    combined_1f1b(ctx.model, ctx.mbs)


def postprocess_loss_cut_from_graph(ctx: Ctx) -> None:
    model = ctx.model
    patch(model, "_postprocess", lambda *a, **k: ToyModel._postprocess(model, *a, **k).detach())
    combined_1f1b(model, ctx.mbs)


def layer_state_tensor_cut_from_graph(ctx: Ctx) -> None:
    layer = moe_layer(ctx)

    def pre_dispatch(node: TransformerLayerNode, inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        rows, probs = ToyLayer.slot_pre_dispatch(layer, node, inputs)
        residual = node.layer_state.residual
        assert residual is not None
        node.layer_state.residual = residual.detach()  # t.detach(), not node.detach(t)
        return rows, probs

    patch(layer, "slot_pre_dispatch", pre_dispatch)
    combined_1f1b(ctx.model, ctx.mbs)


def stashed_tensor_cut_from_graph(ctx: Ctx) -> None:
    layer = moe_layer(ctx)

    def dispatch(
        node: TransformerLayerNode, inputs: tuple[Tensor, ...]
    ) -> Tensor | tuple[Tensor, ...]:
        with torch.no_grad():
            node.layer_state.stash("scale", inputs[1] * 2)  # made under no_grad
        return ToyLayer.slot_dispatch(layer, node, inputs)

    patch(layer, "slot_dispatch", dispatch)
    combined_1f1b(ctx.model, ctx.mbs)


# --- free-input hazards ----------------------------------------------------------------------


def slot_returns_its_freed_input(ctx: Ctx) -> None:
    layer = moe_layer(ctx)
    patch(layer, "slot_dispatch", lambda node, inputs: inputs)  # rows, probs, unchanged
    combined_1f1b(ctx.model, ctx.mbs)


def slot_returns_a_view_of_its_freed_input(ctx: Ctx) -> None:
    layer = moe_layer(ctx)
    patch(layer, "slot_combine", lambda node, inputs: inputs[0][:1])
    combined_1f1b(ctx.model, ctx.mbs)


def slot_hands_on_its_freed_input(ctx: Ctx) -> None:
    layer = moe_layer(ctx)

    def dispatch(node: TransformerLayerNode, inputs: tuple[Tensor, ...]) -> Tensor:
        rows, probs = inputs
        node.layer_state.dispatched_probs = node.detach(probs)  # kept, then freed
        return rows.clone()

    patch(layer, "slot_dispatch", dispatch)
    combined_1f1b(ctx.model, ctx.mbs)


def freed_input_read_in_backward(ctx: Ctx) -> None:
    layer = moe_layer(ctx)

    def pre_dispatch(node: TransformerLayerNode, inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        rows, probs = ToyLayer.slot_pre_dispatch(layer, node, inputs)
        return rows, torch.softmax(probs, dim=0)  # softmax saves its result; dispatch frees it

    patch(layer, "slot_pre_dispatch", pre_dispatch)
    combined_1f1b(ctx.model, ctx.mbs)


# --- conformance at plan build ----------------------------------------------------------------


def decoder_is_a_module_list(ctx: Ctx) -> None:
    decoder = ctx.model.decoder
    patch(ctx.model, "decoder", decoder.layers)
    try:
        combined_1f1b(ctx.model, ctx.mbs)
    finally:
        ctx.model.decoder = decoder


def decoder_without_final_layernorm(ctx: Ctx) -> None:
    del ctx.model.decoder.final_layernorm
    try:
        combined_1f1b(ctx.model, ctx.mbs)
    finally:
        ctx.model.decoder.final_layernorm = None


def decoder_input_tensor_not_a_tensor(ctx: Ctx) -> None:
    patch(ctx.model.decoder, "input_tensor", [1.0])
    try:
        combined_1f1b(ctx.model, ctx.mbs)
    finally:
        ctx.model.decoder.input_tensor = None


def model_config_without_mtp_num_layers(ctx: Ctx) -> None:
    config = ctx.model.config
    patch(ctx.model, "config", object())
    try:
        combined_1f1b(ctx.model, ctx.mbs)
    finally:
        ctx.model.config = config


def stage_flag_not_a_bool(ctx: Ctx) -> None:
    patch(ctx.model, "post_process", 1)
    try:
        combined_1f1b(ctx.model, ctx.mbs)
    finally:
        ctx.model.post_process = True


def layer_config_without_free_input_fields(ctx: Ctx) -> None:
    layer = layer0(ctx)
    config = layer.config
    patch(layer, "config", object())
    try:
        combined_1f1b(ctx.model, ctx.mbs)
    finally:
        layer.config = config


def layer_config_unknown_dispatcher(ctx: Ctx) -> None:
    layer = layer0(ctx)
    config = layer.config
    layer.config = dataclasses.replace(config, moe_token_dispatcher_type="all2all")
    try:
        combined_1f1b(ctx.model, ctx.mbs)
    finally:
        layer.config = config


def layer_is_moe_not_a_bool(ctx: Ctx) -> None:
    layer = layer0(ctx)
    patch(layer, "is_moe", 1)
    try:
        combined_1f1b(ctx.model, ctx.mbs)
    finally:
        layer.is_moe = True


def layer_num_local_experts_invalid(ctx: Ctx) -> None:
    layer = moe_layer(ctx)
    layer.num_local_experts = 0
    try:
        combined_1f1b(ctx.model, ctx.mbs)
    finally:
        layer.num_local_experts = CONFIG.num_experts


def mlp_wgrad_lists_a_plain_linear(ctx: Ctx) -> None:
    layer = moe_layer(ctx)
    patch(layer, "mlp_wgrad", lambda: [layer.router])
    combined_1f1b(ctx.model, ctx.mbs)


def pre_dispatch_wgrad_without_scope(ctx: Ctx) -> None:
    layer = moe_layer(ctx)
    patch(layer, "pre_dispatch_wgrad", lambda: [layer.attn])
    combined_1f1b(ctx.model, ctx.mbs)


# --- arguments of the public entry points ----------------------------------------------------


def options_flag_not_a_bool(ctx: Ctx) -> None:
    ScheduleOptions(free_input=bad("no"))


def options_flag_minus_one(ctx: Ctx) -> None:
    ScheduleOptions(ep_overlap_early_attn_memory_release=bad(-1))


def overlap_not_a_bool(ctx: Ctx) -> None:
    combined_1f1b(ctx.model, ctx.mbs, overlap=bad("False"))


def loss_scale_not_a_number(ctx: Ctx) -> None:
    combined_1f1b(ctx.model, ctx.mbs, loss_scale=bad("1"))


def loss_scale_not_finite(ctx: Ctx) -> None:
    combined_1f1b(ctx.model, ctx.mbs, loss_scale=float("nan"))


def options_not_schedule_options(ctx: Ctx) -> None:
    combined_1f1b(ctx.model, ctx.mbs, options=bad({"free_input": False}))


def streams_not_a_stream_pair(ctx: Ctx) -> None:
    combined_1f1b(ctx.model, ctx.mbs, streams=bad("cuda"))


def microbatch_field_not_a_tensor(ctx: Ctx) -> None:
    Microbatch(input_ids=bad([[1, 2, 3]]))


def microbatch_field_the_model_does_not_read(ctx: Ctx) -> None:
    mask = torch.zeros(2, 1, 8, 8, dtype=torch.bool)
    mbs = [dataclasses.replace(mb, attention_mask=mask) for mb in ctx.mbs]
    combined_1f1b(ctx.model, mbs)


def plan_input_the_model_does_not_read(ctx: Ctx) -> None:
    mb = ctx.mbs[0]
    ModelChunkSchedulePlan(
        ctx.model,
        Microbatch(
            input_ids=mb.input_ids,
            position_ids=mb.position_ids,
            labels=mb.labels,
            loss_mask=torch.ones(2, 8),
        ),
    )


def microbatch_inputs_unknown_name(ctx: Ctx) -> None:
    patch(ctx.model, "microbatch_inputs", frozenset({"labels", "position_id"}))
    combined_1f1b(ctx.model, ctx.mbs)


def microbatch_inputs_a_string(ctx: Ctx) -> None:
    patch(ctx.model, "microbatch_inputs", "labels")
    combined_1f1b(ctx.model, ctx.mbs)


def microbatches_a_generator(ctx: Ctx) -> None:
    combined_1f1b(ctx.model, bad(mb for mb in ctx.mbs))


def layer_state_unknown_attribute(ctx: Ctx) -> None:
    patch(LayerState(), "route", 1)


def layer_state_unknown_attribute_in_a_slot(ctx: Ctx) -> None:
    layer = moe_layer(ctx)

    def dispatch(node: TransformerLayerNode, inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        patch(node.layer_state, "route", 1)
        return inputs

    patch(layer, "slot_dispatch", dispatch)
    combined_1f1b(ctx.model, ctx.mbs)


def forward_hook_on_a_layer(ctx: Ctx) -> None:
    handle = layer0(ctx).register_forward_hook(lambda module, args, out: None)
    try:
        combined_1f1b(ctx.model, ctx.mbs)
    finally:
        handle.remove()


def checkpoint_wrapper_around_a_layer(ctx: Ctx) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    layer = layer0(ctx)
    ctx.model.decoder.layers[0] = checkpoint_wrapper(layer)
    try:
        combined_1f1b(ctx.model, ctx.mbs)
    finally:
        ctx.model.decoder.layers[0] = layer


def compiled_model(ctx: Ctx) -> None:
    combined_1f1b(torch.compile(ctx.model), ctx.mbs)  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]


def layer_compiled_in_place(ctx: Ctx) -> None:
    layer = layer0(ctx)
    layer.compile()
    try:
        combined_1f1b(ctx.model, ctx.mbs)
    finally:
        del layer._compiled_call_impl


# --- issue 24, argument validation: the newer surface's arguments (engine/_args) -------------


def _tiny_config(**changes: Any) -> Any:
    from moe_overlap.models import GPTMoEConfig

    base: dict[str, Any] = dict(
        vocab_size=16, hidden_size=8, num_layers=2, num_attention_heads=2, num_experts=4
    )
    return GPTMoEConfig(**(base | changes))


def dispatcher_kind_unknown(ctx: Ctx) -> None:
    from moe_overlap.blocks import TokenDispatcher

    TokenDispatcher(4, 2, kind=bad("all2all"))


def config_zero_experts(ctx: Ctx) -> None:
    _tiny_config(num_experts=0)


def config_experts_a_bool(ctx: Ctx) -> None:
    _tiny_config(num_experts=True)


def router_topk_above_experts(ctx: Ctx) -> None:
    from moe_overlap.blocks import TopKRouter

    TopKRouter(8, 4, 5, aux_loss_coeff=0.0)


def config_aux_loss_coeff_nan(ctx: Ctx) -> None:
    _tiny_config(moe_aux_loss_coeff=float("nan"))


def config_aux_loss_coeff_negative(ctx: Ctx) -> None:
    _tiny_config(moe_aux_loss_coeff=-0.01)


def config_delay_wgrad_a_string(ctx: Ctx) -> None:
    _tiny_config(delay_wgrad_compute=bad("yes"))


def graphed_block_scope_a_string(ctx: Ctx) -> None:
    from moe_overlap.blocks import GraphedBlock

    GraphedBlock(lambda x: x, [ctx.model.output], bad("attn"), label="output")


def fully_shard_slots_without_a_process_group(ctx: Ctx) -> None:
    from moe_overlap.integrations.fsdp import fully_shard_slots

    fully_shard_slots(ctx.model)


def fully_shard_slots_applied_twice(ctx: Ctx) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from moe_overlap.integrations.fsdp import fully_shard_slots
    from moe_overlap.models import GPTMoEModel

    dist.init_process_group("gloo", store=bad(dist).HashStore(), rank=0, world_size=1)
    try:
        model = GPTMoEModel(_tiny_config())
        fully_shard_slots(model, mesh=init_device_mesh("cpu", (1,)))
        fully_shard_slots(model, mesh=init_device_mesh("cpu", (1,)))
    finally:
        dist.destroy_process_group()


def make_streams_flag_not_a_bool(ctx: Ctx) -> None:
    make_streams("cpu", high_priority_comm=bad("yes"))


# --- issue 24, part wgrad: gradients owed that nothing counts, PendingWgrad, owing names ------


class _QueuedMatmul(torch.autograd.Function):
    """``x @ w.T``; the weight gradient waits in ``owner.queue`` for ``backward_dw``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, owner: UncountedDelayedLinear) -> Tensor:
        ctx.save_for_backward(x, w)
        ctx.owner = owner
        return x @ w.t()

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor, None, None]:
        (g,) = grads
        x, w = ctx.saved_tensors
        ctx.owner.queue.append((x, g))
        return g @ w, None, None


class UncountedDelayedLinear(torch.nn.Module):
    """Delays its weight gradient to ``backward_dw`` and counts nothing (no pending_wgrad)."""

    def __init__(self, weight: torch.nn.Parameter) -> None:
        super().__init__()
        self.weight = weight
        self.queue: list[tuple[Tensor, Tensor]] = []

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = _QueuedMatmul.apply(x, self.weight, self)  # type: ignore[no-untyped-call]
        return out

    def backward_dw(self) -> None:
        for x, g in self.queue:
            dw = g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
            self.weight.grad = dw if self.weight.grad is None else self.weight.grad + dw
        self.queue.clear()


class MethodCountLinear(DelayedLinear):
    """A DelayedLinear whose count is a method, not the property PendingWgrad defines."""

    def pending_wgrad(self) -> int:  # type: ignore[override]  # pyright: ignore[reportIncompatibleMethodOverride]
        return len(self.pending)


def unlisted_uncounted_delayed_module(ctx: Ctx) -> None:
    ctx.model.set_delay(True)
    layer = layer0(ctx)
    attn = layer.attn
    layer.attn = bad(UncountedDelayedLinear(attn.weight))  # delays, counts nothing ...
    patch(layer, "pre_dispatch_wgrad", lambda: [])  # ... and its layer does not list it
    try:
        combined_1f1b(ctx.model, ctx.mbs)
    finally:
        layer.attn = attn


def unlisted_uncounted_delayed_module_outside_the_layers(ctx: Ctx) -> None:
    ctx.model.set_delay(True)
    output = ctx.model.output
    ctx.model.output = bad(UncountedDelayedLinear(bad(output.weight)))  # the LM head delays
    try:
        combined_1f1b(ctx.model, ctx.mbs)
    finally:
        ctx.model.output = output


def pending_wgrad_is_a_method(ctx: Ctx) -> None:
    attn = layer0(ctx).attn
    attn.__class__ = MethodCountLinear
    try:
        combined_1f1b(ctx.model, ctx.mbs)
    finally:
        attn.__class__ = DelayedLinear


def owing_module_is_named_by_its_path(ctx: Ctx) -> None:
    from moe_overlap.blocks import DelayedWgradLinear

    layer = layer0(ctx)
    attn = layer.attn
    lin = DelayedWgradLinear(16, 16, delay_wgrad=True)  # label: its class name, by default
    lin.weight = attn.weight
    layer.attn = bad(lin)
    try:
        with claim_wgrad(lin):  # a claimed backward whose wgrad nothing runs leaves it pending
            ctx.model(ctx.mbs[0]).backward()
        combined_1f1b(ctx.model, ctx.mbs)
    finally:
        layer.attn = attn


def copy_of_a_module_owing_wgrad(ctx: Ctx) -> None:
    from moe_overlap.blocks import DelayedWgradLinear

    layer = layer0(ctx)
    attn = layer.attn
    lin = DelayedWgradLinear(16, 16, delay_wgrad=True)
    lin.weight = attn.weight
    layer.attn = bad(lin)
    try:
        with claim_wgrad(lin):  # a custom driver's backward, its backward_dw not run yet
            ctx.model(ctx.mbs[0]).backward()
        copy.deepcopy(ctx.model)
    finally:
        layer.attn = attn


# --- issue 24, the slot rules always on: node.detach hand-offs, what still holds a freed
# input, the upstream gradient's shape ------------------------------------------------------


def detach_copy_returned_as_output(ctx: Ctx) -> None:
    layer = moe_layer(ctx)

    def pre_dispatch(node: TransformerLayerNode, inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        rows, probs = ToyLayer.slot_pre_dispatch(layer, node, inputs)
        return node.detach(rows), probs  # the copy, not rows: its gradient would stop there

    patch(layer, "slot_pre_dispatch", pre_dispatch)
    combined_1f1b(ctx.model, ctx.mbs)


def detach_copy_view_returned_as_output(ctx: Ctx) -> None:
    layer = moe_layer(ctx)

    def pre_dispatch(node: TransformerLayerNode, inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        rows, probs = ToyLayer.slot_pre_dispatch(layer, node, inputs)
        return rows, node.detach(probs).view(-1)

    patch(layer, "slot_pre_dispatch", pre_dispatch)
    combined_1f1b(ctx.model, ctx.mbs, options=ScheduleOptions(free_input=False))


def detach_copy_used_again_in_its_slot(ctx: Ctx) -> None:
    layer = moe_layer(ctx)

    def pre_dispatch(node: TransformerLayerNode, inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        (x,) = inputs
        h = node.detach(layer._attention(x, node.chunk_state.rotary_pos_emb))
        rows, probs, route, _ = layer._route(h)  # routed from the copy, not from the tensor
        node.layer_state.residual = h
        node.layer_state.stash("route", route)
        return rows, probs

    patch(layer, "slot_pre_dispatch", pre_dispatch)
    combined_1f1b(ctx.model, ctx.mbs)


def slot_input_kept_as_is(ctx: Ctx) -> None:
    layer = moe_layer(ctx)

    def dispatch(node: TransformerLayerNode, inputs: tuple[Tensor, ...]) -> Tensor:
        rows, probs = inputs
        node.layer_state.dispatched_probs = probs  # not node.detach(...)
        return rows.clone()

    patch(layer, "slot_dispatch", dispatch)
    combined_1f1b(ctx.model, ctx.mbs, options=ScheduleOptions(free_input=False))


def slot_input_view_stashed_as_is(ctx: Ctx) -> None:
    layer = moe_layer(ctx)

    def dispatch(
        node: TransformerLayerNode, inputs: tuple[Tensor, ...]
    ) -> Tensor | tuple[Tensor, ...]:
        node.layer_state.stash("rows", inputs[0][:4])  # a view of the input
        return ToyLayer.slot_dispatch(layer, node, inputs)

    patch(layer, "slot_dispatch", dispatch)
    combined_1f1b(ctx.model, ctx.mbs)


def slot_output_kept_as_is(ctx: Ctx) -> None:
    layer = moe_layer(ctx)

    def pre_dispatch(node: TransformerLayerNode, inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        rows, probs = ToyLayer.slot_pre_dispatch(layer, node, inputs)
        node.layer_state.probs = probs  # also returned: still in this slot's graph
        return rows, probs

    patch(layer, "slot_pre_dispatch", pre_dispatch)
    combined_1f1b(ctx.model, ctx.mbs, options=ScheduleOptions(free_input=False))


def freed_input_passed_through_by_the_slot_before(ctx: Ctx) -> None:
    layer = moe_layer(ctx)
    config = layer.config
    # flex/deepep: dispatch keeps its inputs, mlp (4 local experts) frees its own
    layer.config = dataclasses.replace(
        config, moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep"
    )

    def dispatch(node: TransformerLayerNode, inputs: tuple[Tensor, ...]) -> Tensor:
        rows, probs = inputs
        node.layer_state.dispatched_probs = node.detach(probs.clone())
        return rows  # not a fresh buffer: mlp would free pre_dispatch's output with it

    patch(layer, "slot_dispatch", dispatch)
    try:
        combined_1f1b(ctx.model, ctx.mbs)
    finally:
        layer.config = config


def b_grad_of_the_wrong_shape(ctx: Ctx) -> None:
    p0 = plan(ctx)
    ModelChunkSchedulePlan.run(p0, None)
    ModelChunkSchedulePlan.run(None, p0, b_grad=torch.ones(3))  # the loss is a scalar


def b_grad_of_the_wrong_dtype(ctx: Ctx) -> None:
    p0 = plan(ctx)
    loss = ModelChunkSchedulePlan.run(p0, None)
    assert loss is not None
    ModelChunkSchedulePlan.run(None, p0, b_grad=torch.ones_like(loss, dtype=torch.float64))


def b_grad_not_a_tensor(ctx: Ctx) -> None:
    p0 = plan(ctx)
    ModelChunkSchedulePlan.run(p0, None)
    ModelChunkSchedulePlan.run(None, p0, b_grad=bad(1.0))


def b_grad_without_a_backward_plan(ctx: Ctx) -> None:
    ModelChunkSchedulePlan.run(plan(ctx), None, b_grad=torch.ones(()))


def b_grads_of_the_wrong_shape(ctx: Ctx) -> None:
    p0, p1 = plan(ctx, 0), plan(ctx, 1)
    run_pair(p0, p1)
    run_pair(p0, p1, b_grads=(torch.ones(()), torch.ones(2)))


def b_grads_not_a_pair(ctx: Ctx) -> None:
    p0, p1 = plan(ctx, 0), plan(ctx, 1)
    run_pair(p0, p1)
    run_pair(p0, p1, b_grads=bad([torch.ones(()), torch.ones(())]))


# --- issue 37, part 7: a hand-off without node.detach always, mark_non_differentiable's
# arguments ----------------------------------------------------------------------------------


def intermediate_kept_without_node_detach(ctx: Ctx) -> None:
    # pre_dispatch keeps its attention output in layer_state as it is; combine adds it.
    residual_without_node_detach(ctx)


def intermediate_handed_on_outside_layer_state(ctx: Ctx) -> None:
    layer = moe_layer(ctx)
    held: dict[str, Tensor] = {}

    def pre_dispatch(node: TransformerLayerNode, inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        (x,) = inputs
        a = layer._attention(x, node.chunk_state.rotary_pos_emb)
        rows, probs, route, _ = layer._route(a)
        node.layer_state.residual = node.detach(a)
        node.layer_state.stash("route", route)
        held["a"] = a * 0.5  # in a closure, not through node.detach
        return rows, probs

    def combine(node: TransformerLayerNode, inputs: tuple[Tensor, ...]) -> Tensor:
        out = ToyLayer.slot_combine(layer, node, inputs)
        assert isinstance(out, Tensor)
        return out + held.pop("a").sin()

    patch(layer, "slot_pre_dispatch", pre_dispatch)
    patch(layer, "slot_combine", combine)
    combined_1f1b(ctx.model, ctx.mbs)


def mark_non_differentiable_given_a_tuple(ctx: Ctx) -> None:
    layer = moe_layer(ctx)

    def dispatch(
        node: TransformerLayerNode, inputs: tuple[Tensor, ...]
    ) -> Tensor | tuple[Tensor, ...]:
        rows = ToyLayer.slot_dispatch(layer, node, inputs)
        assert isinstance(rows, Tensor)
        mask, weight = torch.ones(rows.shape[0]), torch.ones(rows.shape[0])
        node.mark_non_differentiable(bad((mask, weight)))  # not (mask, weight) unpacked
        return rows, mask, weight

    patch(layer, "slot_dispatch", dispatch)
    combined_1f1b(ctx.model, ctx.mbs)


@dataclass(frozen=True)
class Debug:
    """What debug mode (``MOE_OVERLAP_DEBUG=1``) raises for a case instead: beartype's
    :class:`~moe_overlap.TypeHintError` at the call whose annotation the misuse breaks,
    before the library's own checks (docs/errors.md), or a debug-only check that finds the
    misuse earlier (docs/debug.md)."""

    raises: type[BaseException]
    match: str
    cause: type[BaseException] | None = None


def hint(function: str, parameter: str, what: str) -> Debug:
    """Debug mode: beartype refuses ``function``'s ``parameter`` (its hint matches ``what``)."""
    return Debug(
        TypeHintError,
        rf"^(Function|Method) \S*\b{re.escape(function)}\(\) parameter {parameter}=.* "
        rf"violates type hint .*{what}",
    )


MODEL_HINT = hint("combined_1f1b", "model", r"Is\[PreprocessableModel_rule_table\]")
LAYER_HINT = hint(
    "TransformerLayerSchedulePlan.__init__", "layer", r"Is\[SchedulableLayer_rule_table\]"
)


@dataclass(frozen=True)
class Case:
    fn: Callable[[Ctx], None]
    raises: type[BaseException]
    match: str
    cause: type[BaseException] | None = None
    debug: Debug | None = None
    """Debug mode's error, where it differs."""

    @property
    def id(self) -> str:
        return self.fn.__name__

    def expected(self) -> Debug:
        """The error of this mode (this process's :data:`~moe_overlap.engine.DEBUG`)."""
        if DEBUG and self.debug is not None:
            return self.debug
        return Debug(self.raises, self.match, self.cause)


PASSED_WITHOUT_NODE_DETACH = Debug(
    ScheduleError,
    r"layer 1, slot combine, forward.*node 'moe_combine': its outputs depend on a tensor "
    r"\(float32\[2, 8, 16\]\) that is not a parameter, not one of its inputs and not handed "
    r"on with node\.detach",
    IntegrationError,
)
"""Debug mode: a tensor handed between slots without ``node.detach``, found at the reading
slot's forward by the walk of its graph (``debug_tensor_passed_without_node_detach``)."""


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
        debug=Debug(
            ScheduleError,
            r"slot mlp, forward.*TypeHintError: .*TransformerLayerNode\.forward_impl\(\) return "
            r"'oops' violates type hint",
            TypeHintError,
        ),
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
        debug=MODEL_HINT,
    ),
    Case(
        layer_missing_slot,
        IntegrationError,
        r"layers\[2\]: NoCombine is not a SchedulableLayer; missing members: \['config'",
        debug=LAYER_HINT,
    ),
    Case(no_microbatches, ConfigError, r"expected at least one microbatch"),
    Case(
        microbatch_wrong_type,
        ConfigError,
        r"microbatches\[0\] must be a Microbatch, received dict",
        debug=hint("combined_1f1b", "microbatches", r"Sequence\[.*Microbatch\]"),
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
        streams_for_another_device,
        StreamError,
        r"expected a 'cpu' or 'cuda' device, received meta; pass the device the model and its "
        r"inputs are on .*model\.to_empty\(device=\.\.\.\)",
    ),
    Case(
        inputs_on_meta,
        StreamError,
        r"schedule: expected a cpu or cuda device, received meta \(the device of the "
        r"microbatch's input_ids.*; put the model and its inputs on 'cpu' or 'cuda' \(a model "
        r"built on 'meta': materialize it first with model\.to_empty\(device=\.\.\.\)",
    ),
    Case(
        event_stream_mismatch,
        StreamError,
        r"paired with a CUDA event",
        debug=hint("use_stream.__init__", "event", "CpuEvent"),
    ),
    Case(
        unrecorded_event_timing,
        StreamError,
        r"both events must be recorded first .*; call record\(\) on both",
    ),
    Case(
        weak_method_on_function,
        IntegrationError,
        r"expected a bound method, received <built-in function print>",
    ),
    Case(layer_state_missing_key, IntegrationError, r"nothing stashed under 'route'"),
    Case(layer_state_wrong_kind, IntegrationError, r"'route' holds a int, expected a str"),
    Case(
        delay_option_contradicts_layers,
        ConfigError,
        r"decoder\.layers\[0\]: ScheduleOptions\(delay_wgrad_compute=False\) expected the layer "
        r"to compute its weight gradients at once, but it delays them",
    ),
    Case(
        delay_option_without_delaying_layers,
        ConfigError,
        r"ScheduleOptions\(delay_wgrad_compute=True\) expected the layer to delay.*does not delay",
    ),
    Case(
        parameter_used_by_two_nodes,
        IntegrationError,
        r"combined_1f1b: ToyModel: expected each parameter's gradient accumulated into \.grad "
        r"at most once per microbatch .*received more accumulations than the 2 microbatches "
        r"for \['embedding\.weight = output\.weight \(4 accumulations\)'\].*an output layer "
        r"tied to the embedding.*zero them.*untie the weights",
    ),
    Case(
        parameter_used_by_two_nodes_by_hand,
        IntegrationError,
        r"ModelChunkSchedulePlan\.run: ToyModel: expected each parameter's gradient "
        r"accumulated into \.grad at most once per microbatch .*received more accumulations "
        r"than the 1 microbatch the run backs \(microbatch 0\) for \['embedding\.weight = "
        r"output\.weight \(2 accumulations\)'\].*zero them.*untie the weights",
    ),
    Case(
        delayed_module_listed_by_two_layers,
        WgradError,
        r"ToyModel\.decoder\.layers\[1\]: expected the modules its pre_dispatch_wgrad\(\) / "
        r"mlp_wgrad\(\) list to be its own, received modules holding 1 parameters that "
        r"decoder\.layers\[0\] lists too \['decoder\.layers\.0\.attn\.weight = "
        r"decoder\.layers\.1\.attn\.weight'\].*copy\.deepcopy the shared one",
    ),
    Case(
        grad_hook_on_delayed_weight,
        WgradError,
        r"ToyModel: decoder\.layers\.0\.attn\.weight: expected no gradient hook on a weight "
        r"whose gradient the schedule delays .*received 1 hook \(grad_hook_on_delayed_weight"
        r"\.<locals>\.<lambda>\).*before backward_dw\(\) computes its gradient.*"
        r"delay_wgrad_compute=False\), or remove the hook",
    ),
    Case(
        undeclared_delayed_module,
        WgradError,
        r"computed when combined_1f1b returns.*'decoder\.layers\.0\.attn \(DelayedLinear\)': 2",
        debug=Debug(
            WgradError,
            r"^ToyModel: expected every delayed weight gradient computed after the schedule "
            r"ran debug mode's first-step check \(one microbatch\), received modules still "
            r"owing some: \{'decoder\.layers\.0\.attn \(DelayedLinear\)': 1\}",
        ),
    ),
    Case(
        pending_wgrad_from_an_earlier_backward,
        WgradError,
        r"computed before the step \(left from an earlier one\).*discard_wgrad",
    ),
    Case(step_under_no_grad, ConfigError, r"combined_1f1b: expected autograd enabled.*no_grad"),
    Case(step_under_inference_mode, ConfigError, r"received grad mode off \(torch\.inference_mode"),
    Case(
        step_under_inference_mode_with_enable_grad,
        ConfigError,
        r"combined_1f1b: expected autograd recording .*received grad mode on inside "
        r"torch\.inference_mode\(\).*call it outside torch\.inference_mode\(\)",
    ),
    Case(
        every_parameter_frozen,
        ConfigError,
        r"combined_1f1b: ToyModel: expected a step with something to differentiate .*received "
        r"a model whose \d+ parameters are all frozen.*plain loss\.backward\(\) refuses",
    ),
    Case(
        loss_no_trainable_parameter_reaches,
        IntegrationError,
        r"combined_1f1b: ToyModel\._postprocess: expected the loss of microbatches\[0\] to "
        r"require grad .*received a loss without grad",
    ),
    Case(
        every_parameter_frozen_by_hand,
        ConfigError,
        r"ModelChunkSchedulePlan\.run: ToyModel: expected a step with something to "
        r"differentiate .*received a model whose \d+ parameters are all frozen.*plain "
        r"loss\.backward\(\) refuses",
    ),
    Case(
        loss_no_trainable_parameter_reaches_by_hand,
        IntegrationError,
        r"ModelChunkSchedulePlan\.run: ToyModel\._postprocess: expected the loss of "
        r"microbatch 0 \(the backward plan's output\) to require grad .*received a loss "
        r"without grad",
    ),
    Case(run_under_no_grad, ConfigError, r"ModelChunkSchedulePlan\.run: expected autograd enabled"),
    Case(
        slot_output_cut_from_graph,
        ScheduleError,
        r"node 'mlp': output 0 \(float32\[\d+, 16\]\) does not require grad although the "
        r"node's inputs do.*node\.mark_non_differentiable",
        IntegrationError,
    ),
    Case(
        slot_output_cut_with_delayed_wgrad,
        ScheduleError,
        r"layer 0, slot mlp, forward.*does not require grad",
        IntegrationError,
    ),
    Case(
        postprocess_loss_cut_from_graph,
        ScheduleError,
        r"node 'post_process': output 0 \(float32\[\]\) does not require grad",
        IntegrationError,
    ),
    Case(
        layer_state_tensor_cut_from_graph,
        ScheduleError,
        r"node 'pre_dispatch_computation': layer_state\.residual \(float32\[2, 8, 16\]\) does not "
        r"require grad although the node's inputs do.*node\.detach\(t\) \(not t\.detach\(\)",
        IntegrationError,
    ),
    Case(
        stashed_tensor_cut_from_graph,
        ScheduleError,
        r"node 'moe_dispatch': layer_state\.stash\('scale'\) \(float32\[32\]\) does not require grad",
        IntegrationError,
    ),
    Case(
        slot_returns_its_freed_input,
        ScheduleError,
        r"node 'moe_dispatch': output 0 \(float32\[32, 16\]\) shares storage with input 0, "
        r"which the free-input policy releases.*ScheduleOptions\(free_input=False\)",
        IntegrationError,
    ),
    Case(
        slot_returns_a_view_of_its_freed_input,
        ScheduleError,
        r"node 'moe_combine': output 0 .* shares storage with input 0",
        IntegrationError,
    ),
    Case(
        slot_hands_on_its_freed_input,
        ScheduleError,
        r"node 'moe_dispatch': tensor kept for a later slot 0 \(float32\[32\]\) shares storage "
        r"with input 1",
        IntegrationError,
    ),
    Case(
        freed_input_read_in_backward,
        ScheduleError,
        r"layer 1, slot dispatch, forward.*node 'moe_dispatch': the free-input policy releases "
        r"this node's inputs after forward, but autograd saved one of them \(or a view\) for "
        r"backward: \['SoftmaxBackward0\.result'\]",
        IntegrationError,
    ),
    Case(
        decoder_is_a_module_list,
        IntegrationError,
        r"ToyModel\.decoder \(ModuleList\) is not a decoder; missing members: \['layers', "
        r"'input_tensor', 'final_layernorm'\]; a decoder is an object with `layers`",
        debug=MODEL_HINT,
    ),
    Case(
        decoder_without_final_layernorm,
        IntegrationError,
        r"ToyModel\.decoder \(ToyDecoder\) is not a decoder; missing members: \['final_layernorm'\]",
        debug=MODEL_HINT,
    ),
    Case(
        decoder_input_tensor_not_a_tensor,
        IntegrationError,
        r"decoder\.input_tensor: expected None or a Tensor.*received list",
        debug=MODEL_HINT,
    ),
    Case(
        model_config_without_mtp_num_layers,
        IntegrationError,
        r"ToyModel\.config \(object\): expected a member mtp_num_layers",
        debug=MODEL_HINT,
    ),
    Case(
        stage_flag_not_a_bool,
        IntegrationError,
        r"ToyModel\.post_process: expected a bool, received int 1",
        debug=MODEL_HINT,
    ),
    Case(
        layer_config_without_free_input_fields,
        IntegrationError,
        r"decoder\.layers\[0\]: ToyLayer\.config \(object\): expected the free-input fields.*missing: "
        r"\['moe_token_dispatcher_type'",
        debug=LAYER_HINT,
    ),
    Case(
        layer_config_unknown_dispatcher,
        ConfigError,
        r"moe_token_dispatcher_type: expected one of \['alltoall', 'allgather', 'flex'\], received "
        r"str 'all2all'",
        debug=LAYER_HINT,
    ),
    Case(
        layer_is_moe_not_a_bool,
        IntegrationError,
        r"decoder\.layers\[0\]: ToyLayer\.is_moe: expected a bool, received int 1",
        debug=LAYER_HINT,
    ),
    Case(
        layer_num_local_experts_invalid,
        IntegrationError,
        r"ToyLayer\.num_local_experts: expected None or an int >= 1, received int 0",
        debug=LAYER_HINT,
    ),
    Case(
        mlp_wgrad_lists_a_plain_linear,
        IntegrationError,
        r"decoder\.layers\[1\]: mlp_wgrad\(\)\[0\]: Linear is not a WgradLayer.*"
        r"missing members: \['backward_dw'\]",
    ),
    Case(
        pre_dispatch_wgrad_without_scope,
        IntegrationError,
        r"ToyLayer\.pre_dispatch_wgrad\(\)\[0\]: expected a WgradScope\(scope, module\).*"
        r"received DelayedLinear",
    ),
    Case(
        options_flag_not_a_bool,
        ConfigError,
        r"ScheduleOptions\.free_input: expected a bool, received str 'no'",
        debug=hint("ScheduleOptions.__init__", "free_input", "bool"),
    ),
    Case(
        options_flag_minus_one,
        ConfigError,
        r"ScheduleOptions\.ep_overlap_early_attn_memory_release: expected a bool, received int -1",
        debug=hint("ScheduleOptions.__init__", "ep_overlap_early_attn_memory_release", "bool"),
    ),
    Case(
        overlap_not_a_bool,
        ConfigError,
        r"overlap must be a bool, received str 'False'",
        debug=hint("combined_1f1b", "overlap", "bool"),
    ),
    Case(
        loss_scale_not_a_number,
        ConfigError,
        r"loss_scale must be a finite real number, received str '1'",
        debug=hint("combined_1f1b", "loss_scale", "float"),
    ),
    Case(
        loss_scale_not_finite,
        ConfigError,
        r"loss_scale must be a finite real number, received float nan",
    ),
    Case(
        options_not_schedule_options,
        ConfigError,
        r"options must be a ScheduleOptions, received dict",
        debug=hint("combined_1f1b", "options", "ScheduleOptions"),
    ),
    Case(
        streams_not_a_stream_pair,
        ConfigError,
        r"streams must be a StreamPair \(make_streams\(device\)\) or None, received str",
        debug=hint("combined_1f1b", "streams", "StreamPair"),
    ),
    Case(
        microbatch_field_not_a_tensor,
        ConfigError,
        r"Microbatch\.input_ids: expected a Tensor or None, received list",
        debug=hint("Microbatch.__init__", "input_ids", "Tensor"),
    ),
    Case(
        microbatch_field_the_model_does_not_read,
        ConfigError,
        r"combined_1f1b: microbatches\[0\]: Microbatch field attention_mask is set, but "
        r"ToyModel does not read it \(ToyModel reads \['labels', 'position_ids'\], by "
        r"default: it declares no microbatch_inputs\); it would be silently ignored.*"
        r"list it in ToyModel\.microbatch_inputs",
    ),
    Case(
        plan_input_the_model_does_not_read,
        ConfigError,
        r"ModelChunkSchedulePlan \(microbatch None\): input loss_mask is set, but ToyModel "
        r"does not read it",
    ),
    Case(
        microbatch_inputs_unknown_name,
        IntegrationError,
        r"ToyModel\.microbatch_inputs: expected names among \[.*\], received also "
        r"\['position_id'\]",
    ),
    Case(
        microbatch_inputs_a_string,
        IntegrationError,
        r"ToyModel\.microbatch_inputs: expected a collection of input names .*received str "
        r"'labels'",
    ),
    Case(
        microbatches_a_generator,
        ConfigError,
        r"microbatches must be a sequence \(list or tuple\) of Microbatch, received generator",
        debug=hint("combined_1f1b", "microbatches", "Sequence"),
    ),
    Case(
        layer_state_unknown_attribute,
        LayerStateAttributeError,
        r"LayerState: cannot set 'route'.*stash\('route', value\).*take\('route', kind\)",
    ),
    Case(
        forward_hook_on_a_layer,
        ConfigError,
        r"ToyModel\.decoder\.layers\[0\] \(ToyLayer\): expected no forward or backward hooks on "
        r"it, received 1 forward hook \(forward_hook_on_a_layer\.<locals>\.<lambda>\); the "
        r"schedule never calls a decoder layer's forward.*register them on the modules the slots",
    ),
    Case(
        checkpoint_wrapper_around_a_layer,
        ConfigError,
        r"layers\[0\] \(CheckpointWrapper\): expected no activation checkpointing of it, "
        r"received a CheckpointWrapper around ToyLayer.*GPTMoEConfig\.recompute",
    ),
    Case(
        compiled_model,
        ConfigError,
        r"OptimizedModule: expected no torch\.compile of it, received an OptimizedModule around "
        r"ToyModel; the schedule never calls the model's forward.*docs/compile\.md",
    ),
    Case(
        layer_compiled_in_place,
        ConfigError,
        r"layers\[0\] \(ToyLayer\): expected no torch\.compile of it, received "
        r"ToyLayer\.compile\(\) \(compiled in place\)",
    ),
    Case(
        layer_state_unknown_attribute_in_a_slot,
        ScheduleError,
        r"slot dispatch, forward.*LayerState: cannot set 'route'",
        LayerStateAttributeError,
    ),
    # issue 24, argument validation
    Case(
        dispatcher_kind_unknown,
        ConfigError,
        r"TokenDispatcher: kind must be one of \['alltoall', 'loopback'\], received str 'all2all'",
        debug=hint("TokenDispatcher.__init__", "kind", r"Literal\['alltoall', 'loopback'\]"),
    ),
    Case(
        config_zero_experts,
        ConfigError,
        r"GPTMoEConfig\.num_experts: expected an int >= 1, received int 0",
    ),
    Case(
        config_experts_a_bool,
        ConfigError,
        r"GPTMoEConfig\.num_experts: expected an int >= 1, received bool True",
    ),
    Case(
        router_topk_above_experts,
        ConfigError,
        r"TopKRouter: topk must be an int in \[1, num_experts=4\], received int 5",
    ),
    Case(
        config_aux_loss_coeff_nan,
        ConfigError,
        r"GPTMoEConfig\.moe_aux_loss_coeff: expected a finite real number >= 0, received float "
        r"nan; 0 turns the load-balancing loss off",
    ),
    Case(
        config_aux_loss_coeff_negative,
        ConfigError,
        r"GPTMoEConfig\.moe_aux_loss_coeff: expected a finite real number >= 0, received float "
        r"-0\.01",
    ),
    Case(
        config_delay_wgrad_a_string,
        ConfigError,
        r"GPTMoEConfig\.delay_wgrad_compute: expected a bool, received str 'yes'",
        debug=hint("GPTMoEConfig.__init__", "delay_wgrad_compute", "bool"),
    ),
    Case(
        graphed_block_scope_a_string,
        ConfigError,
        r"GraphedBlock: scope must be a CudaGraphModule .*, received str 'attn'; pass the "
        r"member, e\.g\. CudaGraphModule\.attn",
        debug=hint("GraphedBlock.__init__", "scope", "CudaGraphModule"),
    ),
    Case(
        fully_shard_slots_without_a_process_group,
        ConfigError,
        r"fully_shard_slots: expected a process group to shard over .*the default process "
        r"group is not initialized; call torch\.distributed\.init_process_group first, or "
        r"pass a DeviceMesh",
    ),
    Case(
        fully_shard_slots_applied_twice,
        ConfigError,
        r"fully_shard_slots: expected GPTMoEModel's slot modules not yet sharded, received "
        r"\['decoder\.layers\.0\.attn_block \(FSDP_AttentionBlock\)'.*already FSDPModules "
        r"\(fully_shard_slots or fully_shard applied before\); apply fully_shard_slots once",
    ),
    Case(
        make_streams_flag_not_a_bool,
        ConfigError,
        r"make_streams: high_priority_comm must be a bool, received str 'yes'",
        debug=hint("make_streams", "high_priority_comm", "bool"),
    ),
    # issue 24, weight gradients
    Case(
        unlisted_uncounted_delayed_module,
        WgradError,
        r"^ToyModel\.decoder\.layers\[0\] delays weight gradients \(its pre_dispatch_wgrad\(\) / "
        r"mlp_wgrad\(\) list 1 modules\), but decoder\.layers\.0\.attn \(UncountedDelayedLinear\) "
        r"has a backward_dw\(\).*trainable parameters \['weight'\] that no listed module holds.*"
        r"no pending_wgrad.*its \.grad stays missing.*list it \(pre_dispatch_wgrad\(\): "
        r"WgradScope\(CudaGraphModule\.attn, module\)",
    ),
    Case(
        unlisted_uncounted_delayed_module_outside_the_layers,
        WgradError,
        r"^ToyModel: its layers delay weight gradients, but outside the layers output "
        r"\(UncountedDelayedLinear\) has a backward_dw\(\).*list it in a layer's",
    ),
    Case(
        pending_wgrad_is_a_method,
        IntegrationError,
        r"^decoder\.layers\.0\.attn \(MethodCountLinear\)\.pending_wgrad: expected an int >= 0 "
        r"\(PendingWgrad: a read-only property.*received a method \(pending_wgrad is a "
        r"method\).*@property def pending_wgrad\(self\) -> int",
    ),
    Case(
        owing_module_is_named_by_its_path,
        WgradError,
        r"before the step \(left from an earlier one\), received modules still owing some: "
        r"\{'decoder\.layers\.0\.attn \(DelayedWgradLinear\)': 1\}",
    ),
    Case(
        copy_of_a_module_owing_wgrad,
        WgradError,
        r"^DelayedWgradLinear: deepcopy expected no delayed weight gradient pending, received "
        r"1: the copy's \.grad would lack them; run backward_dw\(\).*discard_wgrad\(\)",
    ),
    Case(
        detach_copy_returned_as_output,
        ScheduleError,
        r"layer 1, slot pre_dispatch, forward.*node 'pre_dispatch_computation': output 0 "
        r"\(float32\[32, 16\]\) is a node\.detach copy this slot made \(or a view of one\).*"
        r"Expected the slot to return t itself",
        IntegrationError,
    ),
    Case(
        detach_copy_view_returned_as_output,
        ScheduleError,
        r"node 'pre_dispatch_computation': output 1 \(float32\[32\]\) is a node\.detach copy",
        IntegrationError,
        debug=Debug(
            ScheduleError,
            r"layer 1, slot pre_dispatch, forward.*node 'pre_dispatch_computation': its outputs "
            r"\(or another node\.detach copy\) depend on a node\.detach copy it made itself "
            r"\(float32\[32\]\)",
            IntegrationError,
        ),
    ),
    Case(
        detach_copy_used_again_in_its_slot,
        ScheduleError,
        r"layer 1, slot pre_dispatch, backward.*node 'pre_dispatch_computation': the "
        r"node\.detach copy 0 this slot made \(float32\[2, 8, 16\]\) received a gradient from "
        r"the slot's own backward.*MOE_OVERLAP_DEBUG=1",
        IntegrationError,
        debug=Debug(
            ScheduleError,
            r"layer 1, slot pre_dispatch, forward.*node 'pre_dispatch_computation': its outputs "
            r"\(or another node\.detach copy\) depend on a node\.detach copy it made itself "
            r"\(float32\[2, 8, 16\]\)",
            IntegrationError,
        ),
    ),
    Case(
        slot_input_kept_as_is,
        ScheduleError,
        r"slot dispatch, forward.*node 'moe_dispatch': layer_state\.dispatched_probs "
        r"\(float32\[32\]\) is the slot's input 1 \(or a view of it\) kept as it is.*"
        r"layer_state\.dispatched_probs = node\.detach\(inputs\[1\]\)",
        IntegrationError,
    ),
    Case(
        slot_input_view_stashed_as_is,
        ScheduleError,
        r"node 'moe_dispatch': layer_state\.stash\('rows'\) \(float32\[4, 16\]\) is the slot's "
        r"input 0 \(or a view of it\).*layer_state\.stash\('rows', node\.detach\(inputs\[0\]\)\)",
        IntegrationError,
    ),
    Case(
        slot_output_kept_as_is,
        ScheduleError,
        r"node 'pre_dispatch_computation': layer_state\.probs \(float32\[32\]\) is also the "
        r"slot's output 1 \(or a view of it\), kept without node\.detach",
        IntegrationError,
    ),
    Case(
        freed_input_passed_through_by_the_slot_before,
        ScheduleError,
        r"slot mlp, forward.*node 'mlp': the free-input policy releases input 0 "
        r"\(float32\[32, 16\]\) right after this slot, but the previous slot returned it "
        r"without computing it.*fresh buffers.*ScheduleOptions\(free_input=False\)",
        IntegrationError,
    ),
    Case(
        intermediate_kept_without_node_detach,
        ScheduleError,
        r"layer 1, slot combine, forward.*node 'moe_combine': its outputs depend on "
        r"layer_state\.residual \(float32\[2, 8, 16\]\), which node 'pre_dispatch_computation' "
        r"\(an earlier slot of the layer\) kept with its autograd graph, not through "
        r"node\.detach.*Expected node 'pre_dispatch_computation' to keep node\.detach\(t\) "
        r"for what a later slot reads: layer_state\.residual = node\.detach\(t\)",
        IntegrationError,
        debug=PASSED_WITHOUT_NODE_DETACH,
    ),
    Case(
        intermediate_handed_on_outside_layer_state,
        ScheduleError,
        r"layer 1, slot pre_dispatch, backward.*node 'pre_dispatch_computation': its backward "
        r"ran into autograd graph that another backward already ran through and freed "
        r"\(torch: Trying to backward through the graph a second time\): most likely a tensor "
        r"was handed between this slot and another slot \(or another microbatch\) without "
        r"node\.detach",
        IntegrationError,
        debug=PASSED_WITHOUT_NODE_DETACH,
    ),
    Case(
        mark_non_differentiable_given_a_tuple,
        ScheduleError,
        r"node 'moe_dispatch': mark_non_differentiable: expected tensors as separate "
        r"arguments, received a tuple of 2 items \(Tensor\) as argument 0; call "
        r"mark_non_differentiable\(\*tensors\)",
        IntegrationError,
        debug=Debug(
            ScheduleError,
            r"slot dispatch, forward.*TypeHintError: .*ScheduleNode\.mark_non_differentiable\(\) "
            r"parameter tensors=\(tensor.* violates type hint <class 'torch\.Tensor'>",
            TypeHintError,
        ),
    ),
    Case(
        b_grad_of_the_wrong_shape,
        ConfigError,
        r"ModelChunkSchedulePlan\.run: b_grad: expected the gradient of the backward plan's "
        r"output \(microbatch 0\) as a tensor of its shape \[\], dtype float32 on cpu, "
        r"received one of shape \[3\], dtype float32 on cpu; .*torch\.ones_like\(loss\)",
    ),
    Case(
        b_grad_of_the_wrong_dtype,
        ConfigError,
        r"b_grad: .* shape \[\], dtype float32 on cpu, received one of shape \[\], dtype float64",
    ),
    Case(
        b_grad_not_a_tensor,
        ConfigError,
        r"b_grad: expected the gradient of the backward plan's output \(microbatch 0\) as a "
        r"Tensor, received float",
        debug=hint("ModelChunkSchedulePlan.run", "b_grad", "Tensor"),
    ),
    Case(
        b_grad_without_a_backward_plan,
        ConfigError,
        r"ModelChunkSchedulePlan\.run: b_grad is given but there is no backward plan",
    ),
    Case(
        b_grads_of_the_wrong_shape,
        ConfigError,
        r"run_pair: b_grads\[1\]: expected the gradient of the backward plan's output "
        r"\(microbatch 1\) as a tensor of its shape \[\].*received one of shape \[2\]",
    ),
    Case(
        b_grads_not_a_pair,
        ConfigError,
        r"run_pair: expected b_grads as a tuple of two tensors .* received list",
        debug=hint("run_pair", "b_grads", r"tuple\[torch\.Tensor, torch\.Tensor\]"),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_misuse(case: Case) -> None:
    ref = ToyModel(CONFIG, "mm")
    model = copy.deepcopy(ref)
    ctx = Ctx(model, make_microbatches(2, CONFIG))
    expected = case.expected()
    with pytest.raises(expected.raises, match=re.compile(expected.match, re.DOTALL)) as info:
        case.fn(ctx)
    assert isinstance(info.value, mo.MoeOverlapError)
    if expected.cause is not None:
        assert isinstance(info.value.__cause__, expected.cause)
    # The user fixes the misuse (patches removed); the same model object then trains
    # exactly on the next step once the failed step's grads are dropped.
    undo_patches(ctx.model)
    ctx.model.zero_grad(set_to_none=True)
    mbs = make_microbatches(3, CONFIG, seed=5)
    plain_step(ref, mbs)
    combined_1f1b(ctx.model, mbs)
    assert_same(grads(ctx.model), grads(ref))


def undo_patches(model: ToyModel) -> None:
    """The user's fix: patches removed, delayed wgrad off again and what was pending dropped."""
    for name in ("_preprocess", "_postprocess", "microbatch_inputs"):
        model.__dict__.pop(name, None)
    for layer in model.decoder.layers:
        for name in (*SLOT_NAMES, "pre_dispatch_wgrad", "mlp_wgrad"):
            layer.__dict__.pop(name, None)
    for owner, name, value in reversed(model.__dict__.pop("_shared", [])):
        setattr(owner, name, value)
    for handle in model.__dict__.pop("_handles", []):
        handle.remove()
    model.set_delay(False)
    for module in model.modules():
        if isinstance(module, DelayedLinear):
            module.pending.clear()


SLOT_NAMES = ("slot_pre_dispatch", "slot_dispatch", "slot_mlp", "slot_combine")


ROOT = Path(__file__).resolve().parents[2]


def test_catalogue_is_documented() -> None:
    doc = ROOT / "docs" / "errors.md"
    if not doc.exists():
        pytest.fail("docs/errors.md is missing")
    text = doc.read_text()
    ids = [c.id for c in CASES] + list(DEBUG_CASES) + list(CRASH_CASES)
    ids += ["keyboard_interrupt_in_run"]
    missing = [i for i in ids if f"`{i}`" not in text]
    assert missing == [], f"cases not in docs/errors.md: {missing}"


def test_at_least_twenty_cases() -> None:
    assert len(CASES) >= 20


def test_keyboard_interrupt_in_run_releases_and_propagates_unchanged() -> None:
    """A BaseException inside a node: plans released, streams synchronized, not wrapped."""
    ref = ToyModel(CONFIG, "mm")
    model = copy.deepcopy(ref)
    ctx = Ctx(model, make_microbatches(2, CONFIG))
    p0 = plan(ctx, 0)
    loss = ModelChunkSchedulePlan.run(p0, None)
    assert loss is not None

    def interrupted(node: TransformerLayerNode, inputs: tuple[Tensor, ...]) -> Tensor:
        raise KeyboardInterrupt

    patch(moe_layer(ctx), "slot_mlp", interrupted)  # plans take the slots when built
    p1 = plan(ctx, 1)
    with pytest.raises(KeyboardInterrupt) as info:
        ModelChunkSchedulePlan.run(p1, p0, b_grad=torch.ones_like(loss))
    assert type(info.value) is KeyboardInterrupt
    assert p0.released and p1.released
    undo_patches(model)
    model.zero_grad(set_to_none=True)
    mbs = make_microbatches(3, CONFIG, seed=5)
    plain_step(ref, mbs)
    combined_1f1b(model, mbs)
    assert_same(grads(model), grads(ref))


def test_mark_non_differentiable_takes_tensors_as_separate_arguments() -> None:
    """The node's and the plain path's PlainContext's: a tuple or a list of tensors, or
    anything but a tensor, is named; tensors (or none) are accepted."""
    from moe_overlap.blocks import PlainContext

    node = ScheduleNode(lambda x: x, cpu, CpuEvent(), name="n")
    plain = PlainContext(mo.ChunkState(Microbatch()))
    a, b = torch.ones(2), torch.zeros(2)
    for mark, who in (
        (node.mark_non_differentiable, "node 'n'"),
        (plain.mark_non_differentiable, "PlainContext"),
    ):
        mark(a, b)
        mark()
        for args, match in (
            (
                (bad((a, b)),),
                rf"^{who}: mark_non_differentiable: expected tensors as separate arguments, "
                r"received a tuple of 2 items \(Tensor\) as argument 0; call "
                r"mark_non_differentiable\(\*tensors\)$",
            ),
            ((a, bad([b])), r"received a list of 1 items \(Tensor\) as argument 1"),
            ((bad(1.0),), r"expected tensors .*received float as argument 0"),
        ):
            if DEBUG:  # beartype refuses what the annotation does not allow, first
                with pytest.raises(
                    TypeHintError, match=r"\.mark_non_differentiable\(\) parameter tensors="
                ):
                    mark(*args)
                continue
            with pytest.raises(IntegrationError, match=match):
                mark(*args)
    assert node.non_differentiable == (a, b)


def test_marked_non_differentiable_output_is_accepted() -> None:
    """node.mark_non_differentiable: a float output without grad on purpose runs, exactly."""
    ref = ToyModel(CONFIG, "mm")
    model = copy.deepcopy(ref)
    layer = model.decoder.layers[1]
    assert isinstance(layer, ToyLayer)

    def dispatch(node: TransformerLayerNode, inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        rows = ToyLayer.slot_dispatch(layer, node, inputs)
        assert isinstance(rows, Tensor)
        mask = torch.ones(rows.shape[0])  # a float mask that carries no gradient
        node.mark_non_differentiable(mask)
        return rows, mask

    def mlp(node: TransformerLayerNode, inputs: tuple[Tensor, ...]) -> Tensor | tuple[Tensor, ...]:
        rows, mask = inputs
        assert not mask.requires_grad
        return ToyLayer.slot_mlp(layer, node, (rows,))

    patch(layer, "slot_dispatch", dispatch)
    patch(layer, "slot_mlp", mlp)
    mbs = make_microbatches(3, CONFIG, seed=5)
    plain_step(ref, mbs)
    combined_1f1b(model, mbs)
    assert_same(grads(model), grads(ref))
    # Without the mark, the same slot is refused.
    undo_patches(model)

    def unmarked(node: TransformerLayerNode, inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        rows = ToyLayer.slot_dispatch(layer, node, inputs)
        assert isinstance(rows, Tensor)
        return rows, torch.ones(rows.shape[0])

    patch(layer, "slot_dispatch", unmarked)
    patch(layer, "slot_mlp", mlp)
    with pytest.raises(ScheduleError, match="output 1 .* does not require grad"):
        combined_1f1b(model, mbs)


def test_toy_delayed_weight_gradients_carry_no_graph() -> None:
    """backward_dw runs without autograd whatever the module does: no graph behind .grad."""
    model = ToyModel(CONFIG, "dm")
    model.set_delay(True)
    combined_1f1b(model, make_microbatches(2, CONFIG))
    delayed = [m.weight for m in model.modules() if isinstance(m, DelayedLinear)]
    assert delayed
    for weight in delayed:
        assert weight.grad is not None
        assert weight.grad.grad_fn is None and not weight.grad.requires_grad


DEBUG_CASES = {
    "debug_freed_input_saved_by_the_previous_slot": (
        "freed_input_read_in_backward",
        r"node 'moe_dispatch': the free-input policy releases this node's inputs after forward, "
        r"but autograd saved one of them \(or a view\) for backward: \['SoftmaxBackward0\.result'\]",
    ),
    "debug_freed_input_saved_by_the_slot": (
        "mlp_saves_its_freed_input",
        r"node 'mlp': .* autograd saved one of them .*MulBackward0",
    ),
    "debug_layer_state_aliases_a_freed_input": (
        "residual_is_the_dispatched_tensor",
        r"node 'moe_dispatch': tensor kept for a later slot \d+ .* shares storage with input 0",
    ),
    "debug_tensor_passed_without_node_detach": (
        "residual_without_node_detach",
        r"node 'moe_combine': its outputs depend on a tensor \(float32\[2, 8, 16\]\) that is not "
        r"a parameter, not one of its inputs and not handed on with node\.detach",
    ),
    "debug_final_norm_applied_by_the_plain_forward_only": (
        "final_norm_applied_by_the_plain_forward_only",
        r"^ToyModel: debug mode's first-step check ran microbatch 0 through the schedule and "
        r"through the model's own forward \(ToyModel\.forward\(microbatch\)\) and they "
        r"disagree: first parameter decoder\.final_layernorm\.weight: no gradient through "
        r"the schedule, one through the plain forward \(max abs [0-9.e-]+\)\. Something is "
        r"applied in another place.*decoder\.final_layernorm on a non-empty decoder",
    ),
    "debug_detach_copy_used_again_in_its_slot": (
        "detach_copy_used_again_in_its_slot",
        r"layer 1, slot pre_dispatch, forward.*node 'pre_dispatch_computation': its outputs "
        r"\(or another node\.detach copy\) depend on a node\.detach copy it made itself "
        r"\(float32\[2, 8, 16\]\)",
    ),
}
"""Debug-mode cases (``MOE_OVERLAP_DEBUG=1``, so in the debug interpreter): id -> (misuse, message)."""


def mlp_saves_its_freed_input(ctx: Ctx) -> None:
    layer = moe_layer(ctx)

    def mlp(node: TransformerLayerNode, inputs: tuple[Tensor, ...]) -> Tensor | tuple[Tensor, ...]:
        (rows,) = inputs
        return ToyLayer.slot_mlp(layer, node, (rows * rows,))  # mul saves its operands

    patch(layer, "slot_mlp", mlp)
    combined_1f1b(ctx.model, ctx.mbs)


def residual_is_the_dispatched_tensor(ctx: Ctx) -> None:
    layer = moe_layer(ctx)

    def pre_dispatch(node: TransformerLayerNode, inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        rows, probs = ToyLayer.slot_pre_dispatch(layer, node, inputs)
        node.layer_state.stash("rows", node.detach(rows))  # kept for combine, then freed
        return rows, probs

    patch(layer, "slot_pre_dispatch", pre_dispatch)
    combined_1f1b(ctx.model, ctx.mbs)


def residual_without_node_detach(ctx: Ctx) -> None:
    layer = moe_layer(ctx)

    def pre_dispatch(node: TransformerLayerNode, inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        (x,) = inputs
        a = layer._attention(x, node.chunk_state.rotary_pos_emb)
        rows, probs, route, _ = layer._route(a)
        node.layer_state.residual = a  # still in this slot's graph: no node.detach
        node.layer_state.stash("route", route)
        return rows, probs

    patch(layer, "slot_pre_dispatch", pre_dispatch)
    combined_1f1b(ctx.model, ctx.mbs)


def final_norm_applied_by_the_plain_forward_only(ctx: Ctx) -> None:
    # ToyModel.forward applies decoder.final_layernorm (as Megatron-Core's decoder does);
    # the schedule applies it only for an empty decoder: silent without debug mode.
    ctx.model.decoder.final_layernorm = torch.nn.RMSNorm(CONFIG.hidden)
    try:
        combined_1f1b(ctx.model, ctx.mbs)
    finally:
        ctx.model.decoder.final_layernorm = None


@pytest.mark.slow
def test_debug_mode_catalogue(debug_python: DebugPython) -> None:
    """In debug mode, free-input hazards are errors at the freeing slot's forward."""
    code = f"""
        import copy, re, sys
        import moe_overlap as mo
        from tests.engine import test_error_catalogue as cat
        from tests.engine.toy_model import ToyModel, grads, make_microbatches, plain_step
        from tests.engine.test_parity import assert_same
        cases = {DEBUG_CASES!r}
        for case_id, (fn, pattern) in cases.items():
            ref = ToyModel(cat.CONFIG, "mm")
            model = copy.deepcopy(ref)
            ctx = cat.Ctx(model, make_microbatches(2, cat.CONFIG))
            try:
                getattr(cat, fn)(ctx)
            except mo.ScheduleError as e:
                assert isinstance(e.__cause__, mo.IntegrationError), (case_id, repr(e.__cause__))
                assert re.search(pattern, str(e), re.DOTALL), (case_id, str(e))
            except mo.IntegrationError as e:  # raised before the step (the first-step check)
                assert re.search(pattern, str(e), re.DOTALL), (case_id, str(e))
                assert all(p.grad is None for p in model.parameters()), case_id
            else:
                raise AssertionError(case_id + ": no error")
            cat.undo_patches(model)
            model.zero_grad(set_to_none=True)
            mbs = make_microbatches(3, cat.CONFIG, seed=5)
            plain_step(ref, mbs)
            mo.combined_1f1b(model, mbs, loss_scale=1)  # an int is a float in debug mode too
            plain_grads = grads(ref)
            assert_same(grads(model), plain_grads)
        print("ok")
        """
    out = debug_python(code)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip() == "ok"


def test_debug_mode_leaves_a_slot_result_that_is_not_a_tensor_to_the_checks(
    debug_python: DebugPython,
) -> None:
    """Debug mode's walk of a slot's graph skips what is not a tensor (no AttributeError
    from it): the slot's result is refused with the library's own error, and the next step
    is exact (``slot_returns_non_tensor`` as in debug mode)."""
    out = debug_python(
        """
        from tests.engine import test_error_catalogue as cat
        assert cat.DEBUG
        cat.test_misuse(next(c for c in cat.CASES if c.id == "slot_returns_non_tensor"))
        print("ok")
        """
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip() == "ok"


# --- issue 24: what once crashed the process (run in a fresh interpreter, so a regression
# shows as a signal, not as a dead test run) --------------------------------------------------


def checkpoint_over_a_freed_input(ctx: Ctx, *, reentrant: bool = False) -> None:
    from torch.utils.checkpoint import checkpoint

    layer = moe_layer(ctx)

    def mlp(node: TransformerLayerNode, inputs: tuple[Tensor, ...]) -> Tensor:
        (rows,) = inputs  # mlp frees it (4 local experts)
        probs = node.layer_state.dispatched_probs
        assert probs is not None
        route = node.layer_state.take("route", Route)

        def experts(r: Tensor) -> Tensor:
            return layer._experts(r * 1.0, probs, route)  # rerun on rows in backward

        out: Tensor = checkpoint(experts, rows, use_reentrant=reentrant)
        return out

    patch(layer, "slot_mlp", mlp)
    combined_1f1b(ctx.model, ctx.mbs)


def checkpoint_reentrant_over_a_freed_input(ctx: Ctx) -> None:
    checkpoint_over_a_freed_input(ctx, reentrant=True)


def checkpoint_over_a_freed_combine_input(ctx: Ctx) -> None:
    from torch.utils.checkpoint import checkpoint

    layer = moe_layer(ctx)

    def combine(
        node: TransformerLayerNode, inputs: tuple[Tensor, ...]
    ) -> Tensor | tuple[Tensor, ...]:
        (y,) = inputs  # combine frees it

        def scaled(v: Tensor) -> Tensor:
            return torch.tanh(v) * 1.0  # rerun on y in backward

        out: Tensor = checkpoint(scaled, y, use_reentrant=False)
        return ToyLayer.slot_combine(layer, node, (out,))

    patch(layer, "slot_combine", combine)
    combined_1f1b(ctx.model, ctx.mbs)


def layer_state_read_after_its_input_was_freed(ctx: Ctx) -> None:
    layer = moe_layer(ctx)

    def pre_dispatch(node: TransformerLayerNode, inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        rows, probs = ToyLayer.slot_pre_dispatch(layer, node, inputs)
        node.layer_state.stash("rows", node.detach(rows))  # dispatch frees rows
        return rows, probs

    def combine(node: TransformerLayerNode, inputs: tuple[Tensor, ...]) -> Tensor:
        kept = node.layer_state.take("rows", Tensor)
        out = ToyLayer.slot_combine(layer, node, inputs)
        assert isinstance(out, Tensor)
        return out + (kept * 0.0).sum()

    patch(layer, "slot_pre_dispatch", pre_dispatch)
    patch(layer, "slot_combine", combine)
    combined_1f1b(ctx.model, ctx.mbs)


def freed_input_saved_by_an_elementwise_op(ctx: Ctx) -> None:
    layer = moe_layer(ctx)

    def pre_dispatch(node: TransformerLayerNode, inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        rows, probs = ToyLayer.slot_pre_dispatch(layer, node, inputs)
        return torch.tanh(rows), probs  # tanh saves its result; dispatch frees it

    patch(layer, "slot_pre_dispatch", pre_dispatch)
    combined_1f1b(ctx.model, ctx.mbs)


CRASH_CASES = {
    "crash_checkpoint_over_a_freed_input": (
        "checkpoint_over_a_freed_input",
        r"layer 1, slot mlp, forward.*node 'mlp': the free-input policy releases input 0 "
        r"\(float32\[32, 16\]\) right after this slot, but a recomputed region "
        r"\(torch\.utils\.checkpoint\) keeps it to rerun on in backward.*checkpoint\(fn, "
        r"x\.clone\(\)\).*ScheduleOptions\(free_input=False\)",
    ),
    "crash_checkpoint_over_a_freed_combine_input": (
        "checkpoint_over_a_freed_combine_input",
        r"layer 1, slot combine, forward.*node 'moe_combine': the free-input policy releases "
        r"input 0 \(float32\[32, 16\]\) right after this slot, but a recomputed region "
        r"\(torch\.utils\.checkpoint\) keeps it to rerun on in backward",
    ),
    "crash_checkpoint_reentrant_over_a_freed_input": (
        "checkpoint_reentrant_over_a_freed_input",
        r"node 'mlp': the free-input policy releases this node's inputs after forward, but "
        r"autograd saved one of them \(or a view\) for backward: "
        r"\['CheckpointFunctionBackward\.saved_tensors'\]",
    ),
    "crash_layer_state_aliases_a_freed_input": (
        "layer_state_read_after_its_input_was_freed",
        r"layer 1, slot dispatch, forward.*node 'moe_dispatch': tensor kept for a later slot "
        r"\d+ \(float32\[32, 16\]\) shares storage with input 0 \(it is "
        r"layer_state\.stash\('rows'\)\)",
    ),
    "crash_freed_input_saved_by_the_previous_slot": (
        "freed_input_saved_by_an_elementwise_op",
        r"node 'moe_dispatch': .* autograd saved one of them .*\['TanhBackward0\.result'\]",
    ),
    "crash_freed_input_saved_by_the_slot": (
        "mlp_saves_its_freed_input",
        r"node 'mlp': .* autograd saved one of them .*MulBackward0",
    ),
}
"""Misuses that killed the process with SIGSEGV (a backward or a recompute reading memory
free-input released), now refused before the release: id -> (misuse, message)."""


@pytest.mark.slow
def test_crash_catalogue() -> None:
    """Without debug mode, each is a library error at the freeing slot's forward, the
    process lives, and the same model then trains exactly."""
    code = f"""
        import copy, re
        import moe_overlap as mo
        from tests.engine import test_error_catalogue as cat
        from tests.engine.toy_model import ToyModel, grads, make_microbatches, plain_step
        from tests.engine.test_parity import assert_same
        for case_id, (fn, pattern) in {CRASH_CASES!r}.items():
            print(case_id, flush=True)
            ref = ToyModel(cat.CONFIG, "mm")
            model = copy.deepcopy(ref)
            ctx = cat.Ctx(model, make_microbatches(2, cat.CONFIG))
            try:
                getattr(cat, fn)(ctx)
            except mo.ScheduleError as e:
                assert isinstance(e.__cause__, mo.IntegrationError), (case_id, repr(e.__cause__))
                assert re.search(pattern, str(e), re.DOTALL), (case_id, str(e))
            else:
                raise AssertionError(case_id + ": no error")
            cat.undo_patches(model)
            model.zero_grad(set_to_none=True)
            mbs = make_microbatches(3, cat.CONFIG, seed=5)
            plain_step(ref, mbs)
            mo.combined_1f1b(model, mbs)
            assert_same(grads(model), grads(ref))
        print("ok")
        """
    out = run_python(code, debug=False)
    assert out.returncode >= 0, f"killed by signal {-out.returncode} after {out.stdout!r}"
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip().endswith("ok")
