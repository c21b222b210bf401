"""A torchtitan transformer block cut into the four slots of :class:`~moe_overlap.SchedulableLayer`.

Legend: ``B`` batch, ``L`` sequence, ``D`` hidden, ``T = B*L`` tokens, ``K`` top-k,
``R`` rows the experts receive, ``E`` experts.

MoE block slots (every module and method called is torchtitan's own)::

    pre_dispatch: h = the block's own forward with its ``moe`` stood in for (attention,
                  norms, the residual add of the attention branch; the stand-in returns a
                  zero and keeps its input u); the MoE's own forward on u with its
                  ``routed_experts`` stood in for (router with its expert bias, score
                  function and grouped routing, the load-balancing token count, shared
                  experts); the stand-in keeps what the MoE hands its routed experts
    dispatch:     the block's token dispatcher's own ``dispatch`` (local reorder and, under
                  torchtitan's expert parallelism, the count exchange and all-to-all)
    mlp:          the block's own ``inner_experts`` on the received rows
    combine:      the token dispatcher's own ``combine`` (all-to-all back, scores,
                  scatter-add), + the MoE's other output (shared experts), + h

Dense blocks run their own ``forward`` whole in pre-dispatch.

A block torchtitan wrapped for activation checkpointing (``SelectiveAC``, ``FullAC``) is
built on inside its wrapper: pre-dispatch and mlp (a dense block: its whole forward) each
run as one checkpointed region with the wrapper's settings (:mod:`._tt_recompute`).

The split assumes the block's output is ``h + moe(u)`` and the MoE's is
``routed + rest``; the adapter's self-check (:mod:`._tt_check`) compares it with the
block's own forward and backward at construction and refuses a block it does not match.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar, cast

import torch
from torch import Tensor, nn

from moe_overlap import CudaGraphModule, IntegrationError, WgradLayer, WgradScope
from moe_overlap.adapters._hf_calls import swap_child as swap
from moe_overlap.adapters._hf_experts import DelayedLinear, WgradGroup
from moe_overlap.adapters._tt_imports import titan
from moe_overlap.adapters._tt_recompute import TitanCheckpoint
from moe_overlap.adapters._wrapped_layer import WrappedDenseLayer, WrappedLayer, wgrad_scopes
from moe_overlap.blocks import DelayedWgradModule, MoESlots, SlotContext
from moe_overlap.engine import ChunkState
from moe_overlap.protocols import FreeInputConfig

__all__ = [
    "BlockCall",
    "BlockCalls",
    "TitanDenseLayer",
    "TitanLayer",
    "TitanMoELayer",
    "delay_titan_linears",
    "swap",
]


@dataclass(frozen=True, slots=True)
class BlockCall:
    """What torchtitan's decoder hands every block: its attention masks and positions.

    A dataclass, not a NamedTuple: debug mode's beartype cannot resolve a NamedTuple's
    generated ``__new__`` hints (``Tensor``) in this module."""

    attention_masks: object
    positions: Tensor | None


BlockCalls = Callable[[ChunkState], BlockCall]
"""The block arguments of a microbatch (computed once per chunk by the adapter)."""

_R = TypeVar("_R")

_REST = "moe_overlap.titan.rest"
_ROUTED = "moe_overlap.titan.routed"
_DISPATCHED = "moe_overlap.titan.dispatched"


class _Keep(nn.Module):
    """Stands in for a child: keeps the arguments it is called with, returns a zero of the
    first one's shape (an expanded scalar: no memory)."""

    def __init__(self) -> None:
        super().__init__()
        self.args: tuple[object, ...] | None = None
        self.out: Tensor | None = None

    def forward(self, *args: object) -> Tensor:
        first = args[0]
        if not isinstance(first, Tensor):
            raise IntegrationError(
                f"torchtitan adapter stand-in: expected a tensor as the first argument, "
                f"received {type(first).__name__}"
            )
        self.args = args
        self.out = torch.zeros((), dtype=first.dtype, device=first.device).expand(first.shape)
        return self.out

    def take(self, where: str, count: int) -> tuple[object, ...]:
        args, self.args, self.out = self.args, None, None
        if args is None or len(args) != count:
            got = "no call" if args is None else f"{len(args)} arguments"
            raise IntegrationError(
                f"{where}: expected the stood-in module to be called once with {count} "
                f"arguments, received {got}"
            )
        return args


