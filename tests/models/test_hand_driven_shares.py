"""The reference model driven by hand refuses a parameter two nodes use, as combined_1f1b.

Megatron-Core's own loop (``build_schedule_plan`` per microbatch, then
``ModelChunkSchedulePlan.run(f, b, b_grad)``: ``F0 | F1+B0 | ... | B(N-1)``) on
:class:`~moe_overlap.models.GPTMoEModel`, whose config does not tie the output layer to
the embedding: tied by hand, a router or norm shared by two layers, a layer listed twice.
Each is refused when the run that backs the first microbatch returns (a module two delaying
layers list: at plan build), also after clean runs; undone, the model trains exactly.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import Tensor

from moe_overlap import IntegrationError, Microbatch, ModelChunkSchedulePlan, combined_1f1b
from moe_overlap.engine._torch_wrappers import has_grad_hooks
from moe_overlap.megatron import build_schedule_plan
from moe_overlap.models import GPTMoEModel
from tests.models._helpers import SMALL, assert_matches_plain
from tests.models.test_model_changes import SHARES, TWO_LAYERS


def _microbatches(seed: int) -> list[Microbatch]:
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, SMALL.vocab_size, (2, 8), generator=g) for _ in range(3)]
    return [Microbatch(input_ids=x, labels=x.roll(-1, 1)) for x in ids]


def hand_step(model: GPTMoEModel, mbs: list[Microbatch]) -> list[Tensor]:
    """Megatron-Core's combined 1F1B without pipelining, by hand; the losses."""
    losses: list[Tensor] = []
    back: ModelChunkSchedulePlan | None = None
    for i, mb in enumerate(mbs):
        plan = build_schedule_plan(model, mb.input_ids, None, None, labels=mb.labels, index=i)
        grad = torch.ones_like(losses[-1]) if back is not None else None
        out = ModelChunkSchedulePlan.run(plan, back, b_grad=grad)
        assert out is not None
        losses.append(out.detach())
        back = plan
    assert back is not None
    ModelChunkSchedulePlan.run(None, back, b_grad=torch.ones_like(losses[-1]))
    return losses


TWO_NODES = (
    IntegrationError,
    r"^ModelChunkSchedulePlan\.run: GPTMoEModel: expected each parameter's gradient "
    r"accumulated into \.grad at most once per microbatch \(by one node's backward\), "
    r"received more accumulations than the 1 microbatch the run backs \(microbatch 0\) for "
    r"\['.* = .* \(2 accumulations\)'",
)


@pytest.mark.parametrize("clean_by", ["hand", "combined_1f1b"])
@pytest.mark.parametrize("delay", [False, True])
@pytest.mark.parametrize("change", list(SHARES))
def test_a_parameter_two_nodes_use_is_refused_by_hand(
    change: str, delay: bool, clean_by: str
) -> None:
    model = GPTMoEModel(dataclasses.replace(SMALL, delay_wgrad_compute=delay))
    for _ in range(2):  # clean: later runs count nothing ...
        if clean_by == "hand":
            hand_step(model, _microbatches(0))
        else:
            combined_1f1b(model, _microbatches(0))
    undo = SHARES[change](model)  # ... until the parameters change
    kind, match = TWO_LAYERS if delay and change == "a layer listed twice" else TWO_NODES
    with pytest.raises(kind, match=match):
        hand_step(model, _microbatches(1))
    assert not any(has_grad_hooks(p) for p in model.parameters())
    undo()
    model.zero_grad(set_to_none=True)
    plain = copy.deepcopy(model)
    mbs = _microbatches(2)
    losses = hand_step(model, mbs)
    assert_matches_plain(model, plain, mbs, losses)
