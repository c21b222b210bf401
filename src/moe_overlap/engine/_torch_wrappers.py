"""What torch has put on or around a module: wrappers, compilation, hooks.

The schedule calls the modules inside a layer, never some modules' own ``forward`` (the
model's, the decoder's, a layer's); whatever torch attaches to that ``forward`` is skipped.
This module only finds such things; ``_bypass_check`` decides and words the refusals.

What it reads of torch's that is private (checkpoint and offload wrappers and the module
they wrap, ``torch.compile``'s wrapper and its module, ``module.compile()`` in place, a
module's hook dicts, the composable APIs' registry, a parameter's gradient hooks) comes
from ``_torch_private``, with the releases each was checked on. Public names used:
``torch.nn.parallel.DistributedDataParallel`` and ``DataParallel`` (their ``module``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import cast

from torch import Tensor, nn

from ._torch_private import (
    CHECKPOINT_WRAPPED,
    COMPILED_CALL,
    COMPILED_ORIGINAL,
    COMPOSABLE_APIS,
    FORWARD_PRE_HOOKS,
    GRAD_HOOKS,
    MODULE_CHILDREN,
    MODULE_HOOK_DICTS,
    activation_wrapper_class,
    composable_registry_key,
    optimized_module_class,
)

__all__ = [
    "Finding",
    "Kind",
    "find_wrapping",
    "grad_hooks",
    "has_grad_hooks",
    "hook_name",
    "inner_module",
]


class Kind(enum.Enum):
    """What a finding is, by what it would have done."""

    CHECKPOINT = "activation checkpointing"
    COMPILE = "torch.compile"
    DATA_PARALLEL = "data parallelism"
    FORWARD = "a forward set on the instance"
    HOOKS = "module hooks"


_COMPOSABLE = {
    "checkpoint": (Kind.CHECKPOINT, COMPOSABLE_APIS["checkpoint"]),
    "replicate": (Kind.DATA_PARALLEL, COMPOSABLE_APIS["replicate"]),
}
"""Composable APIs by registry name (``fully_shard`` makes an ``FSDPModule``: see ``_fsdp_check``)."""


@dataclass(frozen=True, slots=True)
class Finding:
    """One thing torch put on or around a module: its kind, in words, and whether it is a
    wrapper object standing in the module's place (rather than something on the module)."""

    kind: Kind
    what: str
    wrapper: bool = False


def inner_module(obj: object) -> object | None:
    """The module a torch wrapper object wraps, or ``None`` when ``obj`` is no such wrapper."""
    if not isinstance(obj, nn.Module):
        return None
    found = _wrapper_class(obj)
    if found is None:
        return None
    attr = found[1]
    attrs = obj.__dict__
    modules = cast("dict[str, object]", attrs.get(MODULE_CHILDREN, {}))
    inner = modules.get(attr)
    return inner if inner is not None else cast("object | None", attrs.get(attr))


