"""A parameter whose gradient two nodes of one microbatch accumulate: refused after the step.

Plain ``backward()`` sums the gradients of a parameter's uses in one microbatch inside
autograd and adds that sum to ``.grad`` once. The schedule runs every node's backward on its
own, so a parameter that two nodes use (an output layer tied to the embedding, a module
shared by two layers, a layer listed twice) has its microbatch's parts added to ``.grad``
one at a time, between other microbatches' parts: other rounding, not bit-identical.

Counted while :func:`~moe_overlap.combined_1f1b` runs a model's first step, and again
whenever its parameters change (added, replaced, shared, unfrozen): a post-accumulate-grad
hook on every trainable parameter counts the calls that found ``.grad`` changed (another
tensor, or written in place) since the last one. Autograd calls it once per backward pass
that reaches the parameter, so a parameter one node uses counts at most once per
microbatch, also when its weight gradient is delayed (the hook then sees the last
microbatch's ``backward_dw``) or handed to another node (as the adapters do for tied
embeddings: the node that hands it on adds nothing). More counts than microbatches: some
microbatch accumulated it twice. A delayed weight gradient two layers compute by hand
runs no hook of its own; a module two layers list is refused at plan build instead
(``check_wgrad_listed``).

A later step of a clean model walks nothing: no module, parameter or buffer registered in
the process since (:func:`~moe_overlap.engine.registrations`) and no parameter frozen then
unfrozen since means the same parameters counted (debug mode walks again at every step). A
parameter frozen since accumulates nothing; unfrozen again, it is accumulated as when it
was counted.

A hand-driven :meth:`ModelChunkSchedulePlan.run <moe_overlap.ModelChunkSchedulePlan.run>`
(or ``run_pair``) has no step the library knows: each run that backs plans is counted
(:class:`RunAccumulations`, the same count and memo as :func:`~moe_overlap.combined_1f1b`'s
for one model), against one accumulation per plan it backs. A microbatch's backward runs
whole inside the run that backs its plan (its delayed weight gradients too), and a
forward accumulates nothing, so that count is the microbatch's. Runs inside a step that
counts its own (:func:`counted_step`: ``combined_1f1b``, a prepared pipelining schedule)
are that step's.

A prepared pipelining schedule (``integrations/pipelining``) counts the same way over the
stage modules of its rank (:class:`StageAccumulations`), against torch's own schedule: that
runs one backward per stage and microbatch, so a parameter may be accumulated once per
backward of each stage holding it (an embedding tied to the output layer of another stage
on the rank is added twice per microbatch by torch's run too); more is a parameter two
nodes of one stage accumulate.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Generator, Iterable, Sequence
from types import TracebackType
from typing import cast

from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle
from typing_extensions import Self

from moe_overlap.errors import IntegrationError

from ._debug import DEBUG
from ._registrations import registrations
from ._torch_private import tensor_version

__all__ = [
    "AccumulationCount",
    "RunAccumulations",
    "StageAccumulations",
    "counted_step",
    "in_counted_step",
    "is_count_hook",
]

_Key = tuple[tuple[int, int, bool], ...]
_Seen = tuple[int, int] | None

# torch leaves the hook's type unannotated; its signature, given once.
_register = cast(
    "Callable[[Tensor, Callable[[Tensor], None]], RemovableHandle]",
    Tensor.register_post_accumulate_grad_hook,  # pyright: ignore[reportUnknownMemberType]
)


class _Clean:
    """A model whose last counted step accumulated each parameter at most once per
    microbatch: its parameters then (``key``), and what tells cheaply that they are still
    those: the process's registration count and the parameters then frozen (``frozen``)."""

    __slots__ = ("frozen", "key", "registered")

    def __init__(self, key: _Key, params: list[Tensor], registered: int) -> None:
        self.key = key
        self.frozen = [p for p in params if not p.requires_grad]
        self.registered = registered

    def unchanged(self) -> bool:
        """No parameter or module registered since, no parameter then frozen unfrozen (one
        then trainable and frozen since accumulates nothing; debug mode walks the model
        again regardless)."""
        if DEBUG or self.registered != registrations():
            return False
        return not (self.frozen and any(p.requires_grad for p in self.frozen))


_CLEAN: weakref.WeakKeyDictionary[object, _Clean] = weakref.WeakKeyDictionary()


class _Steps(threading.local):
    """The steps running now on this thread that count their own runs
    (:func:`counted_step`)."""

    def __init__(self) -> None:
        self.running: list[object] = []

    def drop(self, owner: object) -> None:
        for i, step in enumerate(self.running):
            if step is owner:
                del self.running[i]
                return


_STEPS = _Steps()


