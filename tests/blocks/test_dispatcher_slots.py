"""TokenDispatcher's slot-level steps, through a PlainContext, on one device."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import Tensor

from moe_overlap import ChunkState, ConfigError, IntegrationError, Microbatch
from moe_overlap.blocks import DispatcherKind, Gathered, PlainContext, TokenDispatcher
from tests.conftest import DebugPython


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


def test_gathered_copies_are_refused_with_chunks() -> None:
    """Copies gathered for the whole microbatch cannot be split into all-to-all chunks."""
    dispatcher = TokenDispatcher(4, 2, chunks=2)
    ctx = PlainContext(ChunkState(Microbatch()))
    experts = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2]])
    gathered = Gathered(torch.argsort(experts.reshape(-1), stable=True), torch.zeros(8, 4))
    with pytest.raises(IntegrationError, match=r"gathered per chunk.*chunks=2"):
        dispatcher.slot_permute(
            ctx, torch.randn(4, 4), torch.rand(4, 2), experts, gathered=gathered
        )


def test_debug_mode_refuses_an_order_that_is_not_grouped_by_expert(
    debug_python: DebugPython,
) -> None:
    """Outside debug mode the grouping is trusted (reading it would sync the device)."""
    code = (
        "import torch\n"
        "from moe_overlap import IntegrationError\n"
        "from moe_overlap.blocks import TokenDispatcher\n"
        "experts = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2]])\n"
        "try:\n"
        "    TokenDispatcher(4, 2).permute(torch.randn(4, 4), torch.rand(4, 2), experts,\n"
        "                                  order=lambda e: torch.arange(8))\n"
        "except IntegrationError as exc:\n"
        "    print(exc)\n"
    )
    done = debug_python(code, warnings_as_errors=False)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "permutation of 0..7 grouped by expert in ascending order" in out, out
