"""TopKRouter: softmax or sigmoid scores, selection bias, group-limited top-k, normalization."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from moe_overlap import ConfigError
from moe_overlap.blocks import TopKRouter


def router(**kw: Any) -> TopKRouter:
    torch.manual_seed(0)
    r = TopKRouter(8, 8, 4, aux_loss_coeff=0.0, **kw)
    torch.nn.init.normal_(r.weight)
    return r


def test_sigmoid_normalized_scaled_probs_are_the_chosen_scores() -> None:
    r = router(score="sigmoid", normalize=True, scaling=2.5)
    x = torch.randn(16, 8)
    probs, experts = r(x)
    scores = torch.sigmoid(x @ r.weight.t())
    chosen = scores.gather(1, experts)
    torch.testing.assert_close(probs, 2.5 * chosen / chosen.sum(-1, keepdim=True))
    assert torch.equal(experts.sort(-1).values, scores.topk(4, -1).indices.sort(-1).values)


def test_bias_shifts_selection_not_probs() -> None:
    r = router(score="sigmoid")
    x = torch.randn(16, 8)
    r.expert_bias[0] = 100.0  # every token now picks expert 0
    probs, experts = r(x)
    assert (experts == 0).any(-1).all()
    scores = torch.sigmoid(x @ r.weight.t())
    torch.testing.assert_close(probs, scores.gather(1, experts))


def test_group_limited_selection_stays_in_the_best_groups() -> None:
    r = router(score="sigmoid", num_groups=4, topk_groups=2)  # 4 groups of 2 experts
    x = torch.randn(32, 8)
    _, experts = r(x)
    scores = torch.sigmoid(x @ r.weight.t()).detach()
    for t in range(32):
        group_score = scores[t].view(4, 2).topk(2, -1).values.sum(-1)  # top 4 // 2 per group
        best = set(group_score.topk(2).indices.tolist())
        assert {int(e) // 2 for e in experts[t]} <= best
        allowed = [e for e in range(8) if e // 2 in best]
        expected = sorted(allowed, key=lambda e: -float(scores[t, e]))[:4]
        assert sorted(experts[t].tolist()) == sorted(expected)


def test_softmax_default_is_unchanged() -> None:
    r = router()
    x = torch.randn(16, 8)
    probs, experts = r(x)
    scores = torch.softmax(x @ r.weight.t(), -1)
    torch.testing.assert_close(probs, scores.gather(1, experts))


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"score": "tanh"}, "score must be 'softmax' or 'sigmoid'"),
        ({"num_groups": 3}, "num_groups must divide num_experts=8"),
        ({"num_groups": 4, "topk_groups": 3}, "topk_groups <= num_groups dividing topk=4"),
        ({"num_groups": 4, "topk_groups": 1}, "fewer than topk // topk_groups = 4"),
    ],
)
def test_invalid_routing_is_refused(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        router(**kw)
