"""Activation recomputation inside slots, through ``torch.utils.checkpoint`` (non-reentrant).

A recomputed region stores only its inputs in forward and runs again when its slot's
backward first needs what it would have saved: inside that slot's backward node, on that
node's stream, whichever microbatch's forward is overlapped with it. The parts a layer
may recompute are named by :data:`RecomputePart`:

- ``"norm"``: each RMSNorm (its float32 intermediates are the saving);
- ``"attention_core"``: softmax(QK^T)V (the ``S x S`` scores);
- ``"activation"``: the SwiGLU product of the MLPs and the routed experts;
- ``"attention"``: the whole attention block, *selectively*: matrix products (projections,
  scores, context) are saved, everything else (norm, rotary, softmax, masking) recomputed,
  with :func:`save_matmuls` as the policy of ``create_selective_checkpoint_contexts``.

Recomputation reruns the same operations on the same inputs, so on a deterministic
backend the results are bit-identical to storing. A recomputed region's inputs stay alive
until its backward: a slot whose inputs the free-input policy releases must not pass them
to one, as the recompute would read freed memory. :func:`recompute` records its inputs,
and such a slot raises :class:`~moe_overlap.IntegrationError` instead of freeing them (a
region checkpointed with ``torch.utils.checkpoint`` directly is not recorded: keep its
inputs out of freeing slots, or turn free-input off).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import Any, Literal, TypeVar, cast, get_args

import torch
import torch.utils.checkpoint as _checkpoint
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

from moe_overlap import ConfigError, IntegrationError
from moe_overlap.args import BOOL, MODULE, Spec, check_arg, refuse
from moe_overlap.blocks._torch_private import PRIVATE_MATMUL_OPS
from moe_overlap.engine import hold_for_recompute

__all__ = [
    "RecomputePart",
    "RecomputeParts",
    "check_recompute",
    "recompute",
    "recompute_module",
    "save_matmuls",
]

_T = TypeVar("_T")

RecomputePart = Literal["norm", "attention_core", "activation", "attention"]
"""A part of a layer that can be recomputed in backward instead of stored."""

_PARTS: tuple[str, ...] = get_args(RecomputePart)

_aten: Any = torch.ops.aten
_MATMULS = frozenset(
    op
    for op in (
        getattr(_aten, name, None)
        for name in (
            "mm",
            "bmm",
            "addmm",
            "baddbmm",
            *PRIVATE_MATMUL_OPS,
        )
    )
    if op is not None
)


def save_matmuls(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    """Selective-checkpoint policy: save matrix products' outputs, recompute the rest."""
    del ctx, args, kwargs
    packet: object = getattr(op, "overloadpacket", op)
    if packet in _MATMULS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def recompute(
    fn: Callable[..., _T],
    *args: object,
    policy: Callable[..., CheckpointPolicy] | None = None,
    **kwargs: object,
) -> _T:
    """``fn(*args, **kwargs)``, recomputed in backward (selectively with ``policy``) when
    autograd records.

    Non-reentrant ``torch.utils.checkpoint``; under ``torch.no_grad()`` a plain call.
    """
    if not callable(fn):
        raise refuse("recompute: fn", "a callable", fn, error=IntegrationError)
    if policy is not None and not callable(policy):
        raise refuse("recompute: policy", "a checkpoint policy (a callable) or None", policy)
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    hold_for_recompute((*args, *kwargs.values()))  # a freeing slot then refuses to free them
    # torch leaves checkpoint's signature partly unannotated.
    run = cast("Callable[..., object]", _checkpoint.checkpoint)  # pyright: ignore[reportUnknownMemberType]
    if policy is None:
        out = run(fn, *args, use_reentrant=False, **kwargs)
    else:
        contexts = partial(
            cast(
                "Callable[..., object]",
                _checkpoint.create_selective_checkpoint_contexts,  # pyright: ignore[reportUnknownMemberType]
            ),
            policy,
        )
        out = run(fn, *args, use_reentrant=False, context_fn=contexts, **kwargs)
    return cast(_T, out)


def recompute_module(module: nn.Module, *, selective: bool = False) -> None:
    """Make every call of ``module`` recomputed in backward (selectively: matrix products
    kept, :func:`save_matmuls`), wherever it is called from.

    Sets ``module.forward`` to a method of ``module`` (a copy of ``module`` recomputes
    too, and calls its own forward); parameters and ``state_dict`` are unchanged. Applying
    it again only changes ``selective``.
    """
    check_arg("recompute_module", "module", module, MODULE)
    check_arg("recompute_module", "selective", selective, BOOL)
    module.__dict__["_moe_overlap_recompute"] = save_matmuls if selective else None
    module.forward = types.MethodType(_recomputed_forward, module)


def _recomputed_forward(self: nn.Module, *args: object, **kwargs: object) -> object:
    policy = cast("Callable[..., CheckpointPolicy] | None", self.__dict__["_moe_overlap_recompute"])
    forward = cast("Callable[..., object]", type(self).forward.__get__(self))
    return recompute(forward, *args, policy=policy, **kwargs)


class RecomputeParts(Spec[tuple[RecomputePart, ...]]):
    """A collection of :data:`RecomputePart` names, as a tuple in the given order; refused
    with :func:`check_recompute`'s messages naming ``where``."""

    __slots__ = ("where",)

    def __init__(self, where: str) -> None:
        super().__init__(f"a collection of recompute parts {_PARTS}")
        self.where = where

    def check(self, value: object) -> tuple[RecomputePart, ...]:
        if isinstance(value, str) or not _collection(value):
            check_recompute(value, self.where)  # raises, naming where
        items = tuple(cast("Iterable[RecomputePart]", value))
        check_recompute(items, self.where)
        return items


def _collection(value: object) -> bool:
    return isinstance(value, Iterable) and not isinstance(value, (bytes, Mapping, torch.Tensor))


def check_recompute(parts: object, where: str) -> frozenset[RecomputePart]:
    """``parts`` as a set of :data:`RecomputePart`; an unknown name is a ConfigError."""
    if isinstance(parts, str):
        raise ConfigError(
            f"{where}: expected a collection of recompute parts {_PARTS}, received the "
            f"string {parts!r}; pass ({parts!r},)"
        )
    if not _collection(parts):
        raise refuse(where, f"a collection of recompute parts {_PARTS}", parts, field=True)
    chosen = tuple(cast("Iterable[object]", parts))
    unknown = [p for p in chosen if p not in _PARTS]
    if unknown:
        raise ConfigError(f"{where}: expected recompute parts among {_PARTS}, received {unknown}")
    return frozenset(cast("tuple[RecomputePart, ...]", chosen))
