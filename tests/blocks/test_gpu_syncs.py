"""On CUDA: the dispatcher's comm and expert steps never wait for the GPU (no host sync).

``torch.cuda.set_sync_debug_mode("error")`` turns every synchronizing call into an error;
pre-dispatch (``slot_permute``, whose plan brings the split sizes to the host) is the one
step allowed to synchronize. Skipped without a GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from moe_overlap import ChunkState, Microbatch
from moe_overlap.blocks import DispatcherKind, GroupedExperts, PlainContext, TokenDispatcher
from moe_overlap.wgrad import claim_wgrad

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@contextmanager
def no_host_sync() -> Iterator[None]:
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("kind", ["alltoall", "loopback"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dispatch_experts_combine_issue_no_host_sync(
    kind: DispatcherKind, dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    T, D, F, X, K = 64, 32, 16, 8, 2
    dev = torch.device("cuda")
    experts = GroupedExperts(X, D, F, expert_offset=0, delay_wgrad=True, dtype=dtype, device=dev)
    for w in experts.parameters():
        torch.nn.init.normal_(w, std=0.1)
    dispatcher = TokenDispatcher(X, K, kind=kind)
    hidden = torch.randn(T, D, device=dev, dtype=dtype, requires_grad=True)
    probs = torch.rand(T, K, device=dev, dtype=dtype, requires_grad=True)
    chosen = torch.stack([torch.randperm(X, device=dev)[:K] for _ in range(T)])
    ctx = PlainContext(ChunkState(Microbatch()))
    tokens, p = dispatcher.slot_permute(ctx, hidden, probs, chosen)  # may synchronize
    with no_host_sync():
        received = dispatcher.slot_dispatch(ctx, tokens, p)
        out = dispatcher.slot_experts(ctx, received, experts, weigh_in_float32=True)
        moe = dispatcher.slot_combine(ctx, out)
        with claim_wgrad(experts):
            torch.autograd.backward(moe.float().square().sum())
        experts.backward_dw()
    assert hidden.grad is not None and experts.fc1.weight.grad is not None
