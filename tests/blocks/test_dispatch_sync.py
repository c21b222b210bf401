"""No host reads on the grouped-GEMM path: GroupSizes without host sizes, the dispatcher's
pending host counts, the grouped weight grad.

On CPU: the GPU path's logic runs with the grouped GEMM forced on (torch's CPU
``_grouped_mm``), and the tests check that nothing asked for the host sizes or the host
counts. The CUDA run under ``torch.cuda.set_sync_debug_mode("error")`` is
``tests/engine/test_gpu_sync.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from moe_overlap import ChunkState, ConfigError, Microbatch
from moe_overlap.blocks import (
    DelayedWgradGroupedLinear,
    DispatcherKind,
    DispatchMeta,
    GroupedExperts,
    GroupSizes,
    HostCounts,
    PermuteMeta,
    PlainContext,
    TokenDispatcher,
    _delayed_linear,
)
from moe_overlap.wgrad import claim_wgrad


def _offsets(sizes: list[int]) -> Tensor:
    return torch.tensor(sizes).cumsum(0, dtype=torch.int32)


def test_device_sizes_are_read_on_the_host_only_when_asked() -> None:
    sizes = GroupSizes.on_device(_offsets([2, 0, 3]), total=5)
    assert len(sizes) == 3 and sizes.total == 5 and not sizes.has_host_sizes
    assert repr(sizes) == "GroupSizes(<on the device>, groups=3, total=5)"
    assert torch.equal(sizes.group_ids(torch.device("cpu")), torch.tensor([0, 0, 2, 2, 2]))
    assert not sizes.has_host_sizes
    assert list(sizes) == [2, 0, 3] and sizes.has_host_sizes and sizes[2] == 3


def test_device_sizes_come_from_the_host_callable_when_given() -> None:
    calls: list[int] = []

    def host() -> list[int]:
        calls.append(1)
        return [2, 0, 3]

    sizes = GroupSizes.on_device(_offsets([2, 0, 3]), total=5, host=host)
    assert sizes.sizes == (2, 0, 3) and sizes.sizes == (2, 0, 3) and calls == [1]
    wrong = GroupSizes.on_device(_offsets([2, 0, 3]), total=5, host=lambda: [1, 1])
    with pytest.raises(ConfigError, match=r"expected 3 sizes summing to 5 rows.*\[1, 1\]"):
        wrong.sizes  # noqa: B018 - the read is the test


def test_device_sizes_refuse_bad_offsets_and_ids() -> None:
    with pytest.raises(ConfigError, match=r"1-D int32 tensor.*torch.int64"):
        GroupSizes.on_device(torch.tensor([2, 5]), total=5)
    with pytest.raises(ConfigError, match=r"ids of shape \[5\].*\[4\]"):
        GroupSizes.on_device(_offsets([2, 3]), torch.zeros(4, dtype=torch.int64), total=5)


def test_the_grouped_linear_checks_the_total_without_host_sizes() -> None:
    layer = DelayedWgradGroupedLinear(3, 4, 8, delay_wgrad=False)
    sizes = GroupSizes.on_device(_offsets([2, 0, 2]), total=4)
    with pytest.raises(ConfigError, match=r"3 group sizes summing to the 5 rows.*groups=3"):
        layer(torch.randn(5, 4), sizes)
    assert not sizes.has_host_sizes


@pytest.fixture
def grouped_mm_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA bf16 Hopper path, on CPU: every grouped product is one ``_grouped_mm``."""
    usable: Callable[[Tensor, int, int], bool] = lambda x, o, i: True  # noqa: E731
    monkeypatch.setattr(_delayed_linear, "_grouped_mm_dims_usable", usable)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("delay", [False, True])
def test_the_grouped_weight_grad_matches_one_product_per_group(
    grouped_mm_on: None, transposed: bool, delay: bool
) -> None:
    torch.manual_seed(0)
    layer = DelayedWgradGroupedLinear(4, 8, 16, delay_wgrad=delay, transposed=transposed)
    torch.nn.init.normal_(layer.weight)
    x = torch.randn(7, 8, requires_grad=True)
    sizes = GroupSizes.on_device(_offsets([3, 0, 4, 0]), total=7)
    y = layer(x, sizes)
    with claim_wgrad(layer):
        y.square().sum().backward()
    if delay:
        layer.backward_dw()
    assert not sizes.has_host_sizes
    w = layer.weight.detach()
    w_OI = w.transpose(-2, -1) if transposed else w
    x0 = x.detach()
    gy = 2 * y.detach()
    want = torch.zeros_like(w_OI)
    for g, (lo, hi) in enumerate([(0, 3), (3, 3), (3, 7), (7, 7)]):
        want[g] = gy[lo:hi].t() @ x0[lo:hi]
    grad = layer.weight.grad
    assert grad is not None
    got = grad.transpose(-2, -1) if transposed else grad
    torch.testing.assert_close(got, want)
    assert got[1].abs().sum() == 0 and got[3].abs().sum() == 0  # the empty groups


