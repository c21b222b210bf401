"""CUDA-graph scopes of the reference model, on CPU: what is refused, how the graphed-wgrad
hook is plugged in, and that a graphed configuration computes exactly what an eager one
does where no GPU graphs it (the GPU side is ``test_gpu_graphs.py``)."""

from __future__ import annotations

import copy
import gc
from typing import Any

import pytest
import torch

from moe_overlap import (
    BackwardDWWrapper,
    ConfigError,
    CudaGraphModule,
    ScheduleOptions,
    combined_1f1b,
)
from moe_overlap.blocks import GraphedBlock
from moe_overlap.models import GPTMoEConfig, GPTMoEModel, MoELayer
from moe_overlap.protocols import GraphedWgradLayer
from moe_overlap.steps import ChunkShape, LayerShape, NodeSchedule, Slot
from tests.engine.test_node_schedule import random_order, with_recomputes

from ._helpers import SMALL, microbatches

ALL = (CudaGraphModule.attn, CudaGraphModule.moe_router, CudaGraphModule.mlp)


def _config(**changes: Any) -> GPTMoEConfig:
    base: dict[str, Any] = {
        "vocab_size": SMALL.vocab_size,
        "hidden_size": SMALL.hidden_size,
        "num_layers": SMALL.num_layers,
        "num_attention_heads": SMALL.num_attention_heads,
        "ffn_hidden_size": SMALL.ffn_hidden_size,
        "num_experts": SMALL.num_experts,
        "moe_ffn_hidden_size": SMALL.moe_ffn_hidden_size,
        "moe_shared_expert_hidden_size": 16,
    }
    return GPTMoEConfig(**(base | changes))


@pytest.mark.parametrize("scope", [CudaGraphModule.moe, CudaGraphModule.moe_preprocess])
def test_dynamic_shape_scopes_are_refused(scope: CudaGraphModule) -> None:
    with pytest.raises(ConfigError, match="change shape every microbatch"):
        _config(cuda_graph_modules=(scope,))


def test_graphs_with_recompute_are_refused() -> None:
    with pytest.raises(ConfigError, match="no recompute with CUDA graphs"):
        _config(cuda_graph_modules=(CudaGraphModule.attn,), recompute=("norm",))


@pytest.mark.parametrize("delay", [False, True])
def test_the_graphed_wgrad_hook_covers_the_graphed_scopes(delay: bool) -> None:
    model = GPTMoEModel(_config(cuda_graph_modules=ALL, delay_wgrad_compute=delay))
    layer = model.layer_list[1]
    assert isinstance(layer, MoELayer) and isinstance(layer, GraphedWgradLayer)
    wrapper = BackwardDWWrapper(layer)
    assert (wrapper.graphed_backward_dw_callable is not None) == delay
    eager = GPTMoEModel(_config(delay_wgrad_compute=delay)).layer_list[1]
    assert BackwardDWWrapper(eager).graphed_backward_dw_callable is None


@pytest.mark.parametrize("delay", [False, True])
def test_a_graphed_config_on_cpu_runs_eagerly_and_exactly(delay: bool) -> None:
    graphed = GPTMoEModel(_config(cuda_graph_modules=ALL, delay_wgrad_compute=delay))
    eager = GPTMoEModel(_config(delay_wgrad_compute=delay))
    mbs = microbatches(3, vocab=SMALL.vocab_size)
    got = combined_1f1b(graphed, mbs, options=graphed.schedule_options())
    want = combined_1f1b(eager, mbs, options=eager.schedule_options())
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    for p, q in zip(graphed.parameters(), eager.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad)
    blocks = graphed.graphed_blocks()
    assert len(blocks) == 2 * graphed.config.num_layers  # attn + (mlp or router) per layer
    assert all(b.copies == 0 and b.stats.eager_calls > 0 for b in blocks)


def test_a_copied_model_gets_its_own_uncaptured_blocks() -> None:
    model = GPTMoEModel(_config(cuda_graph_modules=ALL))
    twin = copy.deepcopy(model)
    for block, twin_block in zip(model.graphed_blocks(), twin.graphed_blocks(), strict=True):
        assert isinstance(twin_block, GraphedBlock)
        assert twin_block is not block and twin_block.modules[0] is not block.modules[0]
        assert twin_block.copies == 0
    layer = twin.layer_list[1]
    assert isinstance(layer, MoELayer)
    graph = layer.attn_block.graph
    assert graph is not None and graph.modules == (layer.attn_block,)


RECOMPUTED = (Slot.PRE_DISPATCH, Slot.MLP)


