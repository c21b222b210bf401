"""Which modules of a transformers model draw random numbers in their ``forward``.

Dropout, router jitter and sampled routing draw from torch's generator, and the schedule
cannot reproduce those draws (it runs the model's modules in another order and some of
them more than once per microbatch). Whether a module draws is decided by what its
``forward`` does, never from the config's field names nor from ``model.training`` alone:
on a probe, each module's ``forward`` is watched for a change of the generator's state
(CPU, and the CUDA device's) while it, not one of its children, runs. A module that draws
only in training mode (``nn.Dropout``, attention dropout, Mixtral's jitter: ``if
self.training and ...``) is accepted while it is in eval mode and refused, at every plan
build, once it is put back in training mode; one that draws in eval mode too (sampling) is
refused at construction.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import cast

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from moe_overlap import ConfigError
from moe_overlap.adapters._hf_calls import causal_lm_output, decoder_input

__all__ = [
    "Draws",
    "RandomModule",
    "check_quiet",
    "config_hint",
    "draws_matter",
    "outside_draws",
    "random_modules",
    "random_of",
    "record_draws",
    "refuse_eval_draws",
    "training_mode",
]

_PROBABILITY_SUFFIXES = ("dropout", "jitter_noise", "dropout_rate", "pdrop", "dropout_prob")


def _state(device: torch.device) -> tuple[Tensor, ...]:
    states = [torch.random.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return tuple(states)


def _changed(a: tuple[Tensor, ...], b: tuple[Tensor, ...]) -> bool:
    return any(not torch.equal(x, y) for x, y in zip(a, b, strict=True))


@dataclass(slots=True)
class _Frame:
    name: str
    state: tuple[Tensor, ...]


@dataclass(slots=True)
class Draws:
    """What :func:`record_draws` saw: the modules whose own code drew, in order, and the
    first call of every watched module (to run a drawing one again)."""

    names: list[str] = field(default_factory=list[str])
    calls: dict[str, tuple[nn.Module, tuple[object, ...], dict[str, object]]] = field(
        default_factory=dict[str, tuple[nn.Module, tuple[object, ...], dict[str, object]]]
    )

    def mark(self, name: str) -> None:
        if name not in self.names:
            self.names.append(name)


@contextlib.contextmanager
def record_draws(
    root: nn.Module, device: torch.device, *, skip: Iterable[nn.Module] = ()
) -> Generator[Draws, None, None]:
    """Inside, the names (in ``root``) of the modules whose own ``forward`` code draws
    random numbers are added to the yielded :class:`Draws` (a draw inside a child is the
    child's). Modules under ``skip`` are not watched (their draws count for their caller)."""
    found = Draws()
    stack: list[_Frame] = []
    skipped = {id(m) for s in skip for m in s.modules()}
    handles: list[RemovableHandle] = []
    for name, module in cast("Iterator[tuple[str, nn.Module]]", root.named_modules()):
        if id(module) in skipped:
            continue

        def pre(
            m: nn.Module, args: tuple[object, ...], kwargs: dict[str, object], name: str = name
        ) -> None:
            found.calls.setdefault(name, (m, args, dict(kwargs)))
            now = _state(device)
            if stack and _changed(stack[-1].state, now):
                found.mark(stack[-1].name)  # the caller drew before calling this child
            stack.append(_Frame(name, now))

        def post(m: nn.Module, args: object, out: object, name: str = name) -> None:
            del m, args, out
            now = _state(device)
            while stack and stack[-1].name != name:  # a child that raised and was caught
                stack.pop()
            if stack:
                frame = stack.pop()
                if _changed(frame.state, now):
                    found.mark(name)
            if stack:
                stack[-1].state = now  # the child's draws are the child's

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post))
    try:
        yield found
    finally:
        for h in handles:
            h.remove()


def _tensors(value: object) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in cast("Sequence[object]", value) for t in _tensors(v)]
    return []


