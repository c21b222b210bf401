"""torchtitan's activation checkpointing of whole blocks, run per slot.

torchtitan's ``SelectiveAC`` and ``FullAC`` (``torchtitan.distributed.activation_checkpoint``)
put each block of ``model.layers`` inside torch's ``CheckpointWrapper``: its ``forward``
runs the block under non-reentrant ``torch.utils.checkpoint.checkpoint`` with the settings
bound in its ``checkpoint_fn`` (``functools.partial``): ``context_fn`` (SelectiveAC: a
fresh per-op policy for each call), ``preserve_rng_state``, ``determinism_check``,
``debug``. The schedule never calls the wrapper, so the adapter builds on the block inside
it and runs, with those settings, each region of the block that computes, as its own
checkpoint (:meth:`TitanCheckpoint.run`):

- a MoE block's pre-dispatch region (attention, norms, router, the load-balancing count,
  shared experts) and its routed experts (mlp); the token exchange (dispatch, combine)
  is stored, not recomputed: it is communication under expert parallelism;
- a dense block whole.

Each region calls ``context_fn`` once (``checkpoint`` does), so a stateful policy such as
SelectiveAC's "every other matrix product" starts counting again in each region: the same
values, a slightly different set of saved tensors than the whole-block checkpoint. Every
region is recomputed in full in backward (``early_stop=False``, as torchtitan sets it):
the MoE's ``tokens_per_expert_E`` is then counted exactly twice per forward, as with
torchtitan's own wrapper, which its load-balancing hook halves for a wrapped block
(the wrapper stays in the model, so the hook sees it).

Anything else around a block is refused: another ``ActivationWrapper`` class (offload, a
subclass), a reentrant checkpoint, a ``checkpoint_fn`` that is not torch's checkpoint or
binds other arguments, and settings changed after the adapter was built.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TypeVar, cast

import torch
import torch.utils.checkpoint as _checkpoint
from torch import nn

from moe_overlap import ConfigError
from moe_overlap.adapters._torch_private import checkpoint_wrapped, checkpoint_wrapper_class
from moe_overlap.engine import Bypass, BypassedModule, hold_for_recompute

__all__ = ["TitanCheckpoint", "unwrap_blocks"]

_T = TypeVar("_T")

_SETTINGS = frozenset(
    {
        "use_reentrant",
        "context_fn",
        "preserve_rng_state",
        "determinism_check",
        "debug",
        "early_stop",
    }
)
"""What a ``CheckpointWrapper``'s ``checkpoint_fn`` may bind (``early_stop`` is overridden)."""

_WRAPPER = (
    "the adapter runs the block inside it, each of the block's slots recomputed with the "
    "wrapper's own checkpoint settings"
)
_DO = (
    "apply torchtitan's SelectiveAC or FullAC (a non-reentrant torch CheckpointWrapper), or "
    "none, before building the adapter"
)


@dataclass(frozen=True, slots=True)
class TitanCheckpoint:
    """A block's ``CheckpointWrapper`` and the settings its slots are recomputed with."""

    wrapper: nn.Module
    checkpoint_fn: object
    """The wrapper's ``checkpoint_fn`` when the adapter was built (a change is refused)."""
    settings: Mapping[str, object]
    """``checkpoint``'s keyword arguments: the wrapper's, ``early_stop=False``."""

    def run(self, fn: Callable[..., _T], *args: object) -> _T:
        """``fn(*args)`` as one checkpointed region (a plain call without autograd);
        tensor arguments recorded for :func:`~moe_overlap.engine.hold_for_recompute`."""
        if not torch.is_grad_enabled():
            return fn(*args)
        hold_for_recompute(args)
        run = cast("Callable[..., object]", _checkpoint.checkpoint)  # pyright: ignore[reportUnknownMemberType]
        return cast(_T, run(fn, *args, **self.settings))

    def bypassed(self, where: str) -> Iterator[BypassedModule]:
        """The wrapper for the bypass check, after checking its settings are still the
        ones the slots run with."""
        current: object = getattr(self.wrapper, "checkpoint_fn", None)
        if current is not self.checkpoint_fn:
            raise ConfigError(
                f"{where} (CheckpointWrapper): expected the checkpoint_fn the adapter was built "
                f"with, received another ({_describe(current)}); the slots recompute with the "
                "settings read at construction: rebuild the adapter after changing them"
            )
        yield BypassedModule(where, self.wrapper, Bypass.FORWARD, _WRAPPER, self.wrapper)


