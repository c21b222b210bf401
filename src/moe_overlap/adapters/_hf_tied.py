"""Tied input and output embeddings: one sum of a microbatch's two gradients, as the model's.

The model's own ``backward()`` sums a tied weight's two gradients of a microbatch, the LM
head's and the embedding's, before it adds them to ``.grad``: ``G + (g_head + g_emb)``.
The schedule backpropagates the head (post-process) and the embedding (pre-process) as
separate steps, each adding its own: ``(G + g_head) + g_emb``, which rounds otherwise from
the second microbatch on. :class:`TiedGradients` holds the head's gradient and adds it to
the embedding's, so ``.grad`` receives their sum, bit for bit the model's.

The embedding step uses the tied weight through a node that, in backward, adds the held
gradient (:meth:`TiedGradients.embedding`); the head step of the same microbatch (the next
one to run) through a node that holds its gradient (:meth:`TiedGradients.head`). Each is
put in only where the step's graph is seen to use it (a wrapper that swaps the parameter
itself, FSDP's, leaves the usual accumulation), and a head gradient arriving after its
embedding's backward ran goes to ``.grad`` as usual: a gradient is never held for nothing.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Generator
from typing import Any, cast

import torch
from torch import Tensor, nn

from moe_overlap.adapters._torch_private import parameters

__all__ = ["TiedGradients", "tied_embeddings"]


class _Slot:
    """One microbatch's tied gradients: the head's, held until the embedding's backward."""

    __slots__ = ("consumed", "held", "used")

    def __init__(self) -> None:
        self.held: list[Tensor | None] = []
        self.used = False
        """The embedding step's graph uses the adding node."""
        self.consumed = False
        """The embedding's backward ran (nothing is held after that)."""


class _Hold(torch.autograd.Function):
    """Identity; backward holds the gradient in the slot (or passes it on, if too late)."""

    @staticmethod
    def forward(ctx: Any, weight: Tensor, slot: _Slot, i: int) -> Tensor:
        ctx.slot, ctx.i = slot, i
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Tensor) -> tuple[Tensor | None, None, None]:
        (grad,) = grad_outputs
        slot = cast(_Slot, ctx.slot)
        i = cast(int, ctx.i)
        if slot.consumed:
            return grad, None, None
        held = slot.held[i]
        slot.held[i] = grad if held is None else held + grad
        return None, None, None


class _AddHeld(torch.autograd.Function):
    """Identity; backward adds the head's held gradient to the embedding's."""

    @staticmethod
    def forward(ctx: Any, weight: Tensor, slot: _Slot, i: int) -> Tensor:
        ctx.slot, ctx.i = slot, i
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Tensor) -> tuple[Tensor, None, None]:
        (grad,) = grad_outputs
        slot = cast(_Slot, ctx.slot)
        i = cast(int, ctx.i)
        held = slot.held[i]
        slot.held[i] = None
        slot.consumed = all(h is None for h in slot.held)
        return (grad if held is None else held + grad), None, None


# Function.apply is untyped; give it its signature once, here.
_Apply = Callable[[Tensor, _Slot, int], Tensor]
_hold = cast(_Apply, _Hold.apply)  # pyright: ignore[reportUnknownMemberType]
_add_held = cast(_Apply, _AddHeld.apply)  # pyright: ignore[reportUnknownMemberType]


def tied_embeddings(model: nn.Module) -> list[nn.Parameter]:
    """The parameters the model's input and output embeddings share (transformers'
    ``tie_word_embeddings``), by identity."""
    get_in: object = getattr(model, "get_input_embeddings", None)
    get_out: object = getattr(model, "get_output_embeddings", None)
    if not (callable(get_in) and callable(get_out)):
        return []
    modules = (get_in(), get_out())
    if not all(isinstance(m, nn.Module) for m in modules):
        return []
    inp, out = cast("tuple[nn.Module, nn.Module]", modules)
    ids = {id(p) for p in out.parameters()}
    return [p for p in inp.parameters() if id(p) in ids and p.requires_grad]


def _registrations(
    model: nn.Module, params: list[nn.Parameter]
) -> list[tuple[nn.Module, str, int]]:
    """Every ``(module, name, i)`` registering ``params[i]`` in the model."""
    index = {id(p): i for i, p in enumerate(params)}
    found: list[tuple[nn.Module, str, int]] = []
    for module in model.modules():
        for name, p in parameters(module).items():
            if p is not None and id(p) in index:
                found.append((module, name, index[id(p)]))
    return found


def _reaches(root: Tensor, nodes: set[int]) -> bool:
    """``root``'s graph holds every node of ``nodes`` (by id)."""
    left = set(nodes)
    todo: deque[object] = deque([root.grad_fn])
    seen: set[int] = set()
    while todo and left:
        node = todo.popleft()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        left.discard(id(node))
        nexts = cast("tuple[tuple[object, int], ...]", getattr(node, "next_functions", ()))
        todo.extend(n for n, _ in nexts)
    return not left


class TiedGradients:
    """See the module docstring. ``params``: the tied parameters (may be empty: then the
    context managers do nothing)."""

    def __init__(self, model: nn.Module, params: list[nn.Parameter]) -> None:
        self.params = params
        self._where: list[tuple[nn.Module, str, int]] = (
            _registrations(model, params) if params else []
        )
        self._slot: _Slot | None = None
        """The last embedding step's slot, until a head step takes it."""

    @contextlib.contextmanager
    def _swapped(self, fn: _Apply, slot: _Slot) -> Generator[set[int], None, None]:
        """Every registration of a tied parameter in the model is ``fn``'s output inside
        (read by the module as its parameter); yields the nodes' ids."""
        uses = [fn(p, slot, i) for i, p in enumerate(self.params)]
        before = [(m, n, parameters(m)[n]) for m, n, _ in self._where]
        for m, n, i in self._where:
            # A tensor, not a Parameter: what torch.func.functional_call puts there too.
            parameters(m)[n] = cast(nn.Parameter, uses[i])
        try:
            yield {id(u.grad_fn) for u in uses}
        finally:
            for m, n, p in before:
                parameters(m)[n] = p

    def follow(self, model: nn.Module) -> None:
        """Take the model's tied parameters as they are now (tied or untied since
        construction: the held gradient would otherwise go to a parameter no longer used,
        or the two uses' gradients reach ``.grad`` apart). Called between steps."""
        now = tied_embeddings(model)
        where = _registrations(model, now) if now else []
        if [id(p) for p in now] != [id(p) for p in self.params] or where != self._where:
            self.params, self._where, self._slot = now, where, None

    def _active(self) -> bool:
        return bool(self._where) and torch.is_grad_enabled()

    @contextlib.contextmanager
    def embedding(self) -> Generator[list[Tensor], None, None]:
        """The embedding step of a microbatch: put the tensor it returns in the list."""
        result: list[Tensor] = []
        if not self._active():
            self._slot = None
            yield result
            return
        slot = _Slot()
        slot.held = [None] * len(self.params)
        with self._swapped(_add_held, slot) as nodes:
            yield result
        slot.used = bool(result) and _reaches(result[0], nodes)
        self._slot = slot if slot.used else None

    @contextlib.contextmanager
    def head(self) -> Generator[list[Tensor], None, None]:
        """The head step of the microbatch last embedded (the list is for symmetry with
        :meth:`embedding`): its gradient of the tied weights is held for that embedding's
        backward."""
        result: list[Tensor] = []
        slot, self._slot = self._slot, None
        if slot is None or not self._active():
            yield result
            return
        with self._swapped(_hold, slot):
            yield result
