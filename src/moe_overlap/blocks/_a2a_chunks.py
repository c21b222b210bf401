"""The all-to-all in chunks under the experts: a :class:`TokenDispatcher` with ``chunks=K``.

Legend as in the dispatcher: ``T`` tokens of this rank, ``N`` copies sent, ``M`` received,
``D`` hidden. ``K`` here is the number of chunks (not the top-k).

The microbatch's ``T`` tokens are cut into ``K`` contiguous groups (sizes as
``torch.tensor_split``: the first ``T % K`` one token larger; a group may be empty). Each
group is permuted, planned, dispatched, run through the experts, combined and unpermuted
on its own; the ``K`` outputs are concatenated in token order. Across the slots::

    pre_dispatch: permute and plan every chunk; returns chunk 0, keeps chunks 1.. (detached)
    dispatch:     chunk 0's all-to-all                               (comm stream)
    mlp:          for j: experts of chunk j                          (compute stream)
                  under them, on two side streams: chunk j+1's dispatch (one) and
                  chunk j-1's combine and unpermute (the other); returns chunk K-1's
                  expert output
    combine:      chunk K-1's combine and unpermute, the K outputs concatenated

So chunk ``j+1``'s transfer and chunk ``j-1``'s return run under chunk ``j``'s expert GEMMs,
inside one microbatch's mlp slot. Autograd runs each backward op on the stream its forward
ran on, so backward pipelines the same way. On a CPU the side stream is the calling one and
everything runs in order. The same code runs on the plain path (a
:class:`~moe_overlap.blocks.PlainContext`), so plain and scheduled results are identical.

Cross-stream safety (CUDA): a side stream waits for the compute stream before it reads
what the compute stream wrote (``wait_stream``), the compute stream waits on an event of the
sending side stream before it reads a dispatched chunk, and the combine slot waits on both
side streams' last events; every tensor read on a stream other than the one that allocated it is
``record_stream``-ed there. A chunk's permuted tokens lose their storage once sent (as the
free-input policy releases a dispatch slot's input): only their autograd metadata is
needed later.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, cast, runtime_checkable

import torch
from torch import Tensor

from moe_overlap import IntegrationError
from moe_overlap.args import NON_NEGATIVE, POSITIVE, Instance, check_arg
from moe_overlap.blocks._delayed_linear import GroupSizes
from moe_overlap.blocks._dispatch_meta import Combine, CopyOrder, DispatchMeta, PermuteMeta
from moe_overlap.blocks._slots import SlotContext
from moe_overlap.engine import (
    AnyEvent,
    AnyStream,
    CpuStream,
    cpu_default_stream,
    current_stream,
    make_event,
    record_event,
    record_tensor_on,
    release_storage,
    stream_context,
    wait_event,
    wait_stream,
)
from moe_overlap.engine.contracts import Contract, attribute, method

__all__ = ["ChunkedDispatcher", "SideStreams", "chunk_sizes"]

_PLAN = "moe_overlap.a2a_chunks"
_TOKENS = "moe_overlap.a2a_chunk_tokens[{}]"
_PROBS = "moe_overlap.a2a_chunk_probs[{}]"
_OUT = "moe_overlap.a2a_chunk_out[{}]"

Experts = Callable[[Tensor, GroupSizes, Tensor], Tensor]
"""``experts(rows, sizes, probs)``: the weighted expert output of rows grouped by expert."""


def chunk_sizes(tokens: int, chunks: int) -> list[int]:
    """How :class:`~moe_overlap.blocks.TokenDispatcher` with ``chunks`` cuts ``tokens``:
    contiguous groups, the first ``tokens % chunks`` one larger (``torch.tensor_split``'s
    sizes); groups are empty when ``chunks > tokens``."""
    tokens = check_arg("chunk_sizes", "tokens", tokens, NON_NEGATIVE)
    chunks = check_arg("chunk_sizes", "chunks", chunks, POSITIVE)
    return _sizes(tokens, chunks)


def _sizes(tokens: int, chunks: int) -> list[int]:
    base, extra = divmod(tokens, chunks)
    return [base + 1] * extra + [base] * (chunks - extra)


@dataclass(slots=True)
class _Plan:
    """What pre-dispatch hands the later slots: each chunk's metadata; the side stream's
    last event (set by mlp, awaited by combine)."""

    permute: list[PermuteMeta]
    dispatch: list[DispatchMeta]
    side_done: tuple[AnyEvent | None, ...] = field(default=())


def _plan(ctx: SlotContext, where: str) -> _Plan:
    plan = ctx.layer_state.extras.get(_PLAN)
    if not isinstance(plan, _Plan):
        raise IntegrationError(
            f"{where}: expected the chunk plan that TokenDispatcher.slot_permute keeps (a "
            f"dispatcher with chunks > 1), received {type(plan).__name__}; run the four "
            "dispatcher slots of one dispatcher in order"
        )
    return plan


def _tensor(ctx: SlotContext, key: str, where: str) -> Tensor:
    t = ctx.layer_state.extras.get(key)
    if not isinstance(t, Tensor):
        raise IntegrationError(
            f"{where}: expected the tensor kept under {key!r} by an earlier dispatcher slot, "
            f"received {type(t).__name__}"
        )
    return t


class _Side:
    """The two side streams of one call: lane 0 sends chunks, lane 1 returns them.

    Two lanes, not one: a return waits for its chunk's experts, and on one FIFO stream the
    next send would wait behind it; in backward (autograd runs each op on its forward's
    stream) a chunk's experts would wait behind the send of the chunk after it. On CPU the
    lanes are :class:`~moe_overlap.streams.CpuStream` s (everything runs in order; the
    stream-order checker follows the same waits as on a GPU).
    """

    SEND = 0
    BACK = 1

    def __init__(self, streams: dict[object, SideStreams], like: Tensor) -> None:
        if like.is_cuda:
            device = like.device
            key: object = device
            self.main: AnyStream = torch.cuda.current_stream(device)
        else:
            self.main = current_stream(cpu_default_stream())
            key = ("cpu", id(self.main))
        lanes = streams.get(key)
        if lanes is None:
            if like.is_cuda:
                lanes = (_new_stream(like.device), _new_stream(like.device))
            else:
                lanes = (CpuStream("a2a send lane"), CpuStream("a2a return lane"))
            streams[key] = lanes
        self.lanes: SideStreams = lanes
        self.start = make_event(like.device)
        record_event(self.start, self.main)

    def enter(self, lane: int, *reads: Tensor) -> None:
        """Before side work on ``lane`` that reads ``reads`` (written on the main stream):
        a send waits for what the main stream had queued when the call began (the chunks
        were permuted before), a return for everything queued so far (its chunk's experts)."""
        stream = self.lanes[lane]
        if lane == self.SEND:
            wait_event(self.start, stream)
        else:
            wait_stream(stream, self.main)
        for t in reads:
            record_tensor_on(t, stream)

    def to_main(self, lane: int, *tensors: Tensor) -> AnyEvent:
        """After side work on ``lane`` that produced ``tensors``: an event the main stream
        waits on before reading them (recorded on the lane now)."""
        event = make_event(tensors[0].device if tensors else self.start_device())
        record_event(event, self.lanes[lane])
        for t in tensors:
            record_tensor_on(t, self.main)
        return event

    def start_device(self) -> torch.device:
        return torch.device("cpu") if isinstance(self.main, CpuStream) else self.main.device

    def wait_main(self, event: AnyEvent) -> None:
        """The main stream waits for a lane's event."""
        wait_event(event, self.main)

    def context(self, lane: int) -> contextlib.AbstractContextManager[object]:
        return stream_context(self.lanes[lane])


SideStreams = tuple[AnyStream, AnyStream]
"""A device's two side streams of chunked all-to-alls: sends, returns."""


@runtime_checkable
class ChunkedDispatcher(Protocol):
    """What the chunked slots call on their :class:`~moe_overlap.blocks.TokenDispatcher`:
    its per-chunk steps and its side streams (a Protocol: the dispatcher's slots call this
    module, so this module does not import the dispatcher)."""

    @property
    def chunks(self) -> int: ...
    @property
    def side_streams(self) -> dict[object, SideStreams]: ...
    def permute(
        self,
        hidden_TD: Tensor,
        probs_TK: Tensor,
        experts_TK: Tensor,
        *,
        order: CopyOrder | None = ...,
        combine: Combine = ...,
    ) -> tuple[Tensor, Tensor, PermuteMeta]: ...

    def plan(self, meta: PermuteMeta) -> DispatchMeta: ...

    def dispatch(
        self, tokens_ND: Tensor, probs_N: Tensor, meta: DispatchMeta
    ) -> tuple[Tensor, Tensor]: ...

    def combine(self, out_MD: Tensor, meta: DispatchMeta) -> Tensor: ...

    def unpermute(self, back_ND: Tensor, meta: PermuteMeta) -> Tensor: ...


CHUNKED_DISPATCHER: Contract[ChunkedDispatcher] = Contract(
    ChunkedDispatcher,
    "a ChunkedDispatcher (a TokenDispatcher's per-chunk steps and side streams)",
    attribute("chunks", POSITIVE),
    attribute("side_streams", Instance(dict, "a dict of side streams by device")),
    method("permute"),
    method("plan"),
    method("dispatch"),
    method("combine"),
    method("unpermute"),
)
"""Its rule table (the chunked slots take a :class:`~moe_overlap.blocks.TokenDispatcher`)."""


_new_stream: Callable[[torch.device], torch.cuda.Stream] = torch.cuda.Stream


# Tensor.split is unannotated in torch; give it its type once, here.
_split = cast("Callable[[Tensor, list[int]], tuple[Tensor, ...]]", torch.split)


def _release(t: Tensor) -> None:
    """Drop ``t``'s storage once it is sent (recorded on every stream that read it)."""
    release_storage(t)


def slot_permute(
    d: ChunkedDispatcher,
    ctx: SlotContext,
    hidden_TD: Tensor,
    probs_TK: Tensor,
    experts_TK: Tensor,
    *,
    order: CopyOrder | None = None,
    combine: Combine = "sum",
) -> tuple[Tensor, Tensor]:
    """Pre-dispatch in chunks: permute (``order`` within each chunk, ``combine`` as
    :meth:`TokenDispatcher.permute` takes it) and plan each chunk; chunk 0's tokens and
    probs."""
    sizes = _sizes(hidden_TD.shape[0], d.chunks)
    state = ctx.layer_state
    pmeta: list[PermuteMeta] = []
    dmeta: list[DispatchMeta] = []
    first: tuple[Tensor, Tensor] | None = None
    for j, (h, p, e) in enumerate(
        zip(
            _split(hidden_TD, sizes),
            _split(probs_TK, sizes),
            _split(experts_TK, sizes),
            strict=True,
        )
    ):
        tokens_ND, probs_N, meta = d.permute(h, p, e, order=order, combine=combine)
        pmeta.append(meta)
        dmeta.append(d.plan(meta))
        if j == 0:
            first = (tokens_ND, probs_N)
        else:
            state.stash(_TOKENS.format(j), ctx.detach(tokens_ND))
            state.stash(_PROBS.format(j), ctx.detach(probs_N))
    state.stash(_PLAN, _Plan(pmeta, dmeta))
    assert first is not None  # chunks >= 1
    return first


def slot_dispatch(
    d: ChunkedDispatcher, ctx: SlotContext, tokens_ND: Tensor, probs_N: Tensor
) -> Tensor:
    """Dispatch in chunks: chunk 0's all-to-all (its probs to ``dispatched_probs``)."""
    plan = _plan(ctx, "TokenDispatcher.slot_dispatch")
    recv_MD, recv_M = d.dispatch(tokens_ND, probs_N, plan.dispatch[0])
    ctx.layer_state.dispatched_probs = ctx.detach(recv_M)
    return recv_MD


def slot_routed_experts(
    d: ChunkedDispatcher,
    ctx: SlotContext,
    recv_MD: Tensor,
    experts: Experts,
    routed: Callable[[Tensor, Tensor, DispatchMeta, Experts], Tensor],
) -> Tensor:
    """Mlp in chunks: the experts of each chunk on the calling stream, the neighbouring
    chunks' all-to-alls under them on the side stream; chunk K-1's expert output."""
    where = "TokenDispatcher.slot_routed_experts"
    state = ctx.layer_state
    plan = _plan(ctx, where)
    probs_M = state.dispatched_probs
    if probs_M is None:
        raise IntegrationError(
            f"{where}: the mlp step expected dispatched_probs from slot_dispatch, received None"
        )
    K = len(plan.dispatch)
    side = _Side(d.side_streams, recv_MD)

    def send(j: int) -> tuple[Tensor, Tensor, AnyEvent | None]:
        tokens = _tensor(ctx, _TOKENS.format(j), where)
        probs = _tensor(ctx, _PROBS.format(j), where)
        if tokens.numel() and not tokens.untyped_storage().nbytes():
            raise IntegrationError(
                f"{where}: chunk {j}'s tokens were released when this slot sent them, and "
                "it runs again (a recompute): with chunks > 1 the mlp slot sends the chunks "
                "and cannot be recomputed; expected mlp left out of "
                "ScheduleOptions.recompute, or chunks=1"
            )
        side.enter(side.SEND, tokens, probs)
        with side.context(side.SEND):
            recv, recv_p = d.dispatch(tokens, probs, plan.dispatch[j])
            _release(tokens)
        return recv, recv_p, side.to_main(side.SEND, recv, recv_p)

    def back(j: int, y_MD: Tensor) -> None:
        pm = plan.permute[j]
        side.enter(side.BACK, y_MD, *pm.tensors)
        with side.context(side.BACK):
            out_TD = d.unpermute(d.combine(y_MD, plan.dispatch[j]), pm)
        state.stash(_OUT.format(j), ctx.detach(out_TD))

    pending = send(1) if K > 1 else None
    x_MD, p_M = recv_MD, probs_M
    for j in range(K):
        y_MD = routed(x_MD, p_M, plan.dispatch[j], experts)
        if j == K - 1:
            plan.side_done = (side.to_main(side.SEND), side.to_main(side.BACK))
            return y_MD
        back(j, y_MD)
        assert pending is not None
        x_MD, p_M, ready = pending
        pending = send(j + 2) if j + 2 < K else None
        if ready is not None:
            side.wait_main(ready)
    raise AssertionError("unreachable: the loop returns at its last chunk")


def slot_combine(d: ChunkedDispatcher, ctx: SlotContext, out_MD: Tensor) -> Tensor:
    """Combine in chunks: chunk K-1's all-to-all back and unpermute, then every chunk's
    output in token order ``[T, D]``."""
    where = "TokenDispatcher.slot_combine"
    plan = _plan(ctx, where)
    K = len(plan.dispatch)
    last = d.unpermute(d.combine(out_MD, plan.dispatch[K - 1]), plan.permute[K - 1])
    outs = [_tensor(ctx, _OUT.format(j), where) for j in range(K - 1)]
    if any(e is not None for e in plan.side_done):
        stream = (
            torch.cuda.current_stream(out_MD.device)
            if out_MD.is_cuda
            else current_stream(cpu_default_stream())
        )
        for event in plan.side_done:
            if event is not None:
                wait_event(event, stream)
        for t in outs:
            record_tensor_on(t, stream)
    return torch.cat([*outs, last])
