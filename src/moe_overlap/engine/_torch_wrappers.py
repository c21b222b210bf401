# pyright: reportPrivateUsage=false
# This module is where moe_overlap reads torch's private names for wrapped modules.
"""What torch has put on or around a module: wrappers, compilation, hooks.

The schedule calls the modules inside a layer, never some modules' own ``forward`` (the
model's, the decoder's, a layer's); whatever torch attaches to that ``forward`` is skipped.
This module only finds such things; ``_bypass_check`` decides and words the refusals.

Private torch names read, all here (tested with torch 2.11 and 2.13):

- ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper.ActivationWrapper``, the
  base of ``CheckpointWrapper`` and ``OffloadWrapper`` (``checkpoint_wrapper``,
  ``offload_wrapper``, ``apply_activation_checkpointing``), and its
  ``_checkpoint_wrapped_module``;
- ``torch._dynamo.eval_frame.OptimizedModule`` (``torch.compile(module)``) and its
  ``_orig_mod``;
- ``nn.Module._compiled_call_impl`` (``module.compile()``, in place);
- ``nn.Module._forward_pre_hooks``, ``_forward_hooks`` (the ``with_kwargs``, ``prepend``
  and ``always_call`` variants are entries of these two), ``_backward_pre_hooks`` and
  ``_backward_hooks`` (full and non-full backward hooks), read from the instance dict;
- ``torch.distributed._composable.contract.REGISTRY_KEY``: the composable APIs applied to a
  module (``checkpoint``, ``replicate``, ``fully_shard``);
- ``Tensor._backward_hooks`` and ``Tensor._post_accumulate_grad_hooks`` (``register_hook``
  and ``register_post_accumulate_grad_hook`` on a parameter), for debug mode's first-step
  check (:func:`has_grad_hooks`).

Public names used: ``torch.nn.parallel.DistributedDataParallel`` and ``DataParallel``
(their ``module``). A class is looked up only when its module is already imported: an
instance cannot exist otherwise, and nothing is imported here.
"""

from __future__ import annotations

import enum
import sys
from dataclasses import dataclass
from typing import cast

from torch import Tensor, nn

__all__ = ["Finding", "Kind", "find_wrapping", "has_grad_hooks", "inner_module"]

_CHECKPOINT_MODULE = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"
_DYNAMO_MODULE = "torch._dynamo.eval_frame"
_COMPOSABLE_MODULE = "torch.distributed._composable.contract"

_HOOK_DICTS = (
    ("_forward_pre_hooks", "forward pre-hook"),
    ("_forward_hooks", "forward hook"),
    ("_backward_pre_hooks", "backward pre-hook"),
    ("_backward_hooks", "backward hook"),
)


class Kind(enum.Enum):
    """What a finding is, by what it would have done."""

    CHECKPOINT = "activation checkpointing"
    COMPILE = "torch.compile"
    DATA_PARALLEL = "data parallelism"
    FORWARD = "a forward set on the instance"
    HOOKS = "module hooks"


_COMPOSABLE = {
    "checkpoint": (Kind.CHECKPOINT, "torch.distributed._composable.checkpoint"),
    "replicate": (Kind.DATA_PARALLEL, "torch.distributed._composable.replicate"),
}
"""Composable APIs by registry name (``fully_shard`` makes an ``FSDPModule``: see ``_fsdp_check``)."""


@dataclass(frozen=True, slots=True)
class Finding:
    """One thing torch put on or around a module: its kind, in words, and whether it is a
    wrapper object standing in the module's place (rather than something on the module)."""

    kind: Kind
    what: str
    wrapper: bool = False


def _class(module_name: str, name: str) -> type | None:
    module = sys.modules.get(module_name)
    found: object = getattr(module, name, None) if module is not None else None
    return found if isinstance(found, type) else None


def inner_module(obj: object) -> object | None:
    """The module a torch wrapper object wraps, or ``None`` when ``obj`` is no such wrapper."""
    if not isinstance(obj, nn.Module):
        return None
    found = _wrapper_class(obj)
    if found is None:
        return None
    attr = found[1]
    attrs = obj.__dict__
    modules = cast("dict[str, object]", attrs.get("_modules", {}))
    inner = modules.get(attr)
    return inner if inner is not None else cast("object | None", attrs.get(attr))


def _wrapper_class(obj: nn.Module) -> tuple[Kind, str] | None:
    """``(kind, attribute of the wrapped module)`` when ``obj`` is a torch wrapper object."""
    activation = _class(_CHECKPOINT_MODULE, "ActivationWrapper")
    if activation is not None and isinstance(obj, activation):
        return Kind.CHECKPOINT, "_checkpoint_wrapped_module"
    optimized = _class(_DYNAMO_MODULE, "OptimizedModule")
    if optimized is not None and isinstance(obj, optimized):
        return Kind.COMPILE, "_orig_mod"
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
    for attr, noun in _HOOK_DICTS:
        if not pre_hooks and attr == "_forward_pre_hooks":
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
    contract = sys.modules.get(_COMPOSABLE_MODULE)
    key: object = getattr(contract, "REGISTRY_KEY", None) if contract is not None else None
    registry: object = attrs.get(key) if isinstance(key, str) else None
    if isinstance(registry, dict):
        for api in cast("dict[str, object]", registry):
            if api in _COMPOSABLE:
                kind, name = _COMPOSABLE[api]
                return Finding(kind, f"{name}({cls}) applied to it")
    if attrs.get("_compiled_call_impl") is not None:
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
    return any(bool(getattr(t, name, None)) for name in _GRAD_HOOKS)


_GRAD_HOOKS = ("_backward_hooks", "_post_accumulate_grad_hooks")
