"""combined_1f1b against plain per-microbatch backward on the reference model (EP=1)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_overlap import (
    WgradLayer,
    combined_1f1b,
)
from moe_overlap.engine._conformance import check_layer, check_model
from moe_overlap.models import GPTMoEModel, MoELayer
from tests.models._helpers import SMALL, check_parity, microbatches

CASES = {
    "dense_only": {"first_k_dense": 3},
    "moe_only": {"first_k_dense": 0},
    "mixed": {},
    "mixed_shared": {"moe_shared_expert_hidden_size": 8},
    "mixed_delay": {"delay_wgrad_compute": True},
    "shared_delay_aux": {
        "moe_shared_expert_hidden_size": 8,
        "delay_wgrad_compute": True,
        "moe_aux_loss_coeff": 0.01,
    },
    "dense_delay": {"first_k_dense": 3, "delay_wgrad_compute": True},
    "one_local_expert": {"num_experts": 1, "moe_router_topk": 1},
    "top3_sdpa": {"moe_router_topk": 3, "attention": "sdpa"},
    "loopback": {"dispatcher": "loopback", "delay_wgrad_compute": True},
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bit_identical(name: str) -> None:
    config = dataclasses.replace(SMALL, **CASES[name])  # type: ignore[arg-type]
    result = check_parity(config)
    assert result.ok, result


@pytest.mark.parametrize("delay", [False, True])
def test_starved_experts(delay: bool) -> None:
    """Experts 1 and 2 get no token; their (zero) grads still match bit for bit."""
    config = dataclasses.replace(SMALL, delay_wgrad_compute=delay, moe_shared_expert_hidden_size=8)
    result = check_parity(config, starved=(1, 2))
    assert result.tokens_per_expert[1] == result.tokens_per_expert[2] == 0
    assert sum(result.tokens_per_expert) == 2 * 16 * config.moe_router_topk  # batch * seq * k
    assert result.ok, result


def test_bf16() -> None:
    config = dataclasses.replace(SMALL, dtype=torch.bfloat16, delay_wgrad_compute=True)
    assert check_parity(config).ok


@pytest.mark.parametrize("free_input", [False, True])
def test_free_input_and_loss_scale(free_input: bool) -> None:
    result = check_parity(
        dataclasses.replace(SMALL, delay_wgrad_compute=True),
        free_input=free_input,
        loss_scale=0.25,
        n_micro=4,
    )
    assert result.ok, result


def test_single_microbatch() -> None:
    assert check_parity(SMALL, n_micro=1).ok


def test_forward_equals_schedule_plain_mode() -> None:
    """model.forward + backward == combined_1f1b(overlap=False), losses and grads."""
    config = dataclasses.replace(SMALL, moe_shared_expert_hidden_size=8)
    assert check_parity(config, overlap=False).ok


def test_plain_mode_equals_overlap() -> None:
    a = GPTMoEModel(SMALL)
    b = GPTMoEModel(SMALL)
    data = microbatches(3, vocab=SMALL.vocab_size)
    la = combined_1f1b(a, data, overlap=False)
    lb = combined_1f1b(b, data, overlap=True)
    assert all(torch.equal(x, y) for x, y in zip(la, lb, strict=True))
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert torch.equal(p.grad, q.grad)


def test_logits_without_labels() -> None:
    model = GPTMoEModel(SMALL)
    ids = torch.randint(0, SMALL.vocab_size, (2, 8))
    logits = model(ids)
    assert logits.shape == (2, 8, SMALL.vocab_size)


def test_protocols() -> None:
    model = GPTMoEModel(
        dataclasses.replace(SMALL, moe_shared_expert_hidden_size=8, delay_wgrad_compute=True)
    )
    # The library checks integrations member by member (isinstance against a runtime
    # Protocol misses nn.Module submodules on Python 3.12+).
    assert check_model(model) is model
    assert model.decoder.final_layernorm is None
    for i, layer in enumerate(model.layer_list):
        assert check_layer(layer, f"layer {i}") is layer
        for scope in layer.pre_dispatch_wgrad():
            assert isinstance(scope.module, WgradLayer)
        assert all(isinstance(m, WgradLayer) for m in layer.mlp_wgrad())
    moe = [layer for layer in model.layer_list if isinstance(layer, MoELayer)]
    assert [s.scope.name for s in moe[0].pre_dispatch_wgrad()] == ["attn", "moe_router"]
    assert moe[0].num_local_experts == SMALL.num_experts
    # Built without delayed wgrad, the layers list nothing: the schedule delays nothing.
    eager = GPTMoEModel(SMALL)
    assert all(not layer.pre_dispatch_wgrad() for layer in eager.layer_list)
    assert all(not layer.mlp_wgrad() for layer in eager.layer_list)


def test_rotary_flows_through_chunk_state() -> None:
    """Stretching position_ids changes the loss: the layers read the preprocess rotary.

    (A uniform shift would not: rotary attention depends on relative positions only.)
    """
    model = GPTMoEModel(SMALL)
    mb = microbatches(1, vocab=SMALL.vocab_size)[0]
    assert mb.position_ids is not None
    stretched = dataclasses.replace(mb, position_ids=mb.position_ids * 3)
    (a,) = combined_1f1b(model, [mb])
    (b,) = combined_1f1b(model, [stretched])
    assert not torch.equal(a, b)


def test_aux_loss_gradient_follows_the_loss_scale() -> None:
    """With ``set_aux_loss_scale(s)`` and the loss scaled by ``s``, every grad scales by ``s``."""
    config = dataclasses.replace(SMALL, first_k_dense=0, moe_aux_loss_coeff=0.1)
    mbs = microbatches(2, vocab=config.vocab_size, seed=3)

    def grads_with(scale: float) -> list[torch.Tensor]:
        model = GPTMoEModel(config)
        model.set_aux_loss_scale(scale)
        combined_1f1b(model, mbs, options=model.schedule_options(), loss_scale=scale)
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    for full, half in zip(grads_with(1.0), grads_with(0.5), strict=True):
        torch.testing.assert_close(half, 0.5 * full, rtol=1e-5, atol=1e-8)
