"""Token dispatcher: permute by expert, all-to-all over the EP group, local sort; and back.

Legend: ``T`` tokens of this rank, ``K`` top-k, ``N = T*K`` token copies sent, ``M``
copies received, ``D`` hidden, ``X`` experts (global), ``P`` EP ranks, ``L = X/P`` local
experts.

Forward order across the slots::

    pre_dispatch: permute       (copies grouped by expert, hence by destination rank)
    dispatch:     all-to-all    (counts first, then tokens and probs)
    mlp:          local sort    (received copies grouped by local expert)
    combine:      all-to-all back, unpermute (sum of the K copies of each token)

Every step produces a fresh buffer and saves no input for backward, which is what the
schedule's free-input policy requires. The unpermute is an ``index_select`` by the inverse
permutation plus a sum over ``K`` (no scatter-add), deterministic on every device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from torch import Tensor

from moe_overlap import ConfigError, IntegrationError
from moe_overlap.blocks._slots import SlotContext

# Layer-state keys of the metadata handed between slots.
_PERMUTE = "moe_overlap.permute"
_DISPATCH = "moe_overlap.dispatch"

__all__ = ["DispatchMeta", "DispatcherKind", "PermuteMeta", "TokenDispatcher"]

DispatcherKind = Literal["alltoall", "loopback"]
"""``alltoall``: a real expert-parallel all-to-all over the EP group (skipped at EP=1);
``loopback``: one device, the dispatched tokens make a real round trip through pinned host
memory so the bytes moved equal an all-to-all's (benchmarks without a peer)."""

# torch.distributed leaves these unannotated; give them types once, here.
_all_to_all_single = cast(
    "Callable[..., object]",
    dist.all_to_all_single,  # pyright: ignore[reportUnknownMemberType]
)
_get_world_size: Callable[..., int] = dist.get_world_size
_get_rank: Callable[..., int] = dist.get_rank


@dataclass(frozen=True, slots=True, kw_only=True)
class PermuteMeta:
    """What pre-dispatch hands combine: how copies were grouped by expert.

    ``order_N[i]`` is the flat ``(token, k)`` index of sorted copy ``i``;
    ``inverse_N`` undoes it. ``tokens_per_expert`` counts copies per global expert.
    """

    order_N: Tensor
    inverse_N: Tensor
    tokens_per_expert_X: Tensor
    tokens_per_expert: tuple[int, ...]
    num_tokens: int
    topk: int


