"""On CUDA, bf16, EP=1: a whole training step of the reference model never waits for the GPU.

``torch.cuda.set_sync_debug_mode("error")`` turns every synchronizing CUDA call (a stream
or device sync, a blocking copy to or from pageable memory, ``.item()``, ``.cpu()``) into
an error; an event wait is not one of them, so the dispatcher's pending host counts are
also checked unread. The grouped GEMMs read their device offsets (``torch._grouped_mm``,
Hopper), so neither the dispatcher nor the experts need the sizes on the host. The same
steps are also bit-identical to plain per-microbatch backward. Skipped without a GPU.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from moe_overlap import Microbatch, combined_1f1b, make_streams
from moe_overlap.blocks import DispatcherKind, DispatchMeta, HostCounts, finish_wgrad
from moe_overlap.models import GPTMoEConfig, GPTMoEModel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@contextmanager
def no_host_sync() -> Iterator[None]:
    with warnings.catch_warnings():
        # torch warns once that the debug mode is a prototype; filterwarnings=error.
        warnings.filterwarnings("ignore", "Synchronization debug mode", UserWarning)
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _model(kind: DispatcherKind, delay: bool) -> GPTMoEModel:
    config = GPTMoEConfig(
        hidden_size=64,
        num_layers=3,
        num_attention_heads=4,
        ffn_hidden_size=128,
        num_experts=8,
        moe_ffn_hidden_size=32,
        moe_router_topk=2,
        moe_shared_expert_hidden_size=32,
        dispatcher=kind,
        delay_wgrad_compute=delay,
        dtype=torch.bfloat16,
    )
    return GPTMoEModel(config, device="cuda")


def _microbatches(seed: int) -> list[Microbatch]:
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randint(0, 128, (2, 64), generator=g).cuda() for _ in range(4)]
    return [Microbatch(input_ids=x, labels=x.roll(-1, 1)) for x in xs]


def _scheduled_step(model: GPTMoEModel, mbs: list[Microbatch]) -> list[torch.Tensor]:
    return combined_1f1b(model, mbs, options=model.schedule_options(), streams=make_streams("cuda"))


def _plain_step(model: GPTMoEModel, mbs: list[Microbatch]) -> list[torch.Tensor]:
    losses: list[torch.Tensor] = []
    for mb in mbs:
        assert mb.input_ids is not None
        loss: torch.Tensor = model(mb.input_ids, labels=mb.labels)
        torch.autograd.backward(loss)
        finish_wgrad(model)
        losses.append(loss.detach().float())
    return losses


@pytest.fixture
def host_count_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the dispatcher's host-count reads (event waits the debug mode cannot see)."""
    reads: list[int] = []
    get = HostCounts.get

    def counting_get(self: HostCounts) -> torch.Tensor:
        reads.append(1)
        return get(self)

    monkeypatch.setattr(HostCounts, "get", counting_get)
    return reads


@pytest.mark.parametrize("kind", ["alltoall", "loopback"])
@pytest.mark.parametrize("delay", [False, True])
def test_a_step_issues_no_host_sync_and_stays_exact(
    host_count_reads: list[int], kind: DispatcherKind, delay: bool
) -> None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    found = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        scheduled, plain = _model(kind, delay), _model(kind, delay)
        _scheduled_step(scheduled, _microbatches(1))  # warm-up: lazy inits, allocator pools
        _plain_step(plain, _microbatches(1))
        torch.cuda.synchronize()
        scheduled.zero_grad(set_to_none=True)
        plain.zero_grad(set_to_none=True)
        mbs = _microbatches(0)
        with no_host_sync():
            got = _scheduled_step(scheduled, mbs)
            want = _plain_step(plain, mbs)
        assert host_count_reads == []
        torch.cuda.synchronize()
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
        for (name, a), b in zip(scheduled.named_parameters(), plain.parameters(), strict=True):
            assert a.grad is not None and b.grad is not None, name
            assert torch.equal(a.grad, b.grad), name
    finally:
        torch.use_deterministic_algorithms(found)  # as found: the suite's fixture turns it on


def test_the_ep_plan_waits_on_an_event_only_and_sorts_on_the_device() -> None:
    # The EP>1 plan's host side without NCCL: counts sent and received by this rank (P=2,
    # L=2). Reading the splits waits on the copy's event (invisible to the debug mode);
    # the local sort, offsets and ids are device work with host-known sizes.
    dev = torch.device("cuda")
    sent_X = torch.tensor([1, 2, 3, 4], device=dev)
    recv_X = torch.tensor([0, 2, 1, 1], device=dev)  # rank 0: l1 x2; rank 1: l0, l1
    torch.cuda.synchronize()
    with no_host_sync():
        meta = DispatchMeta(
            HostCounts(torch.stack([sent_X, recv_X])),
            recv_X.view(2, 2).sum(0),
            recv_counts_X=recv_X,
        )
        assert not meta.counts.fetched
        assert meta.send_splits == (3, 7) and meta.recv_splits == (2, 2)
        sizes = meta.local_sizes
        sort_M, unsort_M = meta.sort_M, meta.unsort_M
        assert not sizes.has_host_sizes and sizes.total == 4
    assert sizes.sizes == (1, 3)
    assert sort_M.tolist() == [2, 0, 1, 3] and unsort_M.tolist() == [1, 2, 0, 3]
    assert sizes.ids is not None and sizes.ids.tolist() == [0, 1, 1, 1]
