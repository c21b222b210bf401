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

Backward sums the gradients of a token's ``K`` copies into the token's; from ``K = 3`` on
the order of those additions changes the rounding. ``grouped_mm`` gathers the copies by
indexing the tokens in its sorted order, so it adds a token's copies one by one by
ascending expert; ``eager`` indexes the tokens once per expert, and autograd adds those
gradients as they arrive, the expert run last first: by descending expert; ``batched_mm``
repeats each token ``K`` times, whose gradient is a sum over ``K`` (the dispatcher's
default).

:func:`row_order` gives all three for a module, read when called (the implementation can
be switched on a built model). The dispatcher groups the copies as
:attr:`RowOrder.copies` says and gathers them as :attr:`RowOrder.sums` says; the mlp slot
hands the experts their rows so that :attr:`RowOrder.regroup` puts them back in that
order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from moe_overlap.blocks import CopyOrder

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
    sums: CopyOrder | None
    """The block's call: the flat ``(token, k)`` indices in the order the module adds each
    token's copy gradients (``None``: a sum over ``K``, the dispatcher's default)."""


def _sorted(ids: Tensor) -> Tensor:
    """The permutation ``torch.sort`` gives the flat ids (what ``grouped_mm`` groups by)."""
    return torch.sort(ids.reshape(-1)).indices


def _by_k_then_token(experts_TK: Tensor) -> Tensor:
    """Flat ``(token, k)`` indices grouped by expert, then by ``k``, then by token."""
    K = experts_TK.shape[1]
    slot_N = torch.arange(K, device=experts_TK.device).repeat(experts_TK.shape[0])
    return torch.argsort(experts_TK.reshape(-1) * K + slot_N, stable=True)


def _by_expert_descending(experts_TK: Tensor) -> Tensor:
    """Flat ``(token, k)`` indices by descending expert (a token's copies have distinct
    experts, so ties never decide a token's order)."""
    return torch.argsort(experts_TK.reshape(-1), descending=True, stable=True)


_GROUPED = RowOrder(copies=_sorted, regroup=_sorted, sums=_sorted)
_EAGER = RowOrder(copies=_by_k_then_token, regroup=None, sums=_by_expert_descending)
_GIVEN = RowOrder(copies=None, regroup=None, sums=None)


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
