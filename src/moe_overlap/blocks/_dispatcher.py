"""Token dispatcher: permute by expert, all-to-all over the EP group, local sort; and back.

Legend: ``T`` tokens of this rank, ``K`` top-k, ``N = T*K`` token copies sent, ``M``
copies received, ``D`` hidden, ``X`` experts (global), ``P`` EP ranks, ``L = X/P`` local
experts.

Forward order across the slots::

    pre_dispatch: permute       (copies grouped by expert, hence by destination rank),
                  plan          (counts exchanged, the one host sync: split sizes to the host)
    dispatch:     all-to-all    (tokens and probs; no host sync)
    mlp:          local sort    (received copies grouped by local expert; no host sync)
    combine:      all-to-all back, unpermute (sum of the K copies of each token; no host sync)

The all-to-all needs its split sizes on the host, so one host sync per layer and microbatch
is unavoidable for a dropless dispatch; it happens in pre-dispatch (a compute slot), right
after routing, so the comm slots only enqueue work. Over NCCL the count exchange is queued
on the group's stream behind the all-to-alls already issued there (the other microbatch's);
``count_group``, a second group over the same ranks, lets it skip that queue.

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
from moe_overlap.blocks._loopback import HostLoopback, loopback
from moe_overlap.blocks._slots import SlotContext
from moe_overlap.blocks._wgrad import GroupSizes

# Layer-state keys of the metadata handed between slots.
_PERMUTE = "moe_overlap.permute"
_DISPATCH = "moe_overlap.dispatch"

__all__ = ["DispatchMeta", "DispatcherKind", "PermuteMeta", "TokenDispatcher"]

DispatcherKind = Literal["alltoall", "loopback"]
"""``alltoall``: a real expert-parallel all-to-all over the EP group (skipped at EP=1);
``loopback``: one device, the dispatched tokens make a real round trip through pinned host
memory (a :class:`~moe_overlap.blocks.HostLoopback`) so the bytes moved equal an
all-to-all's (benchmarks without a peer)."""

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
    ``inverse_N`` undoes it. ``tokens_per_expert_X`` counts copies per global expert (on
    the device).
    """

    order_N: Tensor
    inverse_N: Tensor
    tokens_per_expert_X: Tensor
    num_tokens: int
    topk: int


@dataclass(frozen=True, slots=True, kw_only=True)
class DispatchMeta:
    """The dispatch plan (made in pre-dispatch): split sizes and the local sort.

    ``send_splits[p]`` copies go to rank ``p`` and ``recv_splits[p]`` come from it;
    ``local_sizes[l]`` copies are for local expert ``l`` (with their device offsets for the
    grouped GEMM); ``sort_M`` groups received copies by local expert and ``unsort_M`` undoes
    it.
    """

    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    local_sizes: GroupSizes
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


# Function.apply is untyped; give it its signature once, here.
_all_to_all = cast(
    "Callable[[Tensor, dist.ProcessGroup, list[int], list[int]], Tensor]",
    _AllToAll.apply,  # pyright: ignore[reportUnknownMemberType]
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
        count_group: dist.ProcessGroup | None = None,
    ) -> None:
        ep = _get_world_size(group) if group is not None else 1
        rank = _get_rank(group) if group is not None else 0
        if count_group is not None and (
            group is None or _get_world_size(count_group) != ep or _get_rank(count_group) != rank
        ):
            raise ConfigError(
                "TokenDispatcher: expected count_group to span the ranks of the EP group in "
                f"the same order (size {ep}, this rank {rank}), received a group of size "
                f"{_get_world_size(count_group)} where this rank is "
                f"{_get_rank(count_group)}; leave it None to exchange counts on the EP group"
            )
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
        self.loopback: HostLoopback | None = HostLoopback() if kind == "loopback" else None
        self.group = group if ep > 1 else None
        self.count_group = (count_group if count_group is not None else group) if ep > 1 else None
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
            num_tokens=T,
            topk=K,
        )
        return tokens_ND, probs_N, meta

    def plan(self, meta: PermuteMeta) -> DispatchMeta:
        """Exchange the per-expert counts and bring the split sizes to the host.

        The dispatch's one host sync (it waits for the routing). Run it where a sync costs
        least: :meth:`slot_permute` runs it in pre-dispatch.
        """
        counts_X = meta.tokens_per_expert_X
        device = counts_X.device
        if self.group is None:
            n = meta.num_tokens * meta.topk
            ident = torch.arange(n, device=device)
            experts_X = torch.arange(self.num_experts, device=device)
            return DispatchMeta(
                send_splits=(n,),
                recv_splits=(n,),
                local_sizes=GroupSizes(
                    int_list(counts_X.cpu()),
                    counts_X.cumsum(0, dtype=torch.int32),
                    torch.repeat_interleave(experts_X, counts_X, output_size=n),
                ),
                sort_M=ident,
                unsort_M=ident,
            )
        P, L = self.ep_size, self.local_experts
        recv_counts_X = torch.empty_like(counts_X)
        _all_to_all_single(recv_counts_X, counts_X, group=self.count_group)
        both = torch.stack([counts_X, recv_counts_X]).cpu()
        send_splits = int_list(both[0].view(P, L).sum(1))
        recv_PL = both[1].view(P, L)
        recv_splits = int_list(recv_PL.sum(1))
        local_L = recv_counts_X.view(P, L).sum(0)
        # Received copies come grouped by source rank, then by local expert: a copy's local
        # expert, expanded from the counts on the device (output size known: no sync).
        local_expert_M = torch.repeat_interleave(
            torch.arange(L, device=device).repeat(P),
            recv_counts_X,
            output_size=sum(recv_splits),
        )
        sort_M = torch.argsort(local_expert_M, stable=True)
        sorted_M = torch.repeat_interleave(
            torch.arange(L, device=device), local_L, output_size=sum(recv_splits)
        )
        return DispatchMeta(
            send_splits=tuple(send_splits),
            recv_splits=tuple(recv_splits),
            local_sizes=GroupSizes(
                int_list(recv_PL.sum(0)), local_L.cumsum(0, dtype=torch.int32), sorted_M
            ),
            sort_M=sort_M,
            unsort_M=_inverse(sort_M),
        )

    def dispatch(
        self, tokens_ND: Tensor, probs_N: Tensor, meta: DispatchMeta
    ) -> tuple[Tensor, Tensor]:
        """Send copies to their experts' ranks as :meth:`plan` says; received tokens and probs.

        No host sync: only the two all-to-alls (or the one-device copies) are enqueued.
        """
        if self.group is None:
            return self._local(tokens_ND), self._local(probs_N)
        send, recv = list(meta.send_splits), list(meta.recv_splits)
        recv_MD = _all_to_all(tokens_ND, self.group, recv, send)
        recv_M = _all_to_all(probs_N, self.group, recv, send)
        return recv_MD, recv_M

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
        """Pre-dispatch: :meth:`permute` and :meth:`plan`, keeping both metadata values in the
        layer state for the later slots."""
        tokens_ND, probs_N, meta = self.permute(hidden_TD, probs_TK, experts_TK)
        state = ctx.layer_state
        state.stash(_PERMUTE, meta)
        state.stash(_DISPATCH, self.plan(meta))
        return tokens_ND, probs_N

    def slot_dispatch(self, ctx: SlotContext, tokens_ND: Tensor, probs_N: Tensor) -> Tensor:
        """Dispatch: the all-to-all; the received probs go to ``layer_state.dispatched_probs``."""
        state = ctx.layer_state
        recv_MD, recv_M = self.dispatch(tokens_ND, probs_N, state.take(_DISPATCH, DispatchMeta))
        state.dispatched_probs = ctx.detach(recv_M)
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

        def weighed(x_MD: Tensor, sizes: GroupSizes, p_M: Tensor) -> Tensor:
            y_MD = experts(x_MD, sizes)
            y = y_MD.float() if weigh_in_float32 else y_MD
            return (y * p_M.unsqueeze(-1)).to(y_MD.dtype)

        return self.slot_routed_experts(ctx, recv_MD, weighed)

    def slot_routed_experts(
        self,
        ctx: SlotContext,
        recv_MD: Tensor,
        experts: Callable[[Tensor, GroupSizes, Tensor], Tensor],
    ) -> Tensor:
        """Mlp, for experts that weigh their own output: sort by local expert (a copy: the
        input may be freed), ``experts(rows, sizes, probs)`` returning the weighted rows
        (``sizes`` carries each row's local expert, ``sizes.ids``), back to received order."""
        state = ctx.layer_state
        dmeta = state.take(_DISPATCH, DispatchMeta)
        probs_M = state.dispatched_probs
        if probs_M is None:
            raise IntegrationError(
                "TokenDispatcher: the mlp step expected dispatched_probs from slot_dispatch, "
                "received None"
            )
        x_MD = recv_MD.index_select(0, dmeta.sort_M)
        p_M = probs_M.index_select(0, dmeta.sort_M)
        y_MD = experts(x_MD, dmeta.local_sizes, p_M)
        return y_MD.index_select(0, dmeta.unsort_M)

    def slot_combine(self, ctx: SlotContext, out_MD: Tensor) -> Tensor:
        """Combine: the all-to-all back and :meth:`unpermute`; each token's MoE output ``[T, D]``."""
        state = ctx.layer_state
        pmeta = state.take(_PERMUTE, PermuteMeta)
        dmeta = state.take(_DISPATCH, DispatchMeta)
        return self.unpermute(self.combine(out_MD, dmeta), pmeta)

    def _local(self, x: Tensor) -> Tensor:
        if self.loopback is not None:
            return loopback(x, self.loopback)
        return x.clone()
