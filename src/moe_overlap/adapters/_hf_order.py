"""The order in which a transformers experts module takes each expert's rows.

Legend: ``T`` tokens, ``K`` top-k, ``M`` rows of the adapter's call (one id each).

An expert's weight gradient sums its rows' products in the order the rows reach its GEMM,
so the model's own gradients come out bit for bit only if the adapter's experts see each
expert's rows in the order the model's own call would give them. transformers' experts
implementations (``config._experts_implementation``, the classes decorated with
``use_experts_implementation``) order them so:

- ``grouped_mm``: the flat ``(token, k)`` ids sorted by ``torch.sort``, which is not a
  stable sort: within an expert the rows are in whatever order the sort leaves them. The
  same sort runs again on the adapter's call (rows already grouped), and moves rows again;
- ``eager`` (the class's own loop over the experts hit, as transformers writes it): an
  expert's rows by ``k``, then by token; on the adapter's call (one id per row), in the
  order given;
- ``batched_mm``, or an experts module without the decorator: token order (the
  dispatcher's default), and the order given.

A token's ``K`` outputs are added into its output (forward), and the gradients of its
``K`` copies into its gradient (backward); from ``K = 3`` on the order of those additions
changes the rounding:

- ``grouped_mm``: forward, a sum over ``K`` (the dispatcher's default); backward, its one
  gather (indexing the tokens in its sorted order) adds a token's copies one by one by
  ascending expert;
- ``eager``: forward, an ``index_add`` per expert, by ascending expert (the grouped order:
  ``combine="grouped"``); backward, it indexes the tokens once per expert, and autograd
  adds each expert's gradient into the block input's as it arrives, the expert run last
  first, between the gradients of the block's other parts that reach the input;
- ``batched_mm``: a sum over ``K`` both ways (it repeats each token ``K`` times).

So, for ``grouped_mm`` and ``eager``, the adapter gathers the copies at the point of the
block's call, with the same operations (:attr:`RowOrder.gather`), and hands them to the
dispatcher (:class:`~moe_overlap.blocks.Gathered`).

:func:`row_order` gives all of it for a module, read when called (the implementation can
be switched on a built model). The mlp slot hands the experts their rows so that
:attr:`RowOrder.regroup` puts them back in the grouped order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor, nn

from moe_overlap.blocks import Combine, CopyOrder

__all__ = ["RowOrder", "implementation", "row_order"]


@dataclass(frozen=True, slots=True)
class RowOrder:
    """How an experts module orders each expert's rows (see the module docstring)."""

    copies: CopyOrder | None
    """The block's call (``[T, K]`` ids): the flat ``(token, k)`` indices grouped by expert
    in the module's order (``None``: token order within an expert)."""
    regroup: Callable[[Tensor], Tensor] | None
    """The adapter's call (``[M]`` ids, grouped): the permutation the module applies to the
    rows before its GEMMs (``None``: it keeps their order)."""
    gather: Callable[[Tensor, Tensor, Tensor], Tensor] | None
    """The block's call: ``gather(hidden_TD, experts_TK, order_N)``, the copies ``order_N``
    (from :attr:`copies`) gathered with the module's own indexing (``None``: the
    dispatcher's expand, whose gradient is a sum over ``K``)."""
    combine: Combine
    """How the module adds each token's outputs (:data:`~moe_overlap.blocks.Combine`)."""


def _sorted(ids: Tensor) -> Tensor:
    """The permutation ``torch.sort`` gives the flat ids (what ``grouped_mm`` groups by)."""
    return torch.sort(ids.reshape(-1)).indices


def _by_k_then_token(experts_TK: Tensor) -> Tensor:
    """Flat ``(token, k)`` indices grouped by expert, then by ``k``, then by token."""
    K = experts_TK.shape[1]
    slot_N = torch.arange(K, device=experts_TK.device).repeat(experts_TK.shape[0])
    return torch.argsort(experts_TK.reshape(-1) * K + slot_N, stable=True)


def _gather_sorted(hidden_TD: Tensor, experts_TK: Tensor, order_N: Tensor) -> Tensor:
    """``grouped_mm``'s gather: the tokens indexed once, in the grouped order."""
    return hidden_TD[order_N // experts_TK.shape[1]]


def _gather_per_expert(hidden_TD: Tensor, experts_TK: Tensor, order_N: Tensor) -> Tensor:
    """``eager``'s gather: the tokens indexed once per expert hit, by ascending expert."""
    K = experts_TK.shape[1]
    counts_X = torch.bincount(experts_TK.reshape(-1))
    # A host read, as the module's own loop over the experts hit.
    sizes = [n for n in cast("list[int]", counts_X.tolist()) if n]  # pyright: ignore[reportUnknownMemberType]
    parts: tuple[Tensor, ...] = torch.split(order_N, sizes)
    return torch.cat([hidden_TD[part // K] for part in parts])


_GROUPED = RowOrder(copies=_sorted, regroup=_sorted, gather=_gather_sorted, combine="sum")
_EAGER = RowOrder(
    copies=_by_k_then_token, regroup=None, gather=_gather_per_expert, combine="grouped"
)
_GIVEN = RowOrder(copies=None, regroup=None, gather=None, combine="sum")


def implementation(experts: nn.Module) -> str | None:
    """The transformers experts implementation the module dispatches to: ``eager`` for
    its own forward, ``None`` when it is not decorated with ``use_experts_implementation``
    (which sets ``has_gate`` and ``config`` on it)."""
    if not hasattr(experts, "has_gate"):
        return None
    config: object = getattr(experts, "config", None)
    name: object = getattr(config, "_experts_implementation", None)
    return name if isinstance(name, str) else "eager"


def row_order(experts: nn.Module) -> RowOrder:
    """The row order of ``experts``'s current implementation."""
    name = implementation(experts)
    if name == "grouped_mm":
        return _GROUPED
    if name == "eager":
        return _EAGER
    return _GIVEN
