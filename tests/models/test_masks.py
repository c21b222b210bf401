"""Attention and padding masks on the reference model: exact through the schedule, padded
tokens contributing nothing, wrong masks refused at plan build."""

from __future__ import annotations

import dataclasses
import re
from typing import Literal

import pytest
import torch
from torch import Tensor

from moe_overlap import (
    ConfigError,
    Microbatch,
    ModelChunkSchedulePlan,
    ScheduleError,
    combined_1f1b,
)
from moe_overlap.blocks import SelfAttention, TopKRouter, blocked_keys
from moe_overlap.models import GPTMoEConfig, GPTMoEModel, GPTMoEStage
from tests.models._helpers import SMALL, check_parity, microbatches

MASKED = dataclasses.replace(SMALL, moe_aux_loss_coeff=0.01, moe_shared_expert_hidden_size=8)


@pytest.mark.parametrize(
    ("fields", "fill_drain"),
    [
        ({"attention": "math"}, False),
        ({"attention": "sdpa", "delay_wgrad_compute": True}, False),
        ({"attention": "math", "delay_wgrad_compute": True}, True),
        ({"attention": "sdpa", "recompute": ("attention",)}, True),
        ({"attention": "math", "recompute": ("attention_core", "norm")}, False),
    ],
    ids=["math", "sdpa-delay", "math-delay-fill-drain", "sdpa-recompute", "math-recompute-core"],
)
def test_masked_schedule_is_bit_identical(fields: dict[str, object], fill_drain: bool) -> None:
    config = dataclasses.replace(MASKED, **fields)  # type: ignore[arg-type]
    result = check_parity(config, padded=True, fill_drain=fill_drain)
    assert result.ok, result


def _step(model: GPTMoEModel, mbs: list[Microbatch]) -> tuple[list[Tensor], dict[str, Tensor]]:
    losses = combined_1f1b(model, mbs)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return losses, grads


def _repadded(mbs: list[Microbatch], vocab: int) -> list[Microbatch]:
    """The same microbatches with other token ids and labels at the padded positions."""
    gen = torch.Generator().manual_seed(7)
    out: list[Microbatch] = []
    for mb in mbs:
        assert mb.input_ids is not None and mb.labels is not None and mb.padding_mask is not None
        ids, labels, pad = mb.input_ids.clone(), mb.labels.clone(), mb.padding_mask
        ids[pad] = torch.randint(0, vocab, (int(pad.sum()),), generator=gen)
        labels[pad] = torch.randint(0, vocab, (int(pad.sum()),), generator=gen)
        out.append(dataclasses.replace(mb, input_ids=ids, labels=labels))
    return out


@pytest.mark.parametrize("attention", ["math", "sdpa"])
@pytest.mark.parametrize("moe", [False, True])
def test_padded_tokens_contribute_nothing(attention: str, moe: bool) -> None:
    """Other ids and labels at the padded positions give the same losses and gradients:
    padded keys are masked in attention, padded positions are out of the loss and of the
    aux loss. Dense layers: bit for bit. MoE layers route padded tokens like any other
    (Megatron-Core's choice), so their content changes how many rows each expert's GEMM
    gets, hence the rounding: equal to float32 rounding. The masks do change the result."""
    config = dataclasses.replace(
        MASKED,
        attention=attention,  # type: ignore[arg-type]
        first_k_dense=1 if moe else MASKED.num_layers,
    )
    data = microbatches(2, vocab=config.vocab_size, padded=True)
    other = _repadded(data, config.vocab_size)
    losses, grads = _step(GPTMoEModel(config), data)
    other_losses, other_grads = _step(GPTMoEModel(config), other)
    assert grads.keys() == other_grads.keys()
    if moe:
        assert all(
            torch.allclose(a, b, rtol=1e-6) for a, b in zip(losses, other_losses, strict=True)
        )
        assert all(torch.allclose(grads[n], other_grads[n], rtol=1e-4, atol=1e-7) for n in grads)
    else:
        assert all(torch.equal(a, b) for a, b in zip(losses, other_losses, strict=True))
        assert all(torch.equal(grads[n], other_grads[n]) for n in grads)
    unmasked = [dataclasses.replace(mb, padding_mask=None, attention_mask=None) for mb in other]
    plain_losses, _ = _step(GPTMoEModel(config), unmasked)
    assert not torch.allclose(plain_losses[0], other_losses[0], rtol=1e-4)


@pytest.mark.parametrize("impl", ["math", "sdpa"])
def test_a_query_without_keys_attends_nothing(impl: Literal["math", "sdpa"]) -> None:
    """Left padding: query 0 of row 0 has no key left; its output is zero, no NaN either
    way, and both impls agree on the rows that do attend."""
    torch.manual_seed(0)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[0, :2] = True
    keys = blocked_keys(None, pad, 6, torch.device("cpu"))
    assert keys is not None
    assert keys.dead[0, 0, :, 0].tolist() == [True, True, False, False, False, False]
    assert not keys.dead[1].any()
    attn = SelfAttention(16, 2, impl=impl, delay_wgrad=False)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(std=0.2)
    x = torch.randn(2, 6, 16, requires_grad=True)
    cos, sin = torch.ones(1, 1, 6, 8), torch.zeros(1, 1, 6, 8)
    out = attn(x, cos, sin, keys.blocked, keys.dead)
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and torch.isfinite(out).all()
    proj_bias = attn.proj(torch.zeros(16))
    assert torch.allclose(out[0, :2], proj_bias.expand(2, 16))
    math = SelfAttention(16, 2, impl="math", delay_wgrad=False)
    math.load_state_dict(attn.state_dict())
    ref = math(x, cos, sin, keys.blocked, keys.dead)
    assert torch.allclose(out, ref, atol=1e-6)


