"""Token dispatcher: permute by expert, all-to-all over the EP group, local sort; and back.

Legend: ``T`` tokens of this rank, ``K`` top-k, ``N = T*K`` token copies sent, ``M``
copies received, ``D`` hidden, ``X`` experts (global), ``P`` EP ranks, ``L = X/P`` local
experts.

Forward order across the slots::

    pre_dispatch: permute       (copies grouped by expert, hence by destination rank),
                  plan          (counts exchanged; their copy to the host queued, not awaited)
    dispatch:     all-to-all    (tokens and probs; at EP>1 first the one host wait: the split
                                 sizes, read from the queued copy)
    mlp:          local sort    (received copies grouped by local expert; on the device)
    combine:      all-to-all back, unpermute (sum of the K copies of each token; on the device)

Host syncs. At EP=1 there are none: ``N`` is known on the host, the per-expert sizes reach
the grouped GEMM as device offsets (:class:`~moe_overlap.blocks.GroupSizes`), and the host
sizes are read only by a path that needs them (the per-group fallback off Hopper/bf16: it
waits on the queued copy's event, on CPU it reads host memory). At EP>1 a dropless
all-to-all over NCCL needs its split sizes on the host, so one host wait per layer and
microbatch stays: pre-dispatch queues a non-blocking copy of the counts into pinned host
memory and records an event (:class:`HostCounts`); the dispatch slot waits for that event
(``cudaEventSynchronize``, not a stream or device sync) before it enqueues the all-to-alls.
By then the host has queued the other microbatch's work that the schedule puts between the
two slots, so the GPU stays busy while the host waits. On CPU (gloo) the copy is the
tensor itself and nothing waits. Over NCCL the count exchange is queued on the group's
stream behind the all-to-alls already issued there (the other microbatch's);
``count_group``, a second group over the same ranks, lets it skip that queue.

``chunks=K`` (default 1) cuts the microbatch's tokens into ``K`` groups, each permuted,
sent, run through the experts and returned on its own, so that the next chunk's all-to-all
runs under this chunk's expert GEMMs inside the mlp slot (see
:mod:`moe_overlap.blocks._a2a_chunks`). ``K=1`` is the path above, unchanged.

Every step produces a fresh buffer and saves no input for backward, which is what the
schedule's free-input policy requires. The unpermute is an ``index_select`` by the inverse
permutation plus a sum over ``K`` (no scatter-add), deterministic on every device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from torch import Tensor

from moe_overlap import ConfigError, IntegrationError
from moe_overlap.args import GROUP, POSITIVE, Int, OneOf, Opt, check_arg
from moe_overlap.blocks import _a2a_chunks as _chunked
from moe_overlap.blocks._delayed_linear import GroupSizes
from moe_overlap.blocks._dispatch_meta import (
    Combine,
    CopyOrder,
    DispatchMeta,
    Gathered,
    HostCounts,
    PermuteMeta,
    inverse_permutation,
)
from moe_overlap.blocks._loopback import HostLoopback, loopback
from moe_overlap.blocks._slots import SlotContext
from moe_overlap.engine import DEBUG

# Layer-state keys of the metadata handed between slots.
_PERMUTE = "moe_overlap.permute"
_DISPATCH = "moe_overlap.dispatch"

__all__ = ["DispatcherKind", "TokenDispatcher"]

DispatcherKind = Literal["alltoall", "loopback"]
"""``alltoall``: a real expert-parallel all-to-all over the EP group (skipped at EP=1);
``loopback``: one device, the dispatched tokens make a real round trip through pinned host
memory (a :class:`~moe_overlap.blocks.HostLoopback`) so the bytes moved equal an
all-to-all's (benchmarks without a peer)."""

_KIND: OneOf[DispatcherKind] = OneOf(("alltoall", "loopback"))
_COMBINE: OneOf[Combine] = OneOf(("sum", "grouped"))


