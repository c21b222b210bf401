"""Is every delayed weight gradient computed? Read from the modules that keep count."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import cast

from torch import nn

from ._errors import WgradError

__all__ = ["check_wgrad_done", "owed_wgrad"]


def _modules(model: object) -> Iterator[tuple[str, object]]:
    """The model's modules, then those its layers list for delayed wgrad (which a model
    need not register as submodules), each once."""
    seen: set[int] = set()
    if isinstance(model, nn.Module):
        for name, module in model.named_modules():
            seen.add(id(module))
            yield name, module
    decoder: object = getattr(model, "decoder", None)
    layers: object = getattr(decoder, "layers", ())
    if not isinstance(layers, (list, tuple, nn.ModuleList)):
        return
    for i, layer in enumerate(cast("Sequence[object]", layers)):
        for j, part in enumerate(_declared(layer)):
            prefix = f"decoder.layers.{i}.wgrad.{j}"
            found = part.named_modules(prefix=prefix) if isinstance(part, nn.Module) else (
                [(prefix, part)]
            )
            for name, module in found:
                if id(module) not in seen:
                    seen.add(id(module))
                    yield name, module


def _declared(layer: object) -> list[object]:
    """What ``layer`` lists for delayed wgrad (nothing when it lists nothing valid)."""
    pre: object = getattr(layer, "pre_dispatch_wgrad", None)
    mlp: object = getattr(layer, "mlp_wgrad", None)
    out: list[object] = []
    if callable(pre):
        out += [getattr(part, "module", None) for part in cast("Sequence[object]", pre())]
    if callable(mlp):
        out += list(cast("Sequence[object]", mlp()))
    return out


def owed_wgrad(model: object) -> dict[str, int]:
    """``{"path (class)": count}`` of the modules of ``model`` whose ``pending_wgrad`` is > 0.

    Only modules with an int ``pending_wgrad`` (a :class:`~moe_overlap.PendingWgrad`)
    are asked; the attribute is looked up on the class or the instance's ``__dict__``,
    never through ``nn.Module.__getattr__`` (cheap enough to run every step). A module's
    string ``label``, when it has one, names it instead of its path.
    """
    owed: dict[str, int] = {}
    for name, module in _modules(model):
        attrs: dict[str, object] = getattr(module, "__dict__", {})
        if not (hasattr(type(module), "pending_wgrad") or "pending_wgrad" in attrs):
            continue
        count: object = getattr(module, "pending_wgrad", None)
        if isinstance(count, int) and not isinstance(count, bool) and count > 0:
            label = attrs.get("label")  # the reference blocks' qualified name
            where = label if isinstance(label, str) else name or "(model)"
            owed[f"{where} ({type(module).__name__})"] = count
    return owed


def check_wgrad_done(model: object, *, when: str = "now") -> None:
    """Raise :class:`~moe_overlap.WgradError` if a module of ``model`` still owes a weight gradient.

    :func:`~moe_overlap.combined_1f1b` calls it before and after every step; call it
    yourself after driving :meth:`~moe_overlap.ModelChunkSchedulePlan.run` directly.
    """
    owed = owed_wgrad(model)
    if not owed:
        return
    raise WgradError(
        f"{type(model).__name__}: expected every delayed weight gradient computed {when}, "
        f"received modules still owing some: {owed}. A module that delays its weight "
        "gradient must be listed by its layer's pre_dispatch_wgrad() / mlp_wgrad() so the "
        "schedule runs its backward_dw(); after a failed step, zero the grads and drop what "
        "is pending (discard_wgrad) first"
    )
