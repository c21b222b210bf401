"""TokenDispatcher's slot-level steps, through a PlainContext, on one device."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import Tensor

from moe_overlap import ChunkState, ConfigError, IntegrationError, Microbatch
from moe_overlap.blocks import DispatcherKind, Gathered, PlainContext, TokenDispatcher


@pytest.mark.parametrize("kind", ["alltoall", "loopback"])
def test_four_steps_weigh_and_sum_each_tokens_copies(kind: DispatcherKind) -> None:
    torch.manual_seed(0)
    T, D, X, K = 6, 4, 3, 2
    hidden = torch.randn(T, D)
    probs = torch.rand(T, K)
    experts = torch.stack([torch.randperm(X)[:K] for _ in range(T)])
    dispatcher = TokenDispatcher(X, K, kind=kind)
    ctx = PlainContext(ChunkState(Microbatch()))
    seen: list[tuple[int, ...]] = []

    def double(rows: Tensor, sizes: Sequence[int]) -> Tensor:
        seen.append(tuple(sizes))
        return rows * 2

    tokens, p = dispatcher.slot_permute(ctx, hidden, probs, experts)
    recv = dispatcher.slot_dispatch(ctx, tokens, p)
    out = dispatcher.slot_experts(ctx, recv, double, weigh_in_float32=True)
    moe = dispatcher.slot_combine(ctx, out)
    expected = (2 * hidden.unsqueeze(1) * probs.unsqueeze(-1)).sum(1)
    torch.testing.assert_close(moe, expected)
    counts = torch.bincount(experts.flatten(), minlength=X)
    assert seen == [tuple(counts.tolist())]  # rows grouped by local expert


def test_experts_step_needs_the_dispatch_step() -> None:
    dispatcher = TokenDispatcher(2, 1)
    ctx = PlainContext(ChunkState(Microbatch()))
    with pytest.raises(IntegrationError, match="nothing stashed"):
        dispatcher.slot_experts(ctx, torch.ones(1, 1), lambda r, s: r, weigh_in_float32=False)


@pytest.mark.parametrize(
    ("keywords", "message"),
    [
        ({"combine": "mean"}, r"combine must be one of \['sum', 'grouped'\], received str 'mean'"),
        ({"order": lambda e: e.reshape(-1).float()}, r"order\(experts_TK\): expected .*int64"),
        ({"order": lambda e: e.reshape(-1)[:3].long()}, r"int64 tensor \[8\]"),
        ({"gathered": (torch.arange(8), torch.zeros(8, 4))}, r"gathered: expected a Gathered"),
        (
            {"gathered": Gathered(torch.arange(8), torch.zeros(7, 4))},
            r"gathered copies as \[N, D\] with N = T\*K = 8, received \[7, 4\]",
        ),
    ],
)
def test_permute_refuses_a_malformed_order_or_gathered_copies(
    keywords: dict[str, object], message: str
) -> None:
    dispatcher = TokenDispatcher(4, 2)
    hidden, probs = torch.randn(4, 4), torch.rand(4, 2)
    experts = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2]])
    call: Any = dispatcher.permute
    with pytest.raises((IntegrationError, ConfigError), match=message):
        call(hidden, probs, experts, **keywords)