@contextlib.contextmanager
def counted_step(owner: object) -> Generator[None]:
    """Inside the block, plan runs on this thread are ``owner``'s step's, which counts
    their accumulations and checks their losses itself: a run counts nothing of its own
    (:func:`in_counted_step`)."""
    _STEPS.running.append(owner)
    try:
        yield
    finally:
        _STEPS.drop(owner)


def in_counted_step() -> bool:
    """Whether a step that counts its own runs is running on this thread
    (:func:`counted_step`)."""
    return bool(_STEPS.running)


class _Count:
    """Hooks counting the accumulations of the trainable parameters of ``modules`` (each
    parameter once) during a step (a context); nothing is walked or hooked while the
    modules are unchanged since ``owner``'s last clean step."""

    def __init__(self, owner: object, modules: Sequence[object]) -> None:
        self.owner = owner
        self.key: _Key = ()
        self.all: list[Tensor] = []
        self.registered = 0
        self.params: list[Tensor] = []
        self.holders: list[tuple[int, ...]] = []  # per parameter: the modules holding it
        self.hooks: list[_Hook] = []
        self.handles: list[RemovableHandle] = []
        self.active = all(isinstance(m, nn.Module) for m in modules)
        if not self.active:
            return
        clean: _Clean | None = None
        with contextlib.suppress(TypeError):  # not weakref-able or not hashable: always
            clean = _CLEAN.get(owner)
        if clean is not None and clean.unchanged():  # no walk: the common, later step
            self.active = False
            return
        self.registered = registrations()
        named = [
            (i, p)
            for i, m in enumerate(cast("Sequence[nn.Module]", modules))
            for _, p in m.named_parameters(remove_duplicate=False)
        ]
        self.all = [p for _, p in named]
        self.key = tuple((i, id(p), p.requires_grad) for i, p in named)
        self.active = clean is None or clean.key != self.key
        if not self.active:  # the same parameters: walk no more until something changes
            self._mark_clean()
        holders: dict[int, set[int]] = {}
        for i, p in named:
            if p.requires_grad:
                if id(p) not in holders:
                    self.params.append(p)
                holders.setdefault(id(p), set()).add(i)
        self.holders = [tuple(sorted(holders[id(p)])) for p in self.params]

    def __enter__(self) -> Self:
        if self.active:
            self.hooks = [_Hook(p) for p in self.params]
            self.handles = [
                _register(p, hook) for p, hook in zip(self.params, self.hooks, strict=True)
            ]
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _over(self, allowed: Callable[[tuple[int, ...]], int]) -> dict[int, int]:
        """The parameters (by ``id``) accumulated more often than ``allowed`` of the
        modules holding them, with their counts; none: the owner is remembered as clean
        (its next steps count nothing until its parameters change)."""
        if not self.active:
            return {}
        found = {
            id(p): h.count
            for p, h, held in zip(self.params, self.hooks, self.holders, strict=True)
            if h.count > allowed(held)
        }
        self.hooks = []
        if not found:
            self._mark_clean()
        return found

    def _mark_clean(self) -> None:
        with contextlib.suppress(TypeError):
            _CLEAN[self.owner] = _Clean(self.key, self.all, self.registered)


def _shown(over: dict[int, int], named: Iterable[tuple[str, Tensor]]) -> list[str]:
    """``name = other name (n accumulations)`` for each parameter of ``over`` (at most
    four, then how many more)."""
    names: dict[int, list[str]] = {}
    for name, p in named:
        if id(p) in over and name not in names.setdefault(id(p), []):
            names[id(p)].append(name)
    shown = [f"{' = '.join(names[key])} ({n} accumulations)" for key, n in over.items()]
    if len(shown) > 4:
        shown = [*shown[:4], f"... {len(shown) - 4} more"]
    return shown


_FIX = (
    "This step's gradients are not exact: zero them (model.zero_grad(set_to_none=True)). "
    "Give each node its own parameters (untie the weights, copy.deepcopy the shared "
    "module), or have one node hand its part of the gradient to the other, so that .grad "
    "is written once per microbatch"
)


def _two_nodes(head: str, than: str, shown: list[str]) -> IntegrationError:
    """The refusal of :class:`AccumulationCount` and :class:`RunAccumulations`: ``head``
    names the caller and the model, ``than`` what the counts exceed."""
    return IntegrationError(
        f"{head}: expected each parameter's gradient accumulated into .grad at most once per "
        f"microbatch (by one node's backward), received more accumulations than {than} for "
        f"{shown}: two nodes use the parameter (an output layer tied to the embedding, a "
        "module shared by two layers, a layer listed twice) and each adds its part on its "
        "own, between other microbatches' parts, in another order than plain backward() "
        f"(not bit-identical). {_FIX}"
    )


