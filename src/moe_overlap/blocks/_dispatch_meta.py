"""What the token dispatcher's steps hand each other: how copies were grouped by expert
(:class:`PermuteMeta`, the caller's :data:`CopyOrder` or :class:`Gathered` copies, the
:data:`Combine` mode) and the exchange's plan (:class:`DispatchMeta`, its counts on their
way to the host as :class:`HostCounts`).

Legend as in the dispatcher: ``T`` tokens of this rank, ``K`` top-k, ``N = T*K`` token
copies sent, ``M`` copies received, ``D`` hidden, ``X`` experts (global), ``P`` EP ranks,
``L = X/P`` local experts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Literal, cast

import torch
from torch import Tensor

from moe_overlap.blocks._delayed_linear import GroupSizes

__all__ = [
    "Combine",
    "CopyOrder",
    "DispatchMeta",
    "Gathered",
    "HostCounts",
    "PermuteMeta",
    "int_list",
    "inverse_permutation",
]

CopyOrder = Callable[[Tensor], Tensor]
"""``order(experts_TK) -> order_N``: the flat ``(token, k)`` indices of the copies, grouped
by expert in ascending order, and within an expert in the order the experts should see
them (:meth:`TokenDispatcher.permute`; default: token order, a stable sort)."""

Combine = Literal["sum", "grouped"]
"""How :meth:`TokenDispatcher.unpermute` adds each token's ``K`` outputs: ``sum``, a sum
over ``K`` (the default); ``grouped``, one by one into zeros in the order the copies were
grouped (an ``index_add``, as a model's own experts may add them). From ``K = 3`` the order
changes the rounding."""


@dataclass(frozen=True, slots=True)
class Gathered:
    """Copies a caller gathered itself (:meth:`TokenDispatcher.permute`): ``order_N[i]`` is
    the flat ``(token, k)`` index of row ``i`` of ``copies_ND``, grouped by expert in
    ascending order. Gathered where and as a model's own experts gather them, backward adds
    each token's copy gradients as the model's does (from ``K = 3`` the order changes the
    rounding)."""

    order_N: Tensor
    copies_ND: Tensor


@dataclass(frozen=True, slots=True, kw_only=True)
class PermuteMeta:
    """What pre-dispatch hands combine: how copies were grouped by expert.

    ``order_N[i]`` is the flat ``(token, k)`` index of sorted copy ``i``;
    ``inverse_N`` undoes it. ``tokens_per_expert_X`` counts copies per global expert (on
    the device).
    """

    order_N: Tensor
    inverse_N: Tensor
    tokens_per_expert_X: Tensor
    num_tokens: int
    topk: int
    add_tokens_N: Tensor | None = None
    """With ``combine="grouped"``: each sorted copy's token (:meth:`TokenDispatcher.
    unpermute` adds the copies one by one in sorted order); ``None``: a sum over ``K``."""

    @property
    def tensors(self) -> tuple[Tensor, ...]:
        """The index tensors :meth:`TokenDispatcher.unpermute` reads."""
        return (
            (self.inverse_N,) if self.add_tokens_N is None else (self.inverse_N, self.add_tokens_N)
        )


class HostCounts:
    """Integer counts on their way to the host: the copy is queued, :meth:`get` awaits it.

    On CUDA the constructor queues a non-blocking copy of ``counts`` into pinned host memory
    on the current stream and records an event after it; nothing waits. :meth:`get` waits
    for that event once (a host wait on an event, not a stream or device sync) and returns
    the host tensor. Elsewhere the counts are host memory already and nothing waits.
    :attr:`fetched` says whether :meth:`get` has run.
    """

    __slots__ = ("_event", "_host", "fetched")

    def __init__(self, counts: Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        if counts.is_cuda:
            self._host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
            self._host.copy_(counts, non_blocking=True)
            self._event = _new_event()
            self._event.record(torch.cuda.current_stream(counts.device))
        else:
            self._host = counts.cpu()
        self.fetched = False

    def get(self) -> Tensor:
        """The counts on the host (waits for the copy the first time, on CUDA)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        self.fetched = True
        return self._host


_new_event: Callable[[], torch.cuda.Event] = torch.cuda.Event


@dataclass(frozen=True, slots=True)
class _LocalSort:
    sizes: GroupSizes
    sort_M: Tensor
    unsort_M: Tensor


class DispatchMeta:
    """The dispatch plan (made in pre-dispatch); what needs host values is read at first use.

    ``counts`` holds the per-expert counts on their way to the host (a :class:`HostCounts`:
    ``[X]`` sent at EP=1, ``[2, X]`` sent and received at EP>1). ``send_splits[p]`` copies
    go to rank ``p`` and ``recv_splits[p]`` come from it: known on the host at EP=1, read
    from ``counts`` on first use at EP>1 (the dispatch slot: the one host wait).
    ``local_sizes`` counts copies per local expert (device offsets and ids; the host sizes
    only if read); ``sort_M`` groups received copies by local expert and ``unsort_M`` undoes
    it. Those three are built on the device at first use (their length is ``M``, known on
    the host once the splits are).
    """

    __slots__ = (
        "_counts_L",
        "_local",
        "_offsets_L",
        "_recv_counts_X",
        "_splits",
        "counts",
        "local_experts",
    )

    def __init__(
        self,
        counts: HostCounts,
        counts_L: Tensor,
        *,
        recv_counts_X: Tensor | None = None,
        splits: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
    ) -> None:
        """``counts_L``: copies per local expert, on the device; ``recv_counts_X`` (EP>1):
        copies received per (source rank, local expert); ``splits`` (EP=1): the host splits."""
        self.counts = counts
        self.local_experts = counts_L.shape[0]
        self._counts_L = counts_L
        self._offsets_L = counts_L.cumsum(0, dtype=torch.int32)
        self._recv_counts_X = recv_counts_X
        self._splits = splits
        self._local: _LocalSort | None = None

    @property
    def send_splits(self) -> tuple[int, ...]:
        return self._host_splits()[0]

    @property
    def recv_splits(self) -> tuple[int, ...]:
        return self._host_splits()[1]

    @property
    def local_sizes(self) -> GroupSizes:
        return self._local_sort().sizes

    @property
    def sort_M(self) -> Tensor:
        return self._local_sort().sort_M

    @property
    def unsort_M(self) -> Tensor:
        return self._local_sort().unsort_M

    def _host_splits(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        if self._splits is None:
            both = self.counts.get()
            send_PL = both[0].view(-1, self.local_experts)
            recv_PL = both[1].view(-1, self.local_experts)
            self._splits = (tuple(int_list(send_PL.sum(1))), tuple(int_list(recv_PL.sum(1))))
        return self._splits

    def _local_sort(self) -> _LocalSort:
        if self._local is None:
            self._local = self._build_local_sort()
        return self._local

    def _build_local_sort(self) -> _LocalSort:
        L, M = self.local_experts, sum(self.recv_splits)
        device = self._offsets_L.device
        experts_L = torch.arange(L, device=device)
        # Each copy's local expert, once sorted: expanded from the counts on the device (the
        # output size is known on the host: no sync).
        ids_M = torch.repeat_interleave(experts_L, self._counts_L, output_size=M)
        # The host sizes from the queued counts, not through self (no reference cycle).
        host = partial(_host_local_sizes, self.counts, L, ep=self._recv_counts_X is not None)
        sizes = GroupSizes.on_device(self._offsets_L, ids_M, total=M, host=host)
        if self._recv_counts_X is None:
            ident = torch.arange(M, device=device)
            return _LocalSort(sizes, ident, ident)
        # Received copies come grouped by source rank, then by local expert.
        P = self._recv_counts_X.shape[0] // L
        local_expert_M = torch.repeat_interleave(
            experts_L.repeat(P), self._recv_counts_X, output_size=M
        )
        sort_M = torch.argsort(local_expert_M, stable=True)
        return _LocalSort(sizes, sort_M, inverse_permutation(sort_M))


def _host_local_sizes(counts: HostCounts, local_experts: int, *, ep: bool) -> list[int]:
    """Copies per local expert, on the host: ``counts`` is ``[X]`` at EP=1, else ``[2, X]``."""
    host = counts.get()
    if not ep:
        return int_list(host)
    return int_list(host[1].view(-1, local_experts).sum(0))


def int_list(t: Tensor) -> list[int]:
    """``t.tolist()`` of a 1-D integer tensor, typed (a host sync for a GPU tensor)."""
    # torch types tolist() as list[Unknown].
    return cast("list[int]", t.tolist())  # pyright: ignore[reportUnknownMemberType]


def inverse_permutation(perm: Tensor) -> Tensor:
    """The permutation that undoes ``perm``."""
    # argsort of a permutation is its inverse; unlike a scatter it is deterministic on CUDA.
    return torch.argsort(perm)
