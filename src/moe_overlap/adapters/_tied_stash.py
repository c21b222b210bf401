"""A parameter used in both pre- and post-process (a tied word embedding and output layer;
an embedding that multi-token-prediction layers use again), its two gradients per
microbatch summed as the model's own backward sums them.

In the model's own backward both uses' gradients meet in one autograd buffer and reach
``.grad`` as one sum. The schedule runs a microbatch's post-process backward and its
pre-process backward apart, interleaved with other microbatches; autograd would add each
part to ``.grad`` on its own, and 16-bit (and float32) rounding tells the orders apart.
Here post-process's part is held in the microbatch's :class:`Stash`, and the embedding's
backward hands autograd ``held + own``: ``.grad`` gets one sum per microbatch, in
microbatch order, in every schedule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor

__all__ = ["Stash", "hand", "take"]


class Stash:
    """The post-process gradients of one microbatch's shared parameters, by parameter id."""

    __slots__ = ("grads",)

    def __init__(self) -> None:
        self.grads: dict[int, Tensor] = {}


class _Hand(torch.autograd.Function):
    """Identity on a parameter used in post-process: its gradient goes to the stash."""

    @staticmethod
    def forward(ctx: Any, param: Tensor, stash: Stash) -> Tensor:  # FunctionCtx: no fields
        ctx.stash, ctx.key = stash, id(param)
        return param.view_as(param)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[None, None]:
        (grad,) = grads
        held: dict[int, Tensor] = ctx.stash.grads
        key: int = ctx.key
        held[key] = grad if key not in held else held[key] + grad
        return None, None


class _Take(torch.autograd.Function):
    """Identity on a parameter used in pre-process: its gradient is the stashed
    post-process part plus its own."""

    @staticmethod
    def forward(ctx: Any, param: Tensor, stash: Stash) -> Tensor:
        ctx.stash, ctx.key = stash, id(param)
        return param.view_as(param)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor, None]:
        (grad,) = grads
        held: Tensor | None = ctx.stash.grads.pop(ctx.key, None)
        return (grad if held is None else held + grad), None


# Function.apply is untyped; give it its signature once, here.
hand = cast("Callable[[Tensor, Stash], Tensor]", _Hand.apply)  # pyright: ignore[reportUnknownMemberType]
take = cast("Callable[[Tensor, Stash], Tensor]", _Take.apply)  # pyright: ignore[reportUnknownMemberType]