def _wrapper_class(obj: nn.Module) -> tuple[Kind, str] | None:
    """``(kind, attribute of the wrapped module)`` when ``obj`` is a torch wrapper object."""
    activation = activation_wrapper_class()
    if activation is not None and isinstance(obj, activation):
        return Kind.CHECKPOINT, CHECKPOINT_WRAPPED
    optimized = optimized_module_class()
    if optimized is not None and isinstance(obj, optimized):
        return Kind.COMPILE, COMPILED_ORIGINAL
    if isinstance(obj, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        return Kind.DATA_PARALLEL, "module"
    return None


def _hook_name(hook: object) -> str:
    name: object = getattr(hook, "__qualname__", None)
    return name if isinstance(name, str) else type(hook).__name__


_INERT_HOOKS = frozenset(
    {
        (
            "transformers.utils.output_capturing",
            "install_output_capuring_hook.<locals>.output_capturing_hook",
        )
    }
)
"""``(module, qualname)`` of hooks that act only inside their model's own ``forward``:
transformers' output capture records a module's output only while the model's forward
collects outputs (``output_router_logits``, ``output_hidden_states``; the forward's first
run with one installs them on every layer), and does nothing otherwise. The schedule runs
that forward only around stand-ins for the decoder layers, so skipping a layer's call
skips nothing such a hook would do."""


def _inert(hook: object) -> bool:
    return (getattr(hook, "__module__", None), getattr(hook, "__qualname__", None)) in _INERT_HOOKS


def _hooks(attrs: dict[str, object], *, pre_hooks: bool) -> str | None:
    parts: list[str] = []
    for attr, noun in MODULE_HOOK_DICTS:
        if not pre_hooks and attr == FORWARD_PRE_HOOKS:
            continue
        hooks: object = attrs.get(attr)
        if not isinstance(hooks, dict) or not hooks:
            continue
        values = [h for h in cast("dict[int, object]", hooks).values() if not _inert(h)]
        if not values:
            continue
        names = ", ".join(_hook_name(h) for h in values)
        plural = "s" if len(values) > 1 else ""
        parts.append(f"{len(values)} {noun}{plural} ({names})")
    return " and ".join(parts) if parts else None


def find_wrapping(
    obj: object, *, pre_hooks: bool = True, honoured: object = None
) -> Finding | None:
    """The first thing found that torch runs only through ``obj``'s own call, or ``None``.

    In this order: a wrapper object (checkpoint, compiled, data-parallel), a composable
    API applied to it, ``compile()`` in place, a ``forward`` set on the instance, module
    hooks (forward pre-hooks only when ``pre_hooks``). Global hooks
    (``register_module_forward_hook``) are not the module's and are not looked at.
    ``honoured``: ``obj`` itself (a wrapper object) or the ``forward`` set on it, which the
    caller runs itself (it checked what it does); skipped, the rest is still looked at.
    """
    if not isinstance(obj, nn.Module):
        return None
    cls = type(obj).__name__
    found = _wrapper_class(obj) if honoured is not obj else None
    if found is not None:
        inner = inner_module(obj)
        around = f" around {type(inner).__name__}" if inner is not None else ""
        article = "an" if cls[:1] in "AEIOU" else "a"
        return Finding(found[0], f"{article} {cls}{around}", wrapper=True)
    attrs = obj.__dict__
    key = composable_registry_key()
    registry: object = attrs.get(key) if key is not None else None
    if isinstance(registry, dict):
        for api in cast("dict[str, object]", registry):
            if api in _COMPOSABLE:
                kind, name = _COMPOSABLE[api]
                return Finding(kind, f"{name}({cls}) applied to it")
    if attrs.get(COMPILED_CALL) is not None:
        return Finding(Kind.COMPILE, f"{cls}.compile() (compiled in place)")
    if "forward" in attrs and (honoured is None or attrs["forward"] is not honoured):
        forward: object = attrs["forward"]
        return Finding(Kind.FORWARD, f"a forward set on the instance ({_hook_name(forward)})")
    hooks = _hooks(attrs, pre_hooks=pre_hooks)
    if hooks is not None:
        return Finding(Kind.HOOKS, hooks)
    return None


def has_grad_hooks(t: Tensor) -> bool:
    """Whether hooks run on ``t``'s gradient (``register_hook``,
    ``register_post_accumulate_grad_hook``)."""
    return any(bool(getattr(t, name, None)) for name in GRAD_HOOKS)


def grad_hooks(t: Tensor) -> list[object]:
    """The hooks that run on ``t``'s gradient (``register_hook``'s, then
    ``register_post_accumulate_grad_hook``'s)."""
    found: list[object] = []
    for name in GRAD_HOOKS:
        hooks: object = getattr(t, name, None)
        if isinstance(hooks, dict) and hooks:
            found += cast("dict[int, object]", hooks).values()
    return found


def hook_name(hook: object) -> str:
    """A hook's name in messages: its qualified name, else its class's."""
    return _hook_name(hook)