def node_schedule_of(
    model: GPTMoEModel, microbatches: int, *, recompute: bool, seed: int = 3
) -> NodeSchedule:
    """A random exact order of ``model``'s steps, three microbatches in flight, with ``W``
    steps when its weight gradients are delayed and (``recompute``) an ``R`` step for each
    pre-dispatch and mlp at a random place."""
    delay = model.config.delay_wgrad_compute
    shape = ChunkShape(
        layers=tuple(
            LayerShape(index=i, is_moe=isinstance(layer, MoELayer), delay_wgrad=delay)
            for i, layer in enumerate(model.layer_list)
        )
    )
    schedule = random_order(shape, microbatches, seed, in_flight=3)
    return with_recomputes(schedule, shape, seed) if recompute else schedule


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("delay", [False, True])
def test_a_graphed_config_on_cpu_runs_a_node_schedule_and_recompute_exactly(
    delay: bool, recompute: bool
) -> None:
    """A node schedule (three microbatches in flight) and the schedule's recompute reach
    the graphed scopes with no refusal; on a CPU they run eagerly, bit-identical to the eager
    model's plain backward(); each recomputed forward calls the block again."""
    graphed = GPTMoEModel(_config(cuda_graph_modules=ALL, delay_wgrad_compute=delay))
    eager = GPTMoEModel(_config())
    mbs = microbatches(4, vocab=SMALL.vocab_size)
    options = ScheduleOptions(delay_wgrad_compute=delay, recompute=RECOMPUTED if recompute else ())
    schedule = node_schedule_of(graphed, len(mbs), recompute=recompute)
    got = combined_1f1b(graphed, mbs, options=options, schedule=schedule)
    for mb, loss in zip(mbs, got, strict=True):
        assert mb.input_ids is not None
        want = eager(mb.input_ids, labels=mb.labels, loss_mask=mb.loss_mask)
        want.backward()
        assert torch.equal(loss, want.detach())
    for p, q in zip(graphed.parameters(), eager.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad)
    blocks = graphed.graphed_blocks()
    assert blocks and all(b.copies == 0 for b in blocks)
    assert {b.stats.eager_calls for b in blocks} == {len(mbs) * (2 if recompute else 1)}


@pytest.mark.parametrize(
    ("raised", "converted"),
    [
        ("CUDA error: operation failed due to a previous error during capture", True),
        ("operation not permitted when stream is capturing", True),
        ("CUDA out of memory", False),
    ],
)
def test_a_capture_cuda_invalidated_is_the_library_s_error_naming_causes_and_fixes(
    monkeypatch: pytest.MonkeyPatch, raised: str, converted: bool
) -> None:
    """A failed capture (torch raises a RuntimeError, the capture invalidated) becomes a
    ConfigError that names the block, its scope, the usual causes and the fixes, chained to
    torch's; any other error of the capture passes through unchanged."""
    linear = torch.nn.Linear(4, 4)
    block = GraphedBlock(linear, [linear], CudaGraphModule.mlp, label="layer 0 mlp")

    def fail(*_: object) -> None:
        raise RuntimeError(raised)

    monkeypatch.setattr(block, "_capture_claimed", fail)
    x = torch.zeros(2, 4, requires_grad=True)
    if not converted:
        with pytest.raises(RuntimeError, match="out of memory") as passed:
            block._capture([x], list(linear.parameters()))
        assert not isinstance(passed.value, ConfigError)
        return
    with pytest.raises(ConfigError) as info:
        block._capture([x], list(linear.parameters()))
    message = str(info.value)
    assert message.startswith("layer 0 mlp: capturing the CUDA graph of scope 'mlp' expected")
    assert raised in message and ".item()" in message and "eager output or loss" in message
    assert "out of cuda_graph_modules" in message and info.value.__cause__ is not None


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("fails", [False, True])
def test_the_collector_is_paused_while_a_block_captures_and_restored_after(
    monkeypatch: pytest.MonkeyPatch, enabled: bool, fails: bool
) -> None:
    """A dead reference cycle collected inside a capture would destroy its CUDA graphs there
    and invalidate the capture: the block turns Python's collector off while it captures and
    puts it back as it was after, the capture failed or not."""
    linear = torch.nn.Linear(4, 4)
    block = GraphedBlock(linear, [linear], CudaGraphModule.mlp, label="layer 0 mlp")
    seen: list[bool] = []

    def capture(*_: object) -> None:
        seen.append(gc.isenabled())
        if fails:
            raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(block, "_capture_claimed", capture)
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        x = torch.zeros(2, 4, requires_grad=True)
        if fails:
            with pytest.raises(ConfigError, match="capturing the CUDA graph"):
                block._capture([x], list(linear.parameters()))
        else:
            block._capture([x], list(linear.parameters()))
        assert seen == [False] and gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
