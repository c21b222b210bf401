"""Chunked all-to-alls under the experts (``moe_a2a_chunks`` / ``TokenDispatcher(chunks=K)``).

The schedule (serial, overlapped, fill/drain) against plain per-microbatch backward of the
same chunked model, bit for bit; K=1 as the model without the option; K>1 close to K=1;
refusals; the delayed expert wgrads summed as autograd sums them; EP=2 over gloo.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from moe_overlap import ChunkState, ConfigError, IntegrationError, Microbatch, WgradError
from moe_overlap.blocks import GroupedExperts, PlainContext, TokenDispatcher, chunk_sizes
from moe_overlap.models import GPTMoEConfig, GPTMoEModel, MoELayer
from moe_overlap.wgrad import claim_wgrad
from tests.conftest import DebugPython
from tests.models._helpers import SMALL, check_parity, microbatches

# SMALL's microbatches: batch 2 x seq 16 = 32 tokens; 3 does not divide them, 40 exceeds them
# (empty chunks).
MODES = {"serial": (False, False), "overlap": (True, False), "fill_drain": (True, True)}
CASES: dict[str, dict[str, object]] = {
    "mixed": {},
    "shared_delay_aux": {
        "moe_shared_expert_hidden_size": 8,
        "delay_wgrad_compute": True,
        "moe_aux_loss_coeff": 0.01,
    },
    "loopback_delay": {"dispatcher": "loopback", "delay_wgrad_compute": True},
    "moe_only_recompute": {"first_k_dense": 0, "recompute": ("activation", "norm")},
}


def test_chunk_sizes() -> None:
    assert chunk_sizes(32, 1) == [32]
    assert chunk_sizes(32, 3) == [11, 11, 10]
    assert chunk_sizes(2, 4) == [1, 1, 0, 0]
    assert chunk_sizes(0, 2) == [0, 0]
    for t in range(9):
        for k in range(1, 5):
            assert chunk_sizes(t, k) == [len(c) for c in torch.arange(t).tensor_split(k)]


@pytest.mark.parametrize("chunks", [1, 2, 3])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("mode", sorted(MODES))
def test_schedule_bit_identical_to_plain(chunks: int, case: str, mode: str) -> None:
    overlap, fill_drain = MODES[mode]
    fields: dict[str, object] = {"moe_a2a_chunks": chunks, **CASES[case]}
    config = dataclasses.replace(SMALL, **fields)  # type: ignore[arg-type]
    result = check_parity(config, overlap=overlap, fill_drain=fill_drain, padded=case != "mixed")
    assert result.ok, result


@pytest.mark.parametrize("free_input", [False, True])
def test_more_chunks_than_tokens(free_input: bool) -> None:
    """K=40 > 32 tokens: empty chunks still send, compute and return nothing, exactly."""
    config = dataclasses.replace(
        SMALL, moe_a2a_chunks=40, delay_wgrad_compute=True, moe_shared_expert_hidden_size=8
    )
    result = check_parity(config, free_input=free_input, fill_drain=True)
    assert result.ok, result


def _plain_grads(model: GPTMoEModel) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    losses = []
    for mb in microbatches(2, vocab=model.config.vocab_size, padded=True):
        assert mb.input_ids is not None
        loss = model(
            mb.input_ids,
            mb.position_ids,
            mb.labels,
            mb.loss_mask,
            attention_mask=mb.attention_mask,
            padding_mask=mb.padding_mask,
        )
        loss.backward()
        losses.append(loss.detach())
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return losses, grads


def test_one_chunk_is_the_model_without_the_option() -> None:
    base = dataclasses.replace(SMALL, moe_shared_expert_hidden_size=8)
    a = GPTMoEModel(base)
    b = GPTMoEModel(dataclasses.replace(base, moe_a2a_chunks=1))
    b.load_state_dict(a.state_dict())
    la, ga = _plain_grads(a)
    lb, gb = _plain_grads(b)
    assert all(torch.equal(x, y) for x, y in zip(la, lb, strict=True))
    assert ga.keys() == gb.keys()
    assert all(torch.equal(ga[n], gb[n]) for n in ga)


@pytest.mark.parametrize("chunks", [2, 3])
def test_chunked_close_to_unchunked(chunks: int) -> None:
    """Other GEMM shapes, other rounding: equal to a tolerance, not bit for bit."""
    base = dataclasses.replace(SMALL, moe_shared_expert_hidden_size=8, moe_aux_loss_coeff=0.01)
    a = GPTMoEModel(base)
    b = GPTMoEModel(dataclasses.replace(base, moe_a2a_chunks=chunks))
    b.load_state_dict(a.state_dict())
    la, ga = _plain_grads(a)
    lb, gb = _plain_grads(b)
    for x, y in zip(la, lb, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    assert ga.keys() == gb.keys()
    for n in ga:
        torch.testing.assert_close(ga[n], gb[n], rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("value", [0, -1, 2.0, True, "2", None])
def test_config_refuses_a_bad_chunk_count(value: Any) -> None:
    with pytest.raises(ConfigError, match=r"GPTMoEConfig\.moe_a2a_chunks: expected an int >= 1"):
        GPTMoEConfig(moe_a2a_chunks=value)


@pytest.mark.parametrize("value", [0, 1.5, False])
def test_dispatcher_refuses_a_bad_chunk_count(value: Any) -> None:
    with pytest.raises(ConfigError, match=r"TokenDispatcher: chunks must be an int >= 1"):
        TokenDispatcher(4, 2, chunks=value)


def test_layer_refuses_a_dispatcher_of_another_chunk_count() -> None:
    config = dataclasses.replace(SMALL, moe_a2a_chunks=2)
    with pytest.raises(ConfigError, match=r"chunks=2 \(moe_a2a_chunks\).*chunks=1"):
        MoELayer(config, 1, TokenDispatcher(4, 2), None)


def test_chunked_slots_refuse_an_unchunked_plan() -> None:
    """A chunked dispatcher's mlp/combine after another dispatcher's pre-dispatch: an
    IntegrationError naming the missing chunk plan, not a wrong result."""
    ctx = PlainContext(ChunkState(Microbatch()))
    one, two = TokenDispatcher(4, 2), TokenDispatcher(4, 2, chunks=2)
    h = torch.randn(6, 8)
    tokens, probs = one.slot_permute(ctx, h, torch.rand(6, 2), torch.randint(0, 4, (6, 2)))
    with pytest.raises(IntegrationError, match="chunk plan"):
        two.slot_dispatch(ctx, tokens, probs)


def _experts_twice(delay: bool, calls: int) -> GroupedExperts:
    torch.manual_seed(0)
    experts = GroupedExperts(2, 8, 16, expert_offset=0, delay_wgrad=delay, calls_per_backward=calls)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_()
    return experts


def test_delayed_wgrad_of_experts_called_per_chunk_equals_immediate() -> None:
    """``calls_per_backward=2``: two calls, one backward_dw sums the two wgrads as autograd
    sums them, then accumulates; bit-identical to immediate over two steps."""
    immediate, delayed = _experts_twice(False, 1), _experts_twice(True, 2)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):  # the second step accumulates onto existing grads
        xs = [torch.randn(n, 8, generator=g) for n in (5, 3)]
        sizes = [(2, 3), (3, 0)]
        for experts in (immediate, delayed):
            out = sum(experts(x, s).square().sum() for x, s in zip(xs, sizes, strict=True))
            assert isinstance(out, torch.Tensor)
            with claim_wgrad(delayed):
                torch.autograd.backward(out)
        assert delayed.fc1.pending_wgrad == 2
        delayed.backward_dw()
        assert delayed.fc1.pending_wgrad == 0
        for a, b in zip(immediate.parameters(), delayed.parameters(), strict=True):
            assert a.grad is not None and b.grad is not None
            assert torch.equal(a.grad, b.grad)


def test_delayed_wgrad_refuses_fewer_calls_than_declared() -> None:
    experts = _experts_twice(True, 3)
    with claim_wgrad(experts):
        experts(torch.randn(4, 8), [1, 3]).sum().backward()
    with pytest.raises(WgradError, match=r"expected 3 pending weight gradients.*received 1"):
        experts.backward_dw()


def test_calls_per_backward_refused() -> None:
    with pytest.raises(ConfigError, match="calls_per_backward must be an int >= 1"):
        GroupedExperts(2, 8, 16, expert_offset=0, delay_wgrad=True, calls_per_backward=0)


def test_debug_mode_first_step_check_and_parity(debug_python: DebugPython) -> None:
    """Debug mode (beartype on every call, the slot hand-off checks, the first-step plain
    comparison) accepts the chunked slots and the step stays bit-identical."""
    result = debug_python(
        """
        import dataclasses, torch
        torch.use_deterministic_algorithms(True)
        from tests.models._helpers import SMALL, check_parity
        config = dataclasses.replace(
            SMALL, moe_a2a_chunks=3, delay_wgrad_compute=True, moe_shared_expert_hidden_size=8
        )
        r = check_parity(config, fill_drain=True, padded=True)
        print(r.ok, r.first_step_check)
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["True", "compared"], result.stdout


EP_CASES = (
    "chunks3_shared_delay",
    "chunks2_starved_fill_drain",
    "chunks2_no_overlap",
    "chunks40_padded_aux",
)


@pytest.mark.slow
def test_ep2_chunked_bit_identical(ep2_rows: list[dict[str, object]]) -> None:
    """EP=2 over gloo (``ep_worker``'s launch with every case, shared with
    ``tests/models/test_ep.py``): each chunk its own all-to-all with its own splits; every
    rank's losses and gradients match plain backward bit for bit."""
    rows = [r for r in ep2_rows if r["case"] in EP_CASES]
    assert sorted((str(r["case"]), int(str(r["rank"]))) for r in rows) == sorted(
        (c, r) for c in EP_CASES for r in (0, 1)
    )
    for r in rows:
        assert r["losses_equal"] and r["mismatched"] == [] and r["missing"] == [], r