@dataclass(frozen=True, slots=True)
class _RoutedCall:
    """What the MoE handed its routed experts, as their forward first views it (a
    dataclass: see :class:`BlockCall`)."""

    x_TD: Tensor
    scores_TK: Tensor
    ids_TK: Tensor
    counts_E: Tensor
    shape: torch.Size  # (B, L, D)


class _KeepRouted(_Keep):
    """Stands in for the MoE's ``routed_experts``: takes the token-major views of its
    input, scores and expert ids at the point of the call, as torchtitan's
    ``RoutedExperts.forward`` does first. The views are then created where the original's
    are (before the shared experts run), so backward sums the MoE input's gradient from
    the router, the routed experts and the shared experts in the original's order: the
    gradients are bit-identical to the model's own, not only equal up to rounding."""

    def __init__(self) -> None:
        super().__init__()
        self.call: _RoutedCall | None = None

    def forward(self, *args: object) -> Tensor:
        out = super().forward(*args)
        self.call = None
        if len(args) == 4 and all(isinstance(a, Tensor) for a in args):
            x_BLD, scores_BLK, ids_BLK, counts_E = cast("tuple[Tensor, ...]", args)
            if x_BLD.dim() == 3 and scores_BLK.dim() == 3 and ids_BLK.shape == scores_BLK.shape:
                B, L, D = x_BLD.shape
                T, K = B * L, scores_BLK.size(-1)
                self.call = _RoutedCall(
                    x_BLD.view(T, D),
                    scores_BLK.view(T, K),
                    ids_BLK.view(T, K),
                    counts_E,
                    x_BLD.shape,
                )
        return out

    def take_call(self, where: str) -> _RoutedCall:
        args = self.take(where, 4)
        call, self.call = self.call, None
        if call is None:
            got = ", ".join(
                f"{tuple(a.shape)}" if isinstance(a, Tensor) else type(a).__name__ for a in args
            )
            raise IntegrationError(
                f"{where}: expected the routed experts to be called with the tokens (B, L, D), "
                f"the top-k scores and expert ids (B, L, K) and the token counts (E,), as "
                f"torchtitan's MoE calls them, received {got}"
            )
        return call


def _tensor(value: object, where: str) -> Tensor:
    if not isinstance(value, Tensor):
        raise IntegrationError(f"{where}: expected a tensor, received {type(value).__name__}")
    return value


class _Dispatcher(Protocol):
    """torchtitan's token dispatchers (``LocalTokenDispatcher`` and its subclasses)."""

    def dispatch(
        self, x_TD: Tensor, scores_TK: Tensor, ids_TK: Tensor, counts_E: Tensor, /
    ) -> tuple[object, object, object]: ...

    def combine(self, out_RD: Tensor, metadata: object, x_TD: Tensor, /) -> object: ...


@dataclass(frozen=True, slots=True)
class _Routed:
    """What pre-dispatch hands dispatch besides the slot inputs (no gradient)."""

    expert_ids_TK: Tensor
    counts_E: Tensor
    x_TD: Tensor  # detached, for the dispatcher's combine (it reads the shape)
    shape: torch.Size


@dataclass(frozen=True, slots=True)
class _Dispatched:
    """What dispatch hands mlp and combine: the received counts and the metadata, whose
    differentiable tensors went through ``ctx.detach``."""

    counts_e: Tensor
    metadata: object
    x_TD: Tensor
    shape: torch.Size


def _detach_metadata(ctx: SlotContext, metadata: object, where: str) -> object:
    """The dispatcher's metadata with every tensor that carries a gradient cut from the
    dispatch slot's graph (its gradient flows back when combine's backward runs)."""
    if isinstance(metadata, Tensor):
        return ctx.detach(metadata) if metadata.requires_grad else metadata
    if not dataclasses.is_dataclass(metadata) or isinstance(metadata, type):
        items: object = metadata
        if isinstance(items, (tuple, list)) and any(
            isinstance(t, Tensor) and t.requires_grad for t in cast("Sequence[object]", items)
        ):
            raise IntegrationError(
                f"{where}: the token dispatcher's metadata is a sequence holding tensors "
                "with gradients; expected a dataclass (as torchtitan's dispatchers return)"
            )
        return metadata
    changes: dict[str, object] = {}
    for f in dataclasses.fields(metadata):
        value: object = getattr(metadata, f.name)
        if isinstance(value, Tensor) and value.requires_grad:
            changes[f.name] = ctx.detach(value)
    return dataclasses.replace(metadata, **changes) if changes else metadata


