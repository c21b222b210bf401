"""CUDA-graph scopes of the reference model, on CPU: what is refused, how the graphed-wgrad
hook is plugged in, and that a graphed configuration computes exactly what an eager one
does where no GPU graphs it (the GPU side is ``test_gpu_graphs.py``)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from moe_overlap import BackwardDWWrapper, ConfigError, CudaGraphModule, combined_1f1b
from moe_overlap.blocks import GraphedBlock
from moe_overlap.models import GPTMoEConfig, GPTMoEModel, MoELayer
from moe_overlap.protocols import GraphedWgradLayer

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
