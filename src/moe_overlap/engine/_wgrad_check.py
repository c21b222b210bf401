"""Is every delayed weight gradient computed? Read from the modules that keep count."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import cast

from torch import nn

from ._errors import WgradError

__all__ = ["check_wgrad_done", "declared_wgrad", "owed_wgrad"]


def declared_wgrad(model: object) -> list[tuple[str, object]]:
    """What the model's layers list for delayed wgrad, named, in layer order.

    A model need not register these as submodules (the transformers adapter does not), so
    they are asked for besides ``model.modules()``.
    """
    decoder: object = getattr(model, "decoder", None)
    layers: object = getattr(decoder, "layers", ())
    if not isinstance(layers, (list, tuple, nn.ModuleList)):
        return []
    out: list[tuple[str, object]] = []
    for i, layer in enumerate(cast("Sequence[object]", layers)):
        pre: object = getattr(layer, "pre_dispatch_wgrad", None)
        mlp: object = getattr(layer, "mlp_wgrad", None)
        if callable(pre):
            for j, part in enumerate(cast("Sequence[object]", pre())):
                name = f"decoder.layers[{i}].pre_dispatch_wgrad()[{j}]"
                out.append((name, getattr(part, "module", None)))
        if callable(mlp):
            for j, module in enumerate(cast("Sequence[object]", mlp())):
                out.append((f"decoder.layers[{i}].mlp_wgrad()[{j}]", module))
    return out


def _candidates(model: object, declared: Sequence[tuple[str, object]]) -> Iterator[object]:
    """Every module of ``model`` and of ``declared``, each once."""
    seen: set[int] = set()
    parts = [part for _, part in declared]
    roots = [model, *parts] if isinstance(model, nn.Module) else parts
    for root in roots:
        found = root.modules() if isinstance(root, nn.Module) else (root,)
        for module in found:
            if id(module) not in seen:
                seen.add(id(module))
                yield module


def _count(module: object) -> int:
    attrs: dict[str, object] = getattr(module, "__dict__", {})
    # On the class or in the instance dict: never through nn.Module.__getattr__ (slow).
    if not (hasattr(type(module), "pending_wgrad") or "pending_wgrad" in attrs):
        return 0
    count: object = getattr(module, "pending_wgrad", None)
    return count if type(count) is int else 0


def owed_wgrad(
    model: object, declared: Sequence[tuple[str, object]] | None = None
) -> dict[str, int]:
    """``{"name (class)": count}`` of the modules of ``model`` whose ``pending_wgrad`` is > 0.

    Asks every module of ``model`` and every part its layers list
    (:func:`declared_wgrad`, or ``declared`` when given) that has an int
    ``pending_wgrad`` (a :class:`~moe_overlap.PendingWgrad`). Names are the module's
    ``label`` when it has one, else its path in ``model``; found only on a hit.
    """
    parts = declared_wgrad(model) if declared is None else declared
    owing = [(m, n) for m in _candidates(model, parts) if (n := _count(m)) > 0]
    if not owing:
        return {}
    named = (
        cast("list[tuple[str, nn.Module]]", list(model.named_modules()))  # pyright: ignore[reportUnknownArgumentType] - torch's generator type
        if isinstance(model, nn.Module)
        else []
    )
    paths = {id(m): name for name, m in named}
    listed = {id(part): name for name, part in parts}
    owed: dict[str, int] = {}
    for module, count in owing:
        attrs: dict[str, object] = getattr(module, "__dict__", {})
        label = attrs.get("label")
        if isinstance(label, str):
            where = label
        elif id(module) in paths:
            where = paths[id(module)] or "(model)"
        else:
            where = listed.get(id(module), "a module inside a listed wgrad part")
        owed[f"{where} ({type(module).__name__})"] = count
    return owed


def check_wgrad_done(
    model: object, *, when: str = "now", declared: Sequence[tuple[str, object]] | None = None
) -> None:
    """Raise :class:`~moe_overlap.WgradError` if a module of ``model`` still owes a weight gradient.

    :func:`~moe_overlap.combined_1f1b` calls it before and after every step; call it
    yourself after driving :meth:`~moe_overlap.ModelChunkSchedulePlan.run` directly.
    """
    owed = owed_wgrad(model, declared)
    if not owed:
        return
    raise WgradError(
        f"{type(model).__name__}: expected every delayed weight gradient computed {when}, "
        f"received modules still owing some: {owed}. A module that delays its weight "
        "gradient must be listed by its layer's pre_dispatch_wgrad() / mlp_wgrad() so the "
        "schedule runs its backward_dw(); after a failed step, zero the grads and drop what "
        "is pending (discard_wgrad) first"
    )