class _BlockBase(WrappedLayer):
    """What dense and MoE blocks share here: the block's name and arguments, its
    activation-checkpoint wrapper, how errors name it."""

    def __init__(
        self,
        block: nn.Module,
        index: int,
        name: str,
        calls: BlockCalls,
        config: FreeInputConfig,
        checkpoint: TitanCheckpoint | None = None,
    ) -> None:
        super().__init__(block, index, config)
        self.name = name
        self.calls = calls
        self.checkpoint = checkpoint
        """torchtitan's checkpoint wrapper around the block: its slots are recomputed."""

    def _run(self, fn: Callable[..., _R], *args: object) -> _R:
        """``fn(*args)``, as one checkpointed region when the block is wrapped."""
        if self.checkpoint is None:
            return fn(*args)
        return self.checkpoint.run(fn, *args)

    def where(self, slot: str) -> str:
        return f"{self.name} ({type(self.layer).__name__}) {slot}"


class TitanDenseLayer(WrappedDenseLayer, _BlockBase):
    """A block without routed experts: its own ``forward``, whole, in pre-dispatch
    (recomputed whole when torchtitan wrapped it for activation checkpointing)."""

    def __init__(
        self,
        block: nn.Module,
        index: int,
        name: str,
        calls: BlockCalls,
        config: FreeInputConfig,
        *,
        delayed: Sequence[DelayedLinear] = (),
        checkpoint: TitanCheckpoint | None = None,
    ) -> None:
        super().__init__(block, index, name, calls, config, checkpoint)
        self.group = WgradGroup(delayed)

    def forward(self, x_BLD: Tensor, chunk_state: ChunkState) -> Tensor:
        call = self.calls(chunk_state)
        out: object = self._run(self.layer, x_BLD, call.attention_masks, call.positions)
        return _tensor(out, self.where("forward"))