def _moe_step(
    monkeypatch: pytest.MonkeyPatch, kind: DispatcherKind, delay: bool
) -> tuple[list[GroupSizes], list[DispatchMeta], Tensor, list[Tensor]]:
    """The dispatcher's four steps, the experts, backward and backward_dw at EP=1."""
    torch.manual_seed(0)
    T, D, F, X, K = 16, 8, 8, 4, 2
    experts = GroupedExperts(X, D, F, expert_offset=0, delay_wgrad=delay)
    for w in experts.parameters():
        torch.nn.init.normal_(w, std=0.1)
    dispatcher = TokenDispatcher(X, K, kind=kind)
    hidden = torch.randn(T, D, requires_grad=True)
    probs = torch.rand(T, K, requires_grad=True)
    chosen = torch.stack([torch.randperm(X)[:K] for _ in range(T)])
    chosen[:, 0] = 0  # expert 3 gets nothing from the first choice; some may be empty
    ctx = PlainContext(ChunkState(Microbatch()))
    seen: list[GroupSizes] = []
    metas: list[DispatchMeta] = []
    plan = dispatcher.plan

    def recording_plan(meta: PermuteMeta) -> DispatchMeta:
        out = plan(meta)
        metas.append(out)
        return out

    monkeypatch.setattr(dispatcher, "plan", recording_plan)

    def run(x: Tensor, sizes: GroupSizes, p: Tensor) -> Tensor:
        seen.append(sizes)
        y: Tensor = experts(x, sizes)
        return y * p.unsqueeze(-1)

    tokens, p = dispatcher.slot_permute(ctx, hidden, probs, chosen)
    received = dispatcher.slot_dispatch(ctx, tokens, p)
    out = dispatcher.slot_routed_experts(ctx, received, run)
    moe = dispatcher.slot_combine(ctx, out)
    with claim_wgrad(experts):
        torch.autograd.backward(moe.square().sum())
    if delay:
        experts.backward_dw()
    grads = [hidden.grad, *(w.grad for w in experts.parameters())]
    return seen, metas, moe.detach(), [g for g in grads if g is not None]


@pytest.mark.parametrize("kind", ["alltoall", "loopback"])
@pytest.mark.parametrize("delay", [False, True])
def test_ep1_dispatch_reads_nothing_on_the_host(
    monkeypatch: pytest.MonkeyPatch, grouped_mm_on: None, kind: DispatcherKind, delay: bool
) -> None:
    seen, metas, _, _ = _moe_step(monkeypatch, kind, delay)
    (sizes,) = seen
    (meta,) = metas
    assert not sizes.has_host_sizes and not meta.counts.fetched
    assert sizes.total == 32 and len(sizes) == 4 and sizes.ids is not None


@pytest.mark.parametrize("kind", ["alltoall", "loopback"])
def test_ep1_grouped_path_matches_the_per_group_path(
    monkeypatch: pytest.MonkeyPatch, kind: DispatcherKind
) -> None:
    seen, _, per_group_out, per_group_grads = _moe_step(monkeypatch, kind, delay=True)
    assert seen[0].has_host_sizes  # the CPU path splits by the host sizes
    usable: Callable[[Tensor, int, int], bool] = lambda x, o, i: True  # noqa: E731
    monkeypatch.setattr(_delayed_linear, "_grouped_mm_dims_usable", usable)
    _, _, out, grads = _moe_step(monkeypatch, kind, delay=True)
    assert len(grads) == len(per_group_grads) == 3
    torch.testing.assert_close(out, per_group_out)
    for got, want in zip(grads, per_group_grads, strict=True):
        torch.testing.assert_close(got, want)


def test_ep_plan_reads_the_host_counts_once_when_the_splits_are_first_needed() -> None:
    # P=2 ranks, L=2 local experts. Sent per global expert; received per (source, local).
    sent_X = torch.tensor([1, 2, 3, 4])
    recv_X = torch.tensor([2, 0, 1, 3])  # from rank 0: 2 for l0, 0 for l1; rank 1: 1, 3
    recv_L = recv_X.view(2, 2).sum(0)
    meta = DispatchMeta(HostCounts(torch.stack([sent_X, recv_X])), recv_L, recv_counts_X=recv_X)
    assert not meta.counts.fetched
    assert meta.send_splits == (3, 7) and meta.recv_splits == (2, 4) and meta.counts.fetched
    sizes = meta.local_sizes
    assert not sizes.has_host_sizes and sizes.total == 6
    assert sizes.ids is not None and sizes.ids.tolist() == [0, 0, 0, 1, 1, 1]
    # Received order: rank 0's l0 x2, rank 1's l0 x1, rank 1's l1 x3 -> local 0,0,0,1,1,1.
    local_M = torch.tensor([0, 0, 0, 1, 1, 1])
    assert torch.equal(local_M.index_select(0, meta.sort_M), local_M)
    assert torch.equal(meta.sort_M.index_select(0, meta.unsort_M), torch.arange(6))
    assert sizes.sizes == (3, 3)


def test_ep_plan_sorts_received_copies_by_local_expert() -> None:
    recv_X = torch.tensor([0, 2, 1, 1])  # rank 0: l1 x2; rank 1: l0 x1, l1 x1
    meta = DispatchMeta(
        HostCounts(torch.stack([recv_X, recv_X])), recv_X.view(2, 2).sum(0), recv_counts_X=recv_X
    )
    received_local = torch.tensor([1, 1, 0, 1])
    assert received_local.index_select(0, meta.sort_M).tolist() == [0, 1, 1, 1]
    assert meta.sort_M.tolist() == [2, 0, 1, 3]


def test_host_counts_on_cpu_wait_for_nothing() -> None:
    counts = HostCounts(torch.tensor([3, 1]))
    assert not counts.fetched
    assert counts.get().tolist() == [3, 1] and counts.fetched