def _restore(device: torch.device, states: tuple[Tensor, ...]) -> None:
    torch.random.set_rng_state(states[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states[1], device)


def draws_matter(draws: Draws, name: str, device: torch.device) -> bool:
    """Whether module ``name``'s output depends on its draws: its first call run again from
    two different generator states gives different outputs (the generators are restored
    after). A module whose draws cannot change its output (PhiMoE's sampling over a single
    candidate when its jitter is 0) computes deterministically."""
    module, args, kwargs = draws.calls[name]
    outs: list[list[Tensor]] = []
    saved = _state(device)
    try:
        with torch.no_grad():
            for shift in (0, 1):
                _restore(device, saved)
                for _ in range(shift):  # another state: the same sequence, one draw on
                    torch.rand(1)
                    if device.type == "cuda":
                        torch.rand(1, device=device)
                outs.append([t.detach().clone() for t in _tensors(module(*args, **kwargs))])
    finally:
        _restore(device, saved)
    a, b = outs
    return len(a) != len(b) or any(
        x.shape != y.shape or not torch.equal(x, y) for x, y in zip(a, b, strict=False)
    )


@contextlib.contextmanager
def training_mode(modules: Sequence[nn.Module]) -> Generator[None, None, None]:
    """``modules`` (each alone, not recursively) in training mode inside; restored after."""
    before = [m.training for m in modules]
    try:
        for m in modules:
            m.training = True
        yield
    finally:
        for m, flag in zip(modules, before, strict=True):
            m.training = flag


def config_hint(config: object) -> str:
    """The config's non-zero probabilities (dropout, jitter): likely why a module draws."""
    hits: list[str] = []
    for name in dir(config):
        if name.startswith("_") or not name.endswith(_PROBABILITY_SUFFIXES):
            continue
        try:
            value: object = getattr(config, name, None)
        except Exception:  # a config property that cannot be read: not a probability
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            hits.append(f"{type(config).__name__}.{name}={value}")
    return f" (the config sets {', '.join(hits)})" if hits else ""


@dataclass(frozen=True, slots=True)
class RandomModule:
    """A module of the model that draws random numbers in training mode (only)."""

    name: str
    """Its qualified name, for messages (``MixtralForCausalLM.model.layers.0.mlp``)."""
    module: nn.Module


def check_quiet(modules: Iterable[RandomModule], hint: Callable[[], str]) -> None:
    """Refuse a module that draws random numbers in training mode while it is in it."""
    for item in modules:
        if item.module.training:
            raise ConfigError(
                f"{item.name} ({type(item.module).__name__}): its forward draws random "
                f"numbers in training mode (dropout, router jitter or sampling){hint()}, "
                "which the schedule cannot reproduce (it runs the model's modules in another "
                "order than the model's forward); expected it in eval mode, received "
                "training mode: call .eval() on it (or the model), or set the probability "
                "to 0"
            )


def random_modules(prefix: str, root: nn.Module, names: Iterable[str]) -> list[RandomModule]:
    """``root``'s submodules called ``names``, named ``prefix.name`` for messages."""
    return [RandomModule(f"{prefix}.{n}" if n else prefix, root.get_submodule(n)) for n in names]


def random_of(draws: Draws, device: torch.device, config: object) -> list[str]:
    """The modules that drew whose output depends on the draws (all that drew, when
    the config sets a non-zero dropout or jitter probability)."""
    if not draws.names:
        return []
    if config_hint(config):
        return list(draws.names)
    return [n for n in draws.names if draws_matter(draws, n, device)]


def refuse_eval_draws(found: Sequence[RandomModule], config: object) -> None:
    """Refuse a module that drew random numbers in eval mode (``found``: those that did)."""
    if found:
        item = found[0]
        raise ConfigError(
            f"{item.name} ({type(item.module).__name__}): its forward draws random "
            "numbers in eval mode too (sampled "
            "routing, noise not tied to training mode), which the schedule cannot "
            "reproduce; expected a forward that draws none, at least in eval mode, "
            f"received draws{config_hint(config)}"
        )


def outside_draws(
    model: nn.Module,
    base: nn.Module,
    layers: Sequence[nn.Module],
    ids: Tensor,
    *,
    accepts_router_flag: bool,
) -> list[RandomModule]:
    """The modules outside the decoder layers whose forward draws random numbers that
    change its output in training mode (embedding dropout, ...): found on a probe of
    the model's own forward with the layers stood in for, those modules put in training
    mode for it (their flags restored after)."""
    config: object = getattr(model, "config", None)
    inside = {id(m) for layer in layers for m in layer.modules()}
    outside = [m for m in model.modules() if id(m) not in inside]
    device = ids.device
    name = type(model).__name__

    def run(quiet: Sequence[str]) -> list[str]:
        with torch.no_grad(), training_mode(outside):
            for n in quiet:
                model.get_submodule(n).training = False
            with record_draws(model, device, skip=layers) as draws:
                hidden = decoder_input(base, input_ids=ids, position_ids=None)
                causal_lm_output(
                    model,
                    base,
                    hidden,
                    labels=ids,
                    accepts_router_flag=accepts_router_flag,
                )
            return random_of(draws, device, config)

    drawn = run(())
    if not drawn:
        return []
    found = random_modules(name, model, drawn)
    check_quiet(found, partial(config_hint, config))
    refuse_eval_draws(random_modules(name, model, run(drawn)), config)
    return found
