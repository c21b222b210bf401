"""A gradient hook on a weight whose gradient the schedule delays: refused at plan build.

Autograd runs a parameter's gradient hooks (``register_hook``,
``register_post_accumulate_grad_hook``) when a backward pass reaches it. Plain
``loss.backward()`` computes every weight gradient there, so the hooks see it. A layer that
delays its weight gradients (what its ``pre_dispatch_wgrad()`` / ``mlp_wgrad()`` list)
hands autograd none: ``backward_dw()`` computes it later and accumulates it into ``.grad``
outside autograd. The hooks still run at the backward, a ``register_hook`` hook with
``None`` and a post-accumulate-grad hook before ``.grad`` holds the microbatch's part, and
never after it: an optimizer stepped in such a hook, or a gradient clipped, reduced or
copied there, would be silently wrong. So a trainable parameter of a listed module with
such a hook is a :class:`~moe_overlap.WgradError` when a plan is built, before it runs.

The parameters are collected once per model and set of listed modules (again after any
module or parameter is registered in the process); each plan then reads two attributes per
parameter, so a hook added between steps is found at the next plan.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from typing import cast

from torch import nn

from moe_overlap.errors import WgradError

from ._registrations import registrations
from ._shared_params import is_count_hook
from ._torch_wrappers import grad_hooks, hook_name

__all__ = ["check_wgrad_hooks"]

_Key = tuple[tuple[int, ...], int]


class _Listed:
    """The parameters of a model's listed modules, for one set of them (``key``)."""

    __slots__ = ("key", "params")

    def __init__(self, key: _Key, params: tuple[nn.Parameter, ...]) -> None:
        self.key = key
        self.params = params


_LISTED: weakref.WeakKeyDictionary[object, _Listed] = weakref.WeakKeyDictionary()


def check_wgrad_hooks(model: object, parts: Sequence[Sequence[object]]) -> None:
    """Refuse a gradient hook of the user's on a trainable parameter of the modules the
    layers list for delayed weight gradients (``parts[i]``: layer ``i``'s)."""
    listed = [part for layer_parts in parts for part in layer_parts]
    if not listed:
        return
    key: _Key = (tuple(map(id, listed)), registrations())
    entry: _Listed | None = None
    with contextlib.suppress(TypeError):  # not weakref-able or not hashable: walked every time
        entry = _LISTED.get(model)
    if entry is None or entry.key != key:
        entry = _Listed(key, _parameters(listed))
        with contextlib.suppress(TypeError):
            _LISTED[model] = entry
    for p in entry.params:
        if p.requires_grad:
            hooks = [h for h in grad_hooks(p) if not is_count_hook(h)]
            if hooks:
                _refuse(model, p, hooks)


def _parameters(listed: Sequence[object]) -> tuple[nn.Parameter, ...]:
    seen: dict[int, nn.Parameter] = {}
    for part in listed:
        params: object = getattr(part, "parameters", None)
        if callable(params):
            for p in cast("Iterator[nn.Parameter]", params()):
                seen.setdefault(id(p), p)
    return tuple(seen.values())


def _refuse(model: object, param: nn.Parameter, hooks: list[object]) -> None:
    name = "a parameter"
    if isinstance(model, nn.Module):
        found = (n for n, p in model.named_parameters(remove_duplicate=False) if p is param)
        name = next(found, name)
    names = ", ".join(hook_name(h) for h in hooks)
    plural = "s" if len(hooks) > 1 else ""
    raise WgradError(
        f"{type(model).__name__}: {name}: expected no gradient hook on a weight whose "
        "gradient the schedule delays (its layer lists its module in pre_dispatch_wgrad() / "
        f"mlp_wgrad()), received {len(hooks)} hook{plural} ({names}) registered with "
        "register_hook or register_post_accumulate_grad_hook: autograd runs them when the "
        "backward reaches the weight, before backward_dw() computes its gradient (a "
        "register_hook hook gets None, a post-accumulate-grad hook sees .grad without this "
        "microbatch's part), and not after, where plain loss.backward() runs them with the "
        "gradient. Build the model without delayed weight gradients "
        "(delay_wgrad_compute=False), or remove the hook and do its work after the step"
    )
