"""DeepSeek-V3's multi-token-prediction layers through the torchtitan adapter.

torchtitan builds them with ``model_registry(..., num_mtp_layers=n)``: an ``MTPDecoder``
whose forward, after the blocks, runs the final norm, each MTP layer (a transformer block
on the embedding of the tokens shifted by its depth and the previous depth's hidden
states) and the LM head on every depth; ``MTPLoss`` adds the depths' cross-entropies. The
adapter runs that part of the model's own forward in post-process, its blocks stood in
for by the schedule's hidden states.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Sequence
from typing import cast

import pytest
import torch
from torch import Tensor, nn

from moe_overlap import ConfigError, Microbatch, combined_1f1b
from moe_overlap.adapters.torchtitan import LossFn, TorchtitanMoEAdapter
from tests.adapters._titan import batch, build, causal_stand_in
from tests.adapters.test_torchtitan import (
    as_microbatch,
    assert_bit_identical,
    assert_matches_torchtitan,
    grads,
    moe_buffers,
    plain_step,
    schedule,
)

DEPTHS = 2


@functools.cache
def _base() -> nn.Module:
    return causal_stand_in(build("deepseek_v3", num_mtp_layers=DEPTHS))


def mtp_model() -> nn.Module:
    return copy.deepcopy(_base())


def microbatches(model: nn.Module) -> list[Microbatch]:
    mbs = [as_microbatch(mb) for mb in batch(model, 3, seed=1)]
    # A second document starting mid-row in the first microbatch: MTP must not shift
    # tokens or labels across it.
    pos = mbs[0].position_ids
    assert pos is not None
    pos = pos.clone()
    pos[0, 9:] = torch.arange(pos.shape[1] - 9)
    mbs[0] = Microbatch(input_ids=mbs[0].input_ids, labels=mbs[0].labels, position_ids=pos)
    return mbs


def torchtitan_mtp_step(model: nn.Module, mbs: Sequence[Microbatch]) -> list[Tensor]:
    """torchtitan's own forward and ``MTPLoss`` over the labelled tokens."""
    from torchtitan.models.deepseek_v3.mtp import MTPLoss

    loss_fn = MTPLoss(MTPLoss.Config())
    losses = []
    for mb in mbs:
        assert mb.labels is not None
        preds = model(mb.input_ids, positions=mb.position_ids)
        assert isinstance(preds, list) and len(preds) == 1 + DEPTHS
        loss, _ = loss_fn(preds, mb.labels, None, positions=mb.position_ids)
        loss = loss / (mb.labels != -100).sum()
        loss.backward()
        losses.append(loss.detach())
    return losses


def test_mtp_plain_path_matches_torchtitan() -> None:
    """Losses, every gradient (the MTP layers' and the shared embedding and head
    included) and the token counts (the MTP layers' MoEs too) equal torchtitan's own
    forward and ``MTPLoss`` bit for bit."""
    model = mtp_model()
    mbs = microbatches(model)
    ours = TorchtitanMoEAdapter(copy.deepcopy(model), self_check=False)
    losses = plain_step(ours, mbs)
    ref_losses = torchtitan_mtp_step(model, mbs)
    assert any(n.startswith("mtp_layers.") for n, _ in model.named_parameters())
    assert_matches_torchtitan("deepseek_v3 (MTP)", ours.model, losses, model, ref_losses)


@pytest.mark.parametrize("fill_drain", [False, True], ids=["1f1b", "fill_drain"])
@pytest.mark.parametrize("delay", [False, True], ids=["wgrad", "delayed_wgrad"])
def test_mtp_schedule_is_bit_identical_to_plain_path(delay: bool, fill_drain: bool) -> None:
    """Also under fill and drain, whose backward passes interleave microbatches: the
    embedding's gradient from the MTP layers is added to its own per microbatch."""
    mbs = microbatches(_base())
    plain = TorchtitanMoEAdapter(mtp_model(), delay_wgrad_compute=delay)
    sched = TorchtitanMoEAdapter(mtp_model(), delay_wgrad_compute=delay, self_check=False)
    plain_losses = plain_step(plain, mbs, delay=delay)
    if fill_drain:
        got = combined_1f1b(sched, mbs, fill_drain=True, options=sched.schedule_options())
        losses = [x.detach() for x in got]
    else:
        losses = schedule(sched, mbs)
    where = f"MTP (delay_wgrad_compute={delay}, fill_drain={fill_drain}) schedule vs plain"
    assert all(torch.equal(a, b) for a, b in zip(losses, plain_losses, strict=True)), where
    assert_bit_identical(grads(sched.model), grads(plain.model), "gradients", where)
    assert_bit_identical(
        moe_buffers(sched.model, "tokens_per_expert_E"),
        moe_buffers(plain.model, "tokens_per_expert_E"),
        "tokens_per_expert_E",
        where,
    )


def test_mtp_loss_fn_takes_every_depth_and_the_positions() -> None:
    """A ``loss_fn`` gets the list of predictions (main, then one per depth), the labels
    and ``positions=``; without labels the adapter returns the main logits."""
    model = mtp_model()
    mb = microbatches(model)[0]
    seen: list[tuple[int, bool]] = []

    def loss_fn(preds: list[Tensor], labels: Tensor, *, positions: Tensor) -> Tensor:
        assert mb.position_ids is not None
        seen.append((len(preds), torch.equal(positions, mb.position_ids)))
        total = torch.stack([p.float().mean() for p in preds]).sum()
        return total + 0 * labels.sum()

    adapter = TorchtitanMoEAdapter(model, loss_fn=cast("LossFn", loss_fn), self_check=False)
    assert mb.input_ids is not None
    torch.autograd.backward(adapter.forward(mb.input_ids, mb.position_ids, labels=mb.labels))
    assert seen == [(1 + DEPTHS, True)]
    with torch.no_grad():
        logits = adapter.forward(mb.input_ids, mb.position_ids)
        own = model(mb.input_ids, positions=mb.position_ids)[0]
    torch.testing.assert_close(logits, own, rtol=1e-5, atol=1e-5 * float(own.abs().max()))


def test_mtp_refused_in_a_pipeline_stage() -> None:
    model = mtp_model()
    # What torchtitan's split leaves on an earlier stage.
    setattr(model, "lm_head", None)  # noqa: B010 - a module attribute set to None
    setattr(model, "norm", None)  # noqa: B010
    with pytest.raises(
        ConfigError,
        match=r"mtp_layers: expected multi-token-prediction layers only in a whole model",
    ):
        TorchtitanMoEAdapter(model, self_check=False)