def test_aux_loss_counts_only_real_tokens() -> None:
    torch.manual_seed(0)
    router = TopKRouter(8, 4, 2, aux_loss_coeff=0.1)
    torch.nn.init.normal_(router.weight)
    scores = torch.softmax(torch.randn(10, 4), dim=-1)
    pad = torch.tensor([True, True, False, False, False, False, False, False, True, False])
    masked = router._aux_loss(scores, pad)
    real = router._aux_loss(scores[~pad])
    assert torch.allclose(masked, real, rtol=1e-6)
    nothing = router._aux_loss(scores, torch.ones(10, dtype=torch.bool))
    assert nothing.item() == 0.0


def _mb(**fields: object) -> Microbatch:
    (mb,) = microbatches(1, vocab=SMALL.vocab_size, padded=True)
    return dataclasses.replace(mb, **fields)  # type: ignore[arg-type]


BAD: dict[str, tuple[dict[str, object], str]] = {
    "attention_mask_float": (
        {"attention_mask": torch.zeros(2, 1, 16, 16)},
        r"attention_mask: expected a bool tensor of shape \[B or 1, 1, S or 1, S\] = "
        r"\[2 or 1, 1, 16 or 1, 16\].*received a float32 tensor of shape \[2, 1, 16, 16\]",
    ),
    "attention_mask_2d": (
        {"attention_mask": torch.ones(2, 16, dtype=torch.bool)},
        r"attention_mask: expected .*for padding pass padding_mask \[B, S\].*shape \[2, 16\]",
    ),
    "padding_mask_int": (
        {"padding_mask": torch.zeros(2, 16, dtype=torch.long)},
        r"padding_mask: expected a bool tensor of shape \[B, S\] = \[2, 16\] \(True at "
        r"padding tokens\), received a int64 tensor",
    ),
    "padding_mask_shape": (
        {"padding_mask": torch.zeros(2, 15, dtype=torch.bool)},
        r"padding_mask: expected a bool tensor of shape \[B, S\] = \[2, 16\]",
    ),
    "padding_without_loss_mask": (
        {"loss_mask": None},
        r"padding_mask is set with labels but no loss_mask.*\(~padding_mask\)\.float\(\)",
    ),
    "loss_mask_shape": (
        {"loss_mask": torch.ones(32)},
        r"loss_mask: expected shape \[B, S\] = \[2, 16\]",
    ),
    "labels_int32": (  # a tokenizer's int32 ids: cross_entropy takes int64 (or uint8) targets
        {"labels": torch.zeros(2, 16, dtype=torch.int32)},
        r"labels: expected an int64 \(or uint8\) tensor of token ids \[B, S\], received a "
        r"int32 tensor of shape \[2, 16\]; pass labels\.long\(\)",
    ),
    "labels_float": (
        {"labels": torch.zeros(2, 16)},
        r"labels: expected an int64 \(or uint8\) tensor .*received a float32 tensor",
    ),
    "input_ids_float": (
        {"input_ids": torch.zeros(2, 16)},
        r"input_ids: expected an int64 \(or int32\) tensor of token ids \[B, S\], received a "
        r"float32 tensor of shape \[2, 16\]; pass input_ids\.long\(\)",
    ),
    "input_ids_1d": (  # one sequence without its batch dimension
        {"input_ids": torch.zeros(16, dtype=torch.long)},
        r"input_ids: expected an int64 \(or int32\) tensor of token ids \[B, S\], received a "
        r"int64 tensor of shape \[16\]; .*input_ids\[None\]",
    ),
    "position_ids_1d": (
        {"position_ids": torch.arange(16)},
        r"position_ids: expected shape \[B or 1, S\] = \[2 or 1, 16\] \(the tokens'\), "
        r"received a int64 tensor of shape \[16\]",
    ),
    "position_ids_longer": (
        {"position_ids": torch.arange(17).expand(2, 17)},
        r"position_ids: expected shape \[B or 1, S\] = \[2 or 1, 16\].*shape \[2, 17\]",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_wrong_masks_are_refused_at_plan_build(case: str) -> None:
    """combined_1f1b (before any node, microbatch named), the plan built directly and the
    plain forward refuse the same misuse; nothing ran, so nothing is to undo."""
    fields, match = BAD[case]
    model = GPTMoEModel(SMALL)
    good = _mb()
    bad = _mb(**fields)
    with pytest.raises(ConfigError, match=re.compile(r"GPTMoEModel: " + match, re.DOTALL)):
        combined_1f1b(model, [good, bad])
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(ConfigError, match=match):
        ModelChunkSchedulePlan(model, bad)
    assert bad.input_ids is not None
    with pytest.raises(ConfigError, match=match):
        model(
            bad.input_ids,
            bad.position_ids,
            bad.labels,
            bad.loss_mask,
            attention_mask=bad.attention_mask,
            padding_mask=bad.padding_mask,
        )


def test_a_later_stage_checks_its_masks_against_its_input_at_run_time() -> None:
    """A plan of a later stage built without its input knows no shape: the layers check."""
    config = GPTMoEConfig(num_layers=2, hidden_size=16, ffn_hidden_size=32, num_experts=4)
    model = GPTMoEModel(config)
    stage = GPTMoEStage(model, range(1, 2))
    plan = ModelChunkSchedulePlan(
        stage, Microbatch(padding_mask=torch.zeros(2, 5, dtype=torch.bool))
    )
    setattr(stage.decoder, "input_tensor", torch.randn(2, 8, 16, requires_grad=True))  # noqa: B010
    with pytest.raises(ScheduleError, match=r"padding_mask: expected .* \[2, 8\]") as info:
        ModelChunkSchedulePlan.run(plan, None)
    assert isinstance(info.value.__cause__, ConfigError)