def _check_order(
    order_N: object, experts_N: Tensor, where: str, copies: Tensor | None = None
) -> Tensor:
    """The copies' order (a :data:`CopyOrder`'s result or :class:`Gathered`'s): a 1-D
    int64 tensor of ``N = T*K`` indices on the experts' device (and, for gathered copies,
    ``N`` rows). In debug mode also a permutation grouped by expert in ascending order
    (reading values: a device sync); otherwise the grouping is trusted."""
    n = experts_N.numel()
    if (
        not isinstance(order_N, Tensor)
        or order_N.dtype != torch.int64
        or tuple(order_N.shape) != (n,)
        or order_N.device != experts_N.device
    ):
        got = (
            f"a {str(order_N.dtype).removeprefix('torch.')} tensor {list(order_N.shape)} on "
            f"{order_N.device}"
            if isinstance(order_N, Tensor)
            else type(order_N).__name__
        )
        raise IntegrationError(
            f"{where}: expected the copies' order as an int64 tensor [{n}] (T*K flat "
            f"(token, k) indices) on {experts_N.device}, received {got}"
        )
    if copies is not None and (copies.dim() != 2 or copies.shape[0] != n):
        raise IntegrationError(
            f"{where}: expected the gathered copies as [N, D] with N = T*K = {n}, received "
            f"{list(copies.shape)}"
        )
    if DEBUG:
        grouped = experts_N.index_select(0, order_N)
        if not (
            bool((torch.sort(order_N).values == torch.arange(n, device=order_N.device)).all())
            and bool((grouped[1:] >= grouped[:-1]).all())
        ):
            raise IntegrationError(
                f"{where}: expected the copies' order to be a permutation of 0..{n - 1} "
                "grouped by expert in ascending order, received one that is not "
                "(debug mode's check)"
            )
    return order_N


_GROUP = Opt(GROUP)

# torch.distributed leaves these unannotated; give them types once, here.
_all_to_all_single = cast(
    "Callable[..., object]",
    dist.all_to_all_single,  # pyright: ignore[reportUnknownMemberType]
)
_get_world_size: Callable[..., int] = dist.get_world_size
_get_rank: Callable[..., int] = dist.get_rank


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


def _counts(sorted_ids: Tensor, n: int) -> Tensor:
    """How many times each of ``0..n-1`` occurs in the sorted ``sorted_ids`` (no bincount:
    it has no deterministic CUDA kernel)."""
    bounds = torch.arange(n + 1, device=sorted_ids.device, dtype=sorted_ids.dtype)
    return torch.searchsorted(sorted_ids, bounds).diff()


def _routed(
    recv_MD: Tensor,
    probs_M: Tensor,
    dmeta: DispatchMeta,
    experts: Callable[[Tensor, GroupSizes, Tensor], Tensor],
) -> Tensor:
    """Sort received rows by local expert (a copy), ``experts``, back to received order."""
    x_MD = recv_MD.index_select(0, dmeta.sort_M)
    p_M = probs_M.index_select(0, dmeta.sort_M)
    y_MD = experts(x_MD, dmeta.local_sizes, p_M)
    return y_MD.index_select(0, dmeta.unsort_M)


_CHUNKS = Int(
    1,
    hint="1 (the default) sends a microbatch's tokens in one all-to-all; K > 1 in K chunks",
)