def _describe(fn: object) -> str:
    part = _as_partial(fn)
    if part is not None:
        name = getattr(part.func, "__qualname__", type(part.func).__name__)
        return f"partial({getattr(part.func, '__module__', '?')}.{name}, {part.keywords})"
    return type(fn).__name__


def _as_partial(fn: object) -> functools.partial[object] | None:
    return cast("functools.partial[object]", fn) if isinstance(fn, functools.partial) else None


def _settings(wrapper: nn.Module, where: str) -> tuple[object, dict[str, object]]:
    """The wrapper's ``checkpoint_fn`` and its keywords, refused unless it is non-reentrant
    ``torch.utils.checkpoint.checkpoint`` with only checkpoint settings bound."""
    impl: object = getattr(wrapper, "checkpoint_impl", None)
    if getattr(impl, "name", None) != "NO_REENTRANT":
        raise ConfigError(
            f"{where} (CheckpointWrapper): expected non-reentrant checkpointing "
            f"(CheckpointImpl.NO_REENTRANT, as torchtitan applies it), received {impl}; the "
            f"slots recompute with non-reentrant torch.utils.checkpoint only; {_DO}"
        )
    fn: object = getattr(wrapper, "checkpoint_fn", None)
    part = _as_partial(fn)
    torch_checkpoint = cast("object", _checkpoint.checkpoint)  # pyright: ignore[reportUnknownMemberType]
    if part is None or part.func is not torch_checkpoint or part.args:
        raise ConfigError(
            f"{where} (CheckpointWrapper): expected its checkpoint_fn to be "
            f"torch.utils.checkpoint.checkpoint with keyword settings only, received "
            f"{_describe(fn)}; the slots cannot run another checkpoint function; {_DO}"
        )
    keywords = dict(part.keywords)
    unknown = sorted(set(keywords) - _SETTINGS)
    if unknown or keywords.get("use_reentrant") is not False:
        got = (
            f"the arguments {unknown}"
            if unknown
            else f"use_reentrant={keywords.get('use_reentrant')!r}"
        )
        raise ConfigError(
            f"{where} (CheckpointWrapper): expected checkpoint settings among "
            f"{sorted(_SETTINGS)} with use_reentrant=False, received {got}; {_DO}"
        )
    keywords["early_stop"] = False
    return fn, keywords


def _unwrap(block: nn.Module, where: str) -> tuple[nn.Module, TitanCheckpoint | None]:
    activation = checkpoint_wrapper_class("ActivationWrapper")
    if activation is None or not isinstance(block, activation):
        return block, None
    if type(block) is not checkpoint_wrapper_class("CheckpointWrapper"):
        raise ConfigError(
            f"{where}: expected the block itself or torch's CheckpointWrapper around it (what "
            f"torchtitan's SelectiveAC and FullAC put), received {type(block).__name__}; the "
            f"schedule never calls it, so what it does would never run; {_DO}"
        )
    inner = checkpoint_wrapped(block)
    if inner is None:
        raise ConfigError(
            f"{where} (CheckpointWrapper): expected the wrapped block as its "
            "_checkpoint_wrapped_module, received none"
        )
    fn, settings = _settings(block, where)
    return inner, TitanCheckpoint(block, fn, settings)


def unwrap_blocks(
    blocks: list[tuple[str, nn.Module]], owner: str
) -> tuple[list[tuple[str, nn.Module]], dict[str, TitanCheckpoint]]:
    """The blocks the adapter builds on (inside torchtitan's checkpoint wrappers) and the
    wrappers by block name; ``owner`` names the model in messages."""
    inner: list[tuple[str, nn.Module]] = []
    wrapped: dict[str, TitanCheckpoint] = {}
    for name, block in blocks:
        b, checkpoint = _unwrap(block, f"{owner}.layers.{name}")
        inner.append((name, b))
        if checkpoint is not None:
            wrapped[name] = checkpoint
    return inner, wrapped