class TitanMoELayer(_BlockBase, MoESlots):
    """A torchtitan block with a ``moe`` (torchtitan's ``MoE``), split as the module
    docstring says."""

    def __init__(
        self,
        block: nn.Module,
        index: int,
        name: str,
        calls: BlockCalls,
        config: FreeInputConfig,
        *,
        attention_delayed: Sequence[DelayedLinear] = (),
        moe_delayed: Sequence[DelayedLinear] = (),
        checkpoint: TitanCheckpoint | None = None,
    ) -> None:
        super().__init__(block, index, name, calls, config, checkpoint)
        self.moe = block.get_submodule("moe")
        self.routed_experts = self.moe.get_submodule("routed_experts")
        self.inner_experts = self.routed_experts.get_submodule("inner_experts")
        dispatcher: object = getattr(self.routed_experts, "token_dispatcher", None)
        if not all(callable(getattr(dispatcher, m, None)) for m in ("dispatch", "combine")):
            raise IntegrationError(
                f"{self.where('dispatch')}: expected moe.routed_experts.token_dispatcher with "
                f"dispatch/combine (torchtitan's), received {type(dispatcher).__name__}"
            )
        self.dispatcher = cast("_Dispatcher", dispatcher)
        self.attention_group = WgradGroup(attention_delayed)
        self.moe_group = WgradGroup(moe_delayed)
        self._moe_stand_in = _Keep()
        self._routed_stand_in = _KeepRouted()

    @property
    def num_local_experts(self) -> int:
        n: object = getattr(self.inner_experts, "num_experts", None)
        w: object = getattr(self.inner_experts, "w1_EFD", None)
        if isinstance(w, Tensor):  # the local shard under expert parallelism
            local = getattr(w, "to_local", None)
            t = cast("Tensor", local()) if callable(local) else w
            return int(t.shape[0])
        return n if isinstance(n, int) else 1

    # --- the math, once, for the slots and the plain path --------------------------------
    def _pre_dispatch_region(
        self, x_BLD: Tensor, masks: object, positions: Tensor | None
    ) -> tuple[Tensor, Tensor | None, _RoutedCall]:
        """The block's and the MoE's own code up to the routed experts (one checkpointed
        region when the block is wrapped: run again, whole, in backward): the block's
        output without the MoE, the MoE's other output (``None``: nothing besides the
        routed experts), what the MoE hands its routed experts."""
        keep_moe, keep_routed = self._moe_stand_in, self._routed_stand_in
        with swap(self.layer, "moe", keep_moe):
            h = _tensor(self.layer(x_BLD, masks, positions), self.where("block"))
        (u,) = keep_moe.take(self.where("pre_dispatch: the block's moe"), 1)
        u_BLD = _tensor(u, self.where("moe input"))
        with swap(self.moe, "routed_experts", keep_routed):
            rest: object = self.moe(u_BLD)
            stood_in_out = keep_routed.out
        routed = keep_routed.take_call(self.where("pre_dispatch: the MoE's routed_experts"))
        return h, None if rest is stood_in_out else _tensor(rest, self.where("moe output")), routed

    def pre_dispatch(self, ctx: SlotContext, x_BLD: Tensor) -> tuple[Tensor, Tensor]:
        call = self.calls(ctx.chunk_state)
        h, rest, routed = self._run(
            self._pre_dispatch_region, x_BLD, call.attention_masks, call.positions
        )
        state = ctx.layer_state
        state.residual = ctx.detach(h)
        # What the MoE adds to its routed experts' output (shared experts); nothing when
        # its output is the stand-in's own.
        if rest is None:
            state.stash(_REST, None)
        else:
            state.stash(_REST, ctx.detach(rest) if rest.requires_grad else rest)
        state.stash(
            _ROUTED,
            _Routed(
                routed.ids_TK.detach(),
                routed.counts_E.detach(),
                routed.x_TD.detach(),
                routed.shape,
            ),
        )
        return routed.x_TD, routed.scores_TK

    def dispatch(self, ctx: SlotContext, x_TD: Tensor, scores_TK: Tensor) -> Tensor:
        where = self.where("dispatch")
        routed = ctx.layer_state.take(_ROUTED, _Routed)
        received_RD, counts_e, metadata = self.dispatcher.dispatch(
            x_TD, scores_TK, routed.expert_ids_TK, routed.counts_E
        )
        ctx.layer_state.stash(
            _DISPATCHED,
            _Dispatched(
                _tensor(counts_e, where).detach(),
                _detach_metadata(ctx, metadata, where),
                routed.x_TD,
                routed.shape,
            ),
        )
        return _tensor(received_RD, where)

    def _experts(self, received_RD: Tensor, counts_e: Tensor) -> object:
        with titan().sparse_mesh():
            return self.inner_experts(received_RD, counts_e)

    def mlp_forward(self, ctx: SlotContext, received_RD: Tensor) -> Tensor:
        d = ctx.layer_state.take(_DISPATCHED, _Dispatched)
        out = self._run(self._experts, received_RD, d.counts_e)
        return _tensor(out, self.where("mlp"))

    def combine(self, ctx: SlotContext, out_RD: Tensor) -> Tensor:
        state = ctx.layer_state
        d = state.take(_DISPATCHED, _Dispatched)
        out = self.dispatcher.combine(out_RD, d.metadata, d.x_TD)
        out_TD = _tensor(out, self.where("combine"))
        B, _, D = d.shape
        m = out_TD.view(B, -1, D)
        rest: object = state.extras.get(_REST)
        if isinstance(rest, Tensor):
            m = m + rest
        return self.take_residual(ctx) + m

    # --- delayed weight gradients ---------------------------------------------------------
    def pre_dispatch_wgrad(self) -> Sequence[WgradScope]:
        return wgrad_scopes(
            (CudaGraphModule.attn, self.attention_group),
            (CudaGraphModule.moe_router, self.moe_group),
        )

    def mlp_wgrad(self) -> Sequence[WgradLayer]:
        return []

    def delayed_modules(self) -> tuple[DelayedWgradModule, ...]:
        return self.attention_group.modules + self.moe_group.modules


TitanLayer = TitanDenseLayer | TitanMoELayer
"""A layer of :class:`~moe_overlap.adapters.torchtitan.TorchtitanMoEAdapter`."""


def _plain_linear(module: nn.Module) -> bool:
    """An ``nn.Linear`` (or a subclass that keeps its ``forward``, as torchtitan's)."""
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward


def delay_titan_linears(
    parent: nn.Module, *, skip: tuple[nn.Module, ...] = ()
) -> list[DelayedLinear]:
    """Swap every linear under ``parent`` (not under ``skip``) for a :class:`DelayedLinear`
    sharing its parameters (same ``state_dict`` keys); returns them."""
    found: list[DelayedLinear] = []
    for name, child in list(parent.named_children()):
        if any(child is s for s in skip):
            continue
        if isinstance(child, DelayedLinear):
            child.delay_wgrad = True
            found.append(child)
        elif _plain_linear(child):
            swapped = DelayedLinear(cast("nn.Linear", child), delay_wgrad=True)
            setattr(parent, name, swapped)
            found.append(swapped)
        else:
            found += delay_titan_linears(child, skip=skip)
    return found