class AccumulationCount(_Count):
    """Count each trainable parameter's gradient accumulations during a step (a context),
    then :meth:`check` them against the microbatches the step ran."""

    def __init__(self, model: object) -> None:
        super().__init__(model, [model])
        self.model = model

    def check(self, microbatches: int) -> None:
        """Raise if a parameter was accumulated more often than ``microbatches`` times;
        else remember the model as clean (its next steps count nothing until its
        parameters change)."""
        over = self._over(lambda _: microbatches)
        if not over:
            return
        assert isinstance(self.model, nn.Module)
        shown = _shown(over, self.model.named_parameters(remove_duplicate=False))
        head = f"combined_1f1b: {type(self.model).__name__}"
        raise _two_nodes(head, f"the {microbatches} microbatches", shown)


class RunAccumulations(_Count):
    """:class:`AccumulationCount` over one hand-driven run: ``models`` holds the model of
    each plan the run backs (one model: remembered clean as ``combined_1f1b`` remembers it;
    several, which a run may back together but no model is remembered for: counted every
    run), checked against the plans holding each parameter."""

    def __init__(self, models: Sequence[object]) -> None:
        distinct = [models[0]]  # the models, each once (one, but for an odd run_pair)
        for model in models[1:]:
            if not any(model is seen for seen in distinct):
                distinct.append(model)
        super().__init__(distinct[0] if len(distinct) == 1 else None, distinct)
        self.models = distinct
        self.backs = (
            [len(models)]
            if len(distinct) == 1
            else [sum(1 for m in models if m is model) for model in distinct]
        )

    def check(self, where: str, microbatches: Sequence[int | None]) -> None:
        """Raise if a parameter was accumulated more often than the plans of the run
        holding it (``microbatches``: their indices, for the message); else remember the
        model as clean."""
        over = self._over(lambda held: sum(self.backs[i] for i in held))
        if not over:
            return
        modules = cast("list[nn.Module]", self.models)
        named = [(n, p) for m in modules for n, p in m.named_parameters(remove_duplicate=False)]
        names = ", ".join(type(m).__name__ for m in modules)
        n = len(microbatches)
        than = (
            f"the 1 microbatch the run backs (microbatch {microbatches[0]})"
            if n == 1
            else f"the {n} microbatches the run backs (microbatches "
            f"{', '.join(str(i) for i in microbatches)})"
        )
        raise _two_nodes(f"{where}: {names}", than, _shown(over, named))


class StageAccumulations(_Count):
    """:class:`AccumulationCount` over the stage modules of a prepared pipelining schedule
    on one rank (``stages``: each stage's name and module; ``owner``: what is remembered
    as clean), checked against the backwards each stage ran."""

    def __init__(self, owner: object, stages: Sequence[tuple[str, object]]) -> None:
        super().__init__(owner, [module for _, module in stages])
        self.stages = stages

    def __enter__(self) -> Self:
        _STEPS.running.append(self)  # the step's plan runs are counted here (counted_step)
        return super().__enter__()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        _STEPS.drop(self)
        super().__exit__(kind, error, trace)

    def check(self, backwards: Sequence[int], where: str) -> None:
        """Raise if a parameter was accumulated more often than the backwards run by the
        stages holding it (``backwards[i]``: stage ``i``'s); else remember ``owner`` as
        clean."""
        over = self._over(lambda held: sum(backwards[i] for i in held))
        if not over:
            return
        named = [
            (name, p)
            for _, m in self.stages
            for name, p in cast("nn.Module", m).named_parameters(remove_duplicate=False)
        ]
        held = {
            i for p, h in zip(self.params, self.holders, strict=True) if id(p) in over for i in h
        }
        stages = ", ".join(name for i, (name, _) in enumerate(self.stages) if i in held)
        raise IntegrationError(
            f"{where}: {stages}: expected each parameter's gradient accumulated into .grad "
            "at most once per backward of each stage holding it (torch's own schedule runs "
            "one backward per stage and microbatch), received more accumulations than those "
            f"backwards for {_shown(over, named)}: two nodes of a stage use the parameter "
            "(an output layer tied to the embedding, a module shared by two layers, a layer "
            "listed twice) and each adds its part on its own, between other microbatches' "
            "parts, in another order than torch's one backward of the stage (not "
            f"bit-identical). {_FIX}"
        )


class _Hook:
    """One parameter's count: calls that found its ``.grad`` changed since the last."""

    __slots__ = ("count", "seen")

    def __init__(self, param: Tensor) -> None:
        self.count = 0
        self.seen = _state(param)

    def __call__(self, param: Tensor) -> None:
        now = _state(param)
        if now != self.seen:
            self.seen = now
            self.count += 1


def is_count_hook(hook: object) -> bool:
    """Whether ``hook`` is one of the counts' post-accumulate-grad hooks (the library's own,
    on a parameter while a step counts)."""
    return isinstance(hook, _Hook)


def _state(param: Tensor) -> _Seen:
    grad = param.grad
    return None if grad is None else (id(grad), tensor_version(grad))