@dataclass(frozen=True, slots=True, kw_only=True)
class DispatchMeta:
    """What dispatch hands mlp and combine: split sizes and the local sort.

    ``send_splits[p]`` copies went to rank ``p`` and ``recv_splits[p]`` came from it;
    ``local_sizes[l]`` copies are for local expert ``l``; ``sort_M`` groups received
    copies by local expert and ``unsort_M`` undoes it.
    """

    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    local_sizes: tuple[int, ...]
    sort_M: Tensor
    unsort_M: Tensor


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with split sizes; backward sends the grads back (splits swapped)."""

    @staticmethod
    def forward(
        ctx: Any,  # torch's FunctionCtx declares no fields; we add our own
        x: Tensor,
        group: dist.ProcessGroup,
        out_splits: list[int],
        in_splits: list[int],
    ) -> Tensor:
        ctx.group = group
        ctx.out_splits = out_splits
        ctx.in_splits = in_splits
        return _exchange(x, group, out_splits, in_splits)

    @staticmethod
    def backward(
        ctx: Any,  # see forward
        *grad_outputs: Tensor,
    ) -> tuple[Tensor, None, None, None]:
        (grad,) = grad_outputs
        group: dist.ProcessGroup = ctx.group
        return _exchange(grad, group, ctx.in_splits, ctx.out_splits), None, None, None


def _exchange(
    x: Tensor, group: dist.ProcessGroup, out_splits: list[int], in_splits: list[int]
) -> Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    _all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class _HostRoundTrip(torch.autograd.Function):
    """Copy device -> pinned host -> device on the current stream; backward does the same.

    Values are unchanged; the bytes moved equal an all-to-all's. On CPU, a copy.
    """

    @staticmethod
    def forward(
        ctx: Any,  # torch's FunctionCtx is unused here
        x: Tensor,
    ) -> Tensor:
        del ctx
        return _round_trip(x)

    @staticmethod
    def backward(
        ctx: Any,  # see forward
        *grad_outputs: Tensor,
    ) -> Tensor:
        (grad,) = grad_outputs
        del ctx
        return _round_trip(grad)


def _round_trip(x: Tensor) -> Tensor:
    if x.device.type == "cpu":
        return x.clone()
    # Pinned blocks come from the caching host allocator, which keeps them alive until the
    # copies queued on this stream finish, so dropping `host` here is safe.
    host = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=True)
    host.copy_(x, non_blocking=True)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    out.copy_(host, non_blocking=True)
    return out


# Function.apply is untyped; give the two their signatures once, here.
_all_to_all = cast(
    "Callable[[Tensor, dist.ProcessGroup, list[int], list[int]], Tensor]",
    _AllToAll.apply,  # pyright: ignore[reportUnknownMemberType]
)
_host_round_trip = cast(
    "Callable[[Tensor], Tensor]",
    _HostRoundTrip.apply,  # pyright: ignore[reportUnknownMemberType]
)


def int_list(t: Tensor) -> list[int]:
    """``t.tolist()`` of a 1-D integer tensor, typed (one host sync on a GPU)."""
    # torch types tolist() as list[Unknown].
    return cast("list[int]", t.tolist())  # pyright: ignore[reportUnknownMemberType]


def _inverse(perm: Tensor) -> Tensor:
    # argsort of a permutation is its inverse; unlike a scatter it is deterministic on CUDA.
    return torch.argsort(perm)


def _counts(sorted_ids: Tensor, n: int) -> Tensor:
    """How many times each of ``0..n-1`` occurs in the sorted ``sorted_ids`` (no bincount:
    it has no deterministic CUDA kernel)."""
    bounds = torch.arange(n + 1, device=sorted_ids.device, dtype=sorted_ids.dtype)
    return torch.searchsorted(sorted_ids, bounds).diff()


class TokenDispatcher:
    """Moves token copies to the ranks holding their experts and back.

    ``group`` ``None`` (or of size 1) means no expert parallelism: the all-to-all becomes a
    copy (``alltoall``) or a round trip through pinned host memory (``loopback``).
    Raises :class:`~moe_overlap.ConfigError` when the EP size does not divide the experts.
    """

    def __init__(
        self,
        num_experts: int,
        topk: int,
        *,
        kind: DispatcherKind = "alltoall",
        group: dist.ProcessGroup | None = None,
    ) -> None:
        ep = _get_world_size(group) if group is not None else 1
        rank = _get_rank(group) if group is not None else 0
        if num_experts % ep:
            raise ConfigError(
                f"TokenDispatcher: the expert-parallel size must divide num_experts="
                f"{num_experts}, received EP size {ep}"
            )
        if kind == "loopback" and ep > 1:
            raise ConfigError(
                "TokenDispatcher: the 'loopback' dispatcher emulates EP on one device; "
                f"expected an EP size of 1, received {ep}"
            )
        self.kind: DispatcherKind = kind
        self.group = group if ep > 1 else None
        self.ep_size = ep
        self.ep_rank = rank
        self.num_experts = num_experts
        self.local_experts = num_experts // ep
        self.topk = topk

    @property
    def expert_offset(self) -> int:
        """Global index of this rank's first local expert."""
        return self.ep_rank * self.local_experts

    def permute(
        self, hidden_TD: Tensor, probs_TK: Tensor, experts_TK: Tensor
    ) -> tuple[Tensor, Tensor, PermuteMeta]:
        """Copy each token ``K`` times and group the copies by expert (stable order)."""
        T, D = hidden_TD.shape
        K = experts_TK.shape[1]
        experts_N = experts_TK.reshape(-1)
        order_N = torch.argsort(experts_N, stable=True)
        # Expand-then-select (not index_select with repeated indices): the backward is a
        # permutation plus a sum over K, deterministic on every device.
        copies_ND = hidden_TD.unsqueeze(1).expand(T, K, D).reshape(T * K, D)
        tokens_ND = copies_ND.index_select(0, order_N)
        probs_N = probs_TK.reshape(-1).index_select(0, order_N)
        counts_X = _counts(experts_N.index_select(0, order_N), self.num_experts)
        meta = PermuteMeta(
            order_N=order_N,
            inverse_N=_inverse(order_N),
            tokens_per_expert_X=counts_X,
            tokens_per_expert=tuple(int_list(counts_X)),
            num_tokens=T,
            topk=K,
        )
        return tokens_ND, probs_N, meta

    def dispatch(
        self, tokens_ND: Tensor, probs_N: Tensor, meta: PermuteMeta
    ) -> tuple[Tensor, Tensor, DispatchMeta]:
        """Send copies to their experts' ranks; return received tokens, probs and metadata."""
        if self.group is None:
            recv_MD = self._local(tokens_ND)
            recv_M = self._local(probs_N)
            n = tokens_ND.shape[0]
            ident = torch.arange(n, device=tokens_ND.device)
            return (
                recv_MD,
                recv_M,
                DispatchMeta(
                    send_splits=(n,),
                    recv_splits=(n,),
                    local_sizes=meta.tokens_per_expert,
                    sort_M=ident,
                    unsort_M=ident,
                ),
            )
        P, L, group = self.ep_size, self.local_experts, self.group
        counts_X = meta.tokens_per_expert_X
        recv_counts_X = torch.empty_like(counts_X)
        _all_to_all_single(recv_counts_X, counts_X, group=group)
        send_PL = torch.tensor(meta.tokens_per_expert, dtype=torch.int64).view(P, L)
        recv_PL = recv_counts_X.cpu().view(P, L)
        send_splits = int_list(send_PL.sum(1))
        recv_splits = int_list(recv_PL.sum(1))
        local_sizes = tuple(int_list(recv_PL.sum(0)))
        local_expert_M = torch.repeat_interleave(torch.arange(L).repeat(P), recv_PL.flatten()).to(
            tokens_ND.device
        )
        sort_M = torch.argsort(local_expert_M, stable=True)
        recv_MD = _all_to_all(tokens_ND, group, recv_splits, send_splits)
        recv_M = _all_to_all(probs_N, group, recv_splits, send_splits)
        return (
            recv_MD,
            recv_M,
            DispatchMeta(
                send_splits=tuple(send_splits),
                recv_splits=tuple(recv_splits),
                local_sizes=local_sizes,
                sort_M=sort_M,
                unsort_M=_inverse(sort_M),
            ),
        )

    def combine(self, out_MD: Tensor, meta: DispatchMeta) -> Tensor:
        """Send expert outputs (in received order) back to the ranks their tokens came from."""
        if self.group is None:
            return self._local(out_MD)
        return _all_to_all(out_MD, self.group, list(meta.send_splits), list(meta.recv_splits))

    def unpermute(self, back_ND: Tensor, meta: PermuteMeta) -> Tensor:
        """Undo :meth:`permute`: each token's output is the sum of its ``K`` copies."""
        T, K = meta.num_tokens, meta.topk
        copies_ND = back_ND.index_select(0, meta.inverse_N)
        return copies_ND.view(T, K, -1).sum(dim=1)

    # --- slot-level: the four steps as a layer's slots call them ---------------------------
    def slot_permute(
        self, ctx: SlotContext, hidden_TD: Tensor, probs_TK: Tensor, experts_TK: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Pre-dispatch: :meth:`permute`, keeping the metadata in the layer state for later slots."""
        tokens_ND, probs_N, meta = self.permute(hidden_TD, probs_TK, experts_TK)
        ctx.layer_state.stash(_PERMUTE, meta)
        return tokens_ND, probs_N

    def slot_dispatch(self, ctx: SlotContext, tokens_ND: Tensor, probs_N: Tensor) -> Tensor:
        """Dispatch: the all-to-all; the received probs go to ``layer_state.dispatched_probs``."""
        state = ctx.layer_state
        recv_MD, recv_M, dmeta = self.dispatch(
            tokens_ND, probs_N, state.take(_PERMUTE, PermuteMeta)
        )
        state.dispatched_probs = ctx.detach(recv_M)
        state.stash(_DISPATCH, dmeta)
        return recv_MD

    def slot_experts(
        self,
        ctx: SlotContext,
        recv_MD: Tensor,
        experts: Callable[[Tensor, Sequence[int]], Tensor],
        *,
        weigh_in_float32: bool,
    ) -> Tensor:
        """Mlp: sort by local expert (a copy: the input may be freed), ``experts(rows,
        sizes)``, weigh by the routing probs (in float32 or the output's dtype, as the plain
        model does), back to received order."""
        state = ctx.layer_state
        dmeta = state.take(_DISPATCH, DispatchMeta)
        probs_M = state.dispatched_probs
        if probs_M is None:
            raise IntegrationError(
                "TokenDispatcher.slot_experts: expected dispatched_probs from slot_dispatch, "
                "received None"
            )
        x_MD = recv_MD.index_select(0, dmeta.sort_M)
        y_MD = experts(x_MD, dmeta.local_sizes)
        p_M = probs_M.index_select(0, dmeta.sort_M)
        y = y_MD.float() if weigh_in_float32 else y_MD
        weighted_MD = (y * p_M.unsqueeze(-1)).to(y_MD.dtype)
        return weighted_MD.index_select(0, dmeta.unsort_M)

    def slot_combine(self, ctx: SlotContext, out_MD: Tensor) -> Tensor:
        """Combine: the all-to-all back and :meth:`unpermute`; each token's MoE output ``[T, D]``."""
        state = ctx.layer_state
        pmeta = state.take(_PERMUTE, PermuteMeta)
        dmeta = state.take(_DISPATCH, DispatchMeta)
        return self.unpermute(self.combine(out_MD, dmeta), pmeta)

    def _local(self, x: Tensor) -> Tensor:
        if self.kind == "loopback":
            return _host_round_trip(x)
        return x.clone()
