"""On CUDA: a node's backward runs autograd on the calling thread (its worker threads off
for that call only), with the same gradients. Skipped without a GPU."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


class _Fails(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        return t * 2

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise ValueError("backward failed on purpose")


def test_node_backward_runs_on_the_calling_thread_and_restores_the_flag() -> None:
    """A node's backward from CUDA tensors runs the engine on the calling thread (its
    worker threads off for the call only, also when it fails): same gradients."""
    from moe_overlap import ScheduleNode, make_event, make_streams

    seen: list[int] = []

    def forward(t: torch.Tensor) -> torch.Tensor:
        out = t * 2
        out.register_hook(lambda g: seen.append(threading.get_ident()))  # type: ignore[no-untyped-call]
        return out

    streams = make_streams("cuda")
    x = torch.randn(8, device="cuda", requires_grad=True)
    node = ScheduleNode(forward, streams.comp_provider, make_event("cuda"))
    (out,) = node.forward(x)
    (grad,) = node.backward(torch.ones_like(out))
    assert seen == [threading.get_ident()]
    assert grad is not None and torch.equal(grad, torch.full_like(x, 2.0))
    assert torch._C._is_multithreading_enabled()
    failing = ScheduleNode(_Fails.apply, streams.comp_provider, make_event("cuda"))
    (out,) = failing.forward(x)
    with pytest.raises(ValueError, match="on purpose"):
        failing.backward(torch.ones_like(out))
    assert torch._C._is_multithreading_enabled()
    torch.cuda.synchronize()