class TokenDispatcher:
    """Moves token copies to the ranks holding their experts and back.

    ``group`` ``None`` (or of size 1) means no expert parallelism: the all-to-all becomes a
    copy (``alltoall``) or a round trip through pinned host memory (``loopback``).
    ``chunks`` (default 1): cut each microbatch's tokens into that many contiguous groups
    (:func:`~moe_overlap.blocks.chunk_sizes`), each dispatched, run through the experts and
    combined on its own, the next chunk's all-to-all under this chunk's experts (on a side
    stream, in the mlp slot); the slots' inputs and outputs keep their meaning, except that
    dispatch sends, and mlp receives, chunk 0 only. With delayed weight gradients, build the
    experts with ``calls_per_backward=chunks``
    (:class:`~moe_overlap.blocks.GroupedExperts`), so that their ``K`` weight gradients per
    microbatch sum as autograd sums them.
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
        chunks: int = 1,
    ) -> None:
        w = "TokenDispatcher"
        num_experts = check_arg(w, "num_experts", num_experts, POSITIVE)
        chunks = check_arg(w, "chunks", chunks, _CHUNKS)
        topk = check_arg(w, "topk", topk, Int(1, num_experts, max_name="num_experts"))
        kind = check_arg(w, "kind", kind, _KIND)
        check_arg(w, "group", group, _GROUP)
        check_arg(w, "count_group", count_group, _GROUP)
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
        self.chunks = chunks
        self.side_streams: dict[object, _chunked.SideStreams] = {}
        """The side streams of chunked all-to-alls (sends, returns), per device, made at
        first use."""

    @property
    def expert_offset(self) -> int:
        """Global index of this rank's first local expert."""
        return self.ep_rank * self.local_experts

    def permute(
        self,
        hidden_TD: Tensor,
        probs_TK: Tensor,
        experts_TK: Tensor,
        *,
        order: CopyOrder | None = None,
        gathered: Gathered | None = None,
        combine: Combine = "sum",
    ) -> tuple[Tensor, Tensor, PermuteMeta]:
        """Copy each token ``K`` times and group the copies by expert: in token order
        within an expert (a stable sort), or as ``order`` says (a :data:`CopyOrder`: the
        order a model's own experts take their rows in, so that each expert's weight
        gradient sums its rows in the same order), or take the copies a caller gathered
        (``gathered``; then ``hidden_TD`` gives only the number of tokens). Without
        ``gathered``, backward sums each token's ``K`` copy gradients as the gradient of an
        expand (a sum over ``K``, deterministic on every device). ``combine``: how
        :meth:`unpermute` adds each token's outputs (:data:`Combine`)."""
        w = "TokenDispatcher.permute"
        T, D = hidden_TD.shape
        K = experts_TK.shape[1]
        experts_N = experts_TK.reshape(-1)
        combine = check_arg(w, "combine", combine, _COMBINE)
        if gathered is not None:
            if order is not None:
                raise IntegrationError(
                    f"{w}: expected the copies' order from `order` or from `gathered`, "
                    "received both; pass one"
                )
            if not isinstance(cast(object, gathered), Gathered):
                raise IntegrationError(
                    f"{w}: gathered: expected a Gathered, received {type(gathered).__name__}"
                )
            tokens_ND = gathered.copies_ND
            order_N = _check_order(gathered.order_N, experts_N, f"{w}: gathered", tokens_ND)
        else:
            order_N = (
                _check_order(order(experts_TK), experts_N, f"{w}: order(experts_TK)")
                if order is not None
                else torch.argsort(experts_N, stable=True)
            )
            # Expand-then-select (not index_select with repeated indices): the backward is a
            # permutation plus a sum over K, deterministic on every device.
            copies_ND = hidden_TD.unsqueeze(1).expand(T, K, D).reshape(T * K, D)
            tokens_ND = copies_ND.index_select(0, order_N)
        probs_N = probs_TK.reshape(-1).index_select(0, order_N)
        counts_X = _counts(experts_N.index_select(0, order_N), self.num_experts)
        meta = PermuteMeta(
            order_N=order_N,
            inverse_N=inverse_permutation(order_N),
            tokens_per_expert_X=counts_X,
            num_tokens=T,
            topk=K,
            add_tokens_N=order_N // K if combine == "grouped" else None,
        )
        return tokens_ND, probs_N, meta

    def plan(self, meta: PermuteMeta) -> DispatchMeta:
        """Exchange the per-expert counts and queue their copy to the host; waits for nothing.

        At EP=1 the split sizes are ``N`` (known on the host) and the per-expert sizes stay
        on the device; at EP>1 the split sizes are read from the queued copy when
        :meth:`dispatch` first needs them (see the module docstring).
        """
        counts_X = meta.tokens_per_expert_X
        if self.group is None:
            n = meta.num_tokens * meta.topk
            return DispatchMeta(HostCounts(counts_X), counts_X, splits=((n,), (n,)))
        recv_counts_X = torch.empty_like(counts_X)
        _all_to_all_single(recv_counts_X, counts_X, group=self.count_group)
        local_L = recv_counts_X.view(self.ep_size, self.local_experts).sum(0)
        return DispatchMeta(
            HostCounts(torch.stack([counts_X, recv_counts_X])), local_L, recv_counts_X=recv_counts_X
        )

    def dispatch(
        self, tokens_ND: Tensor, probs_N: Tensor, meta: DispatchMeta
    ) -> tuple[Tensor, Tensor]:
        """Send copies to their experts' ranks as :meth:`plan` says; received tokens and probs.

        At EP>1 it first waits for the split sizes on the host (the one host wait, on the
        event :meth:`plan` recorded); then only the two all-to-alls are enqueued. At EP=1,
        the one-device copies, no wait.
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
        """Undo :meth:`permute`: each token's output is the sum of its ``K`` copies (added
        as the ``combine`` given there says)."""
        T, K = meta.num_tokens, meta.topk
        if meta.add_tokens_N is not None:
            zeros_TD = back_ND.new_zeros(T, back_ND.shape[-1])
            return zeros_TD.index_add(0, meta.add_tokens_N, back_ND)
        copies_ND = back_ND.index_select(0, meta.inverse_N)
        return copies_ND.view(T, K, back_ND.shape[-1]).sum(dim=1)

    # --- slot-level: the four steps as a layer's slots call them ---------------------------
    def slot_permute(
        self,
        ctx: SlotContext,
        hidden_TD: Tensor,
        probs_TK: Tensor,
        experts_TK: Tensor,
        *,
        order: CopyOrder | None = None,
        gathered: Gathered | None = None,
        combine: Combine = "sum",
    ) -> tuple[Tensor, Tensor]:
        """Pre-dispatch: :meth:`permute` (the keywords as there; ``gathered`` only with
        ``chunks=1``) and :meth:`plan`, keeping both metadata values in the layer state for
        the later slots."""
        if self.chunks > 1:
            if gathered is not None:
                raise IntegrationError(
                    f"TokenDispatcher.slot_permute: expected copies gathered per chunk, "
                    f"received `gathered` for the whole microbatch with chunks={self.chunks}; "
                    "pass `order` instead, or build the dispatcher with chunks=1"
                )
            return _chunked.slot_permute(
                self, ctx, hidden_TD, probs_TK, experts_TK, order=order, combine=combine
            )
        tokens_ND, probs_N, meta = self.permute(
            hidden_TD, probs_TK, experts_TK, order=order, gathered=gathered, combine=combine
        )
        state = ctx.layer_state
        state.stash(_PERMUTE, meta)
        state.stash(_DISPATCH, self.plan(meta))
        return tokens_ND, probs_N

    def slot_dispatch(self, ctx: SlotContext, tokens_ND: Tensor, probs_N: Tensor) -> Tensor:
        """Dispatch: the all-to-all; the received probs go to ``layer_state.dispatched_probs``."""
        if self.chunks > 1:
            return _chunked.slot_dispatch(self, ctx, tokens_ND, probs_N)
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
        (``sizes`` carries each row's local expert, ``sizes.ids``), back to received order.
        With ``chunks > 1``: chunk by chunk, the neighbouring chunks' all-to-alls on a side
        stream under each chunk's experts; returns the last chunk's rows."""
        if self.chunks > 1:
            return _chunked.slot_routed_experts(self, ctx, recv_MD, experts, _routed)
        state = ctx.layer_state
        dmeta = state.take(_DISPATCH, DispatchMeta)
        probs_M = state.dispatched_probs
        if probs_M is None:
            raise IntegrationError(
                "TokenDispatcher: the mlp step expected dispatched_probs from slot_dispatch, "
                "received None"
            )
        return _routed(recv_MD, probs_M, dmeta, experts)

    def slot_combine(self, ctx: SlotContext, out_MD: Tensor) -> Tensor:
        """Combine: the all-to-all back and :meth:`unpermute`; each token's MoE output ``[T, D]``
        (with ``chunks > 1``: the last chunk's, then every chunk's output in token order)."""
        if self.chunks > 1:
            return _chunked.slot_combine(self, ctx, out_MD)
        state = ctx.layer_state
        pmeta = state.take(_PERMUTE, PermuteMeta)
        dmeta = state.take(_DISPATCH, DispatchMeta)
        return self.unpermute(self.combine(out_MD, dmeta), pmeta)

    def _local(self, x: Tensor) -> Tensor:
        if self.loopback is not None:
            return loopback(x, self.loopback)
        return x.clone()
