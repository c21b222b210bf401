"""Is every delayed weight gradient computed? Read from the modules that keep count."""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import NoReturn, cast

from torch import nn

from moe_overlap.args import refuse
from moe_overlap.errors import IntegrationError, WgradError

from ._registrations import registrations
from .contracts import MODEL, PENDING_WGRAD
from .core._wgrad_claims import wgrad_claimed

__all__ = [
    "check_wgrad_done",
    "check_wgrad_listed",
    "declared_wgrad",
    "node_schedule_running",
    "owed_wgrad",
    "pending_count",
    "wgrad_namer",
]


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


_BAD = -1  # pending_count's answer for a pending_wgrad that is not an int >= 0
_COUNT = PENDING_WGRAD.member("pending_wgrad")


def pending_count(module: object) -> int | None:
    """``module.pending_wgrad`` (a :class:`~moe_overlap.PendingWgrad`), ``None`` without one.

    Returns ``-1`` for a ``pending_wgrad`` that is not an ``int >= 0`` (a method, a
    ``None``, a bool): the caller raises, naming the module.
    """
    attrs: dict[str, object] = getattr(module, "__dict__", {})
    # On the class or in the instance dict: never through nn.Module.__getattr__ (slow).
    if not (hasattr(type(module), "pending_wgrad") or "pending_wgrad" in attrs):
        return None
    count: object = getattr(module, "pending_wgrad", None)
    return cast(int, count) if _COUNT.accepts(count) else _BAD  # bool is not an int here


def wgrad_namer(
    model: object, declared: Sequence[tuple[str, object]] = ()
) -> Callable[[object], str]:
    """``name(module)``: ``"path (Class)"`` for error messages (built on an error only).

    The path is the module's ``label`` when the model set one (a string other than its
    class name, the default of :class:`~moe_overlap.blocks.DelayedWgradModule`), else its
    path in ``model`` (``decoder.layers.0.attn``), else the name of the layer's list that
    holds it (``decoder.layers[0].mlp_wgrad()[0]``).
    """
    named = (
        cast("list[tuple[str, nn.Module]]", list(model.named_modules()))  # pyright: ignore[reportUnknownArgumentType] - torch's generator type
        if isinstance(model, nn.Module)
        else []
    )
    paths = {id(m): name for name, m in named}
    listed = {id(part): name for name, part in declared}

    def name(module: object) -> str:
        cls = type(module).__name__
        label: object = getattr(module, "label", None)
        if isinstance(label, str) and label and label != cls:
            where = label
        elif id(module) in paths:
            where = paths[id(module)] or "(model)"
        else:
            where = listed.get(id(module), "a module inside a listed wgrad part")
        return f"{where} ({cls})"

    return name


def owed_wgrad(
    model: object, declared: Sequence[tuple[str, object]] | None = None
) -> dict[str, int]:
    """``{"path (Class)": count}`` of the modules of ``model`` whose ``pending_wgrad`` is > 0.

    Asks every module of ``model`` and every part its layers list
    (:func:`declared_wgrad`, or ``declared`` when given) that has a ``pending_wgrad`` (a
    :class:`~moe_overlap.PendingWgrad`: a read-only ``int`` property). Names are as
    :func:`wgrad_namer` gives them, found only on a hit; a module whose count is the sum
    of modules named below it (the model's own total) is left out when they are listed.

    Raises :class:`~moe_overlap.IntegrationError` naming a module whose ``pending_wgrad``
    is not an ``int >= 0`` (e.g. a method: its count would otherwise be ignored), or for a
    ``model`` that is neither an ``nn.Module`` nor a :class:`~moe_overlap.PreprocessableModel`.
    """
    _check_model(model)
    parts = declared_wgrad(model) if declared is None else declared
    return _named(model, parts, _owing(model, parts))


def _owing(model: object, parts: Sequence[tuple[str, object]]) -> list[tuple[object, int]]:
    owing: list[tuple[object, int]] = []
    for module in _candidates(model, parts):
        count = pending_count(module)
        if count is None or count == 0:
            continue
        if count == _BAD:
            _bad_count(module, wgrad_namer(model, parts))
        owing.append((module, count))
    return owing


def _named(
    model: object, parts: Sequence[tuple[str, object]], owing: list[tuple[object, int]]
) -> dict[str, int]:
    if not owing:
        return {}
    name = wgrad_namer(model, parts)
    named = [(name(module), count) for module, count in owing]
    paths = [n.rsplit(" (", 1)[0] for n, _ in named]

    def aggregate(path: str) -> bool:  # a total of owing modules listed below it
        prefix = "" if path == "(model)" else path + "."
        return any(other != path and other.startswith(prefix) for other in paths)

    return {n: count for (n, count), path in zip(named, paths, strict=True) if not aggregate(path)}


_IN_NODE_SCHEDULE = [0]
"""How many node schedules (``combined_1f1b(schedule=...)``) are running in this process."""


@contextlib.contextmanager
def node_schedule_running() -> Generator[None]:
    """While a node schedule runs, a weight gradient a live plan's claim covers may be owed
    when another microbatch starts (its ``W`` step comes later, before that slot's next
    backward): :func:`check_wgrad_done` accepts those and still refuses any other."""
    _IN_NODE_SCHEDULE[0] += 1
    try:
        yield
    finally:
        _IN_NODE_SCHEDULE[0] -= 1


def _unclaimed(owing: list[tuple[object, int]]) -> list[tuple[object, int]]:
    """``owing`` without the modules a live claim names, and without totals (a module
    holding owing modules) all of whose owing members are claimed."""
    claimed = [m for m, _ in owing if wgrad_claimed(m)]
    out: list[tuple[object, int]] = []
    for module, count in owing:
        if wgrad_claimed(module):
            continue
        if isinstance(module, nn.Module):
            inner = [m for m, _ in owing if m is not module and _holds(module, m)]
            if inner and all(m in claimed for m in inner):
                continue
        out.append((module, count))
    return out


def _holds(outer: nn.Module, inner: object) -> bool:
    return any(m is inner for m in outer.modules())


def _check_model(model: object) -> None:
    """``model`` is something whose modules can owe weight gradients."""
    if not isinstance(model, nn.Module) and not MODEL.conforms(model):
        raise refuse(
            "owed_wgrad: model",
            "an nn.Module or a PreprocessableModel",
            model,
            error=IntegrationError,
        )


def _bad_count(module: object, name: Callable[[object], str]) -> NoReturn:
    count: object = getattr(module, "pending_wgrad", None)
    if callable(count):
        got = f"a {type(count).__name__} (pending_wgrad is a method)"
    elif isinstance(count, (bool, int, float, str)) or count is None:
        got = f"{type(count).__name__} {count!r}"
    else:
        got = type(count).__name__
    raise IntegrationError(
        f"{name(module)}.pending_wgrad: expected {_COUNT.expects} (PendingWgrad: a read-only "
        f"property counting the weight gradients it still owes), received {got}; the "
        f"schedule reads it before and after every step, so {_COUNT.hint}, or rename the "
        "member"
    )


def check_wgrad_done(
    model: object, *, when: str = "now", declared: Sequence[tuple[str, object]] | None = None
) -> None:
    """Raise :class:`~moe_overlap.WgradError` if a module of ``model`` still owes a weight gradient.

    :func:`~moe_overlap.combined_1f1b` calls it before and after every step, the reference
    model at every forward; call it yourself before ``optimizer.step()`` after a plain
    ``backward()`` of a delayed model or after driving
    :meth:`~moe_overlap.ModelChunkSchedulePlan.run` directly.
    """
    if _IN_NODE_SCHEDULE[0]:  # W steps may still be owed by live plans (see above)
        _check_model(model)
        parts = declared_wgrad(model) if declared is None else declared
        owed = _named(model, parts, _unclaimed(_owing(model, parts)))
    else:
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


# --- at plan build: every module that may delay is listed or counted -------------------------


def _has_backward_dw(module: nn.Module) -> bool:
    """A :class:`~moe_overlap.WgradLayer` by its method (looked up without ``__getattr__``)."""
    return callable(getattr(type(module), "backward_dw", None)) or callable(
        module.__dict__.get("backward_dw")
    )


class _Covered:
    """A model whose delayed-wgrad coverage was checked: for which layers and lists, and
    the uncovered parameters that were frozen then (a later unfreeze checks again)."""

    __slots__ = ("frozen", "key")

    def __init__(self, key: tuple[object, ...], frozen: tuple[nn.Parameter, ...]) -> None:
        self.key = key
        self.frozen = frozen


_COVERED: weakref.WeakKeyDictionary[object, _Covered] = weakref.WeakKeyDictionary()


def check_wgrad_listed(
    model: object, layers: Sequence[object], parts: Sequence[Sequence[object]]
) -> None:
    """Every module that may delay its weight gradient is listed by its layer, or counts.

    ``parts[i]`` are the modules layer ``i`` lists (``pre_dispatch_wgrad()``'s, then
    ``mlp_wgrad()``'s). In a layer that delays (lists something), and, when any layer
    delays, among the model's modules outside its layers, every ``nn.Module`` with a
    ``backward_dw`` (a :class:`~moe_overlap.WgradLayer`) that holds trainable parameters
    and none of whose submodules has one must either hold only parameters of the listed
    modules (their ``parameters()``) or be a :class:`~moe_overlap.PendingWgrad` (its count
    is checked after the step). Otherwise its weight gradient could be delayed with
    nothing to compute it and nothing to notice: :class:`~moe_overlap.WgradError` naming
    its path, at plan build. A module two layers list (parameters in both lists) is a
    ``WgradError`` too: whichever layer's ``backward_dw()`` ran first would compute both
    layers' parts, added to ``.grad`` apart from the rest of the microbatch's.

    Costs one walk of the modules per model and set of listed modules (then a tuple
    compare per plan); a module added to a layer after the first plan is seen once the
    lists or the layers change.
    """
    if not any(parts):
        return
    for listed in parts:
        for part in listed:
            for module in _delayables(part):
                if getattr(module, "delay_wgrad", True) is False:
                    _undelayed(model, parts, part, module)
    key = (tuple(map(id, layers)), tuple(tuple(map(id, p)) for p in parts))
    try:
        entry = _COVERED.get(model)
    except TypeError:  # not weakref-able or not hashable: checked every time
        entry = None
    if entry is not None and entry.key == key and not any(p.requires_grad for p in entry.frozen):
        return
    frozen = _scan(model, layers, parts)
    with contextlib.suppress(TypeError):
        _COVERED[model] = _Covered(key, frozen)


_DELAYABLES: weakref.WeakKeyDictionary[nn.Module, tuple[int, tuple[nn.Module, ...]]] = (
    weakref.WeakKeyDictionary()
)
"""Per listed module: :func:`registrations` then, and its modules with a ``delay_wgrad``."""


def _delayables(part: object) -> tuple[nn.Module, ...]:
    """The modules of a listed module (itself included) with a bool ``delay_wgrad`` (the
    library's delayable linears), looked up again only after a module or parameter was
    registered in the process."""
    if not isinstance(part, nn.Module):
        return ()
    now = registrations()
    found = _DELAYABLES.get(part)
    if found is not None and found[0] == now:
        return found[1]
    mods = tuple(m for m in part.modules() if isinstance(getattr(m, "delay_wgrad", None), bool))
    _DELAYABLES[part] = (now, mods)
    return mods


def _undelayed(
    model: object, parts: Sequence[Sequence[object]], part: object, module: object
) -> NoReturn:
    """A delayable linear in a module a layer lists for ``backward_dw()``, whose
    ``delay_wgrad`` is off (set after it was built): its backward computes the weight
    gradient at once, and the layer's ``backward_dw()`` would refuse it mid-step."""
    index = next(i for i, listed in enumerate(parts) if any(p is part for p in listed))
    name = wgrad_namer(model, declared_wgrad(model))(module)
    raise WgradError(
        f"{name}: expected delay_wgrad=True of a module decoder.layers[{index}] lists for "
        "backward_dw() (pre_dispatch_wgrad() / mlp_wgrad()), received delay_wgrad=False "
        "(set after the layer was built?): its backward would compute the weight gradient "
        "at once and the layer's backward_dw() would refuse it mid-step. Build the model "
        "with the delay wanted (delay_wgrad_compute), or set delay_wgrad back to True"
    )


def _scan(
    model: object, layers: Sequence[object], parts: Sequence[Sequence[object]]
) -> tuple[nn.Parameter, ...]:
    covered: set[int] = set()
    for i, listed in enumerate(parts):
        mine: set[int] = set()
        for part in listed:
            params: object = getattr(part, "parameters", None)
            if callable(params):
                mine.update(map(id, cast("Iterator[nn.Parameter]", params())))
        if mine & covered:
            _listed_twice_error(model, parts, i, mine & covered)
        covered |= mine
    frozen: list[nn.Parameter] = []
    inside: set[int] = set()
    for i, (layer, listed) in enumerate(zip(layers, parts, strict=True)):
        if not isinstance(layer, nn.Module):
            continue
        named = _named_modules(layer)
        inside.update(id(m) for _, m in named)
        if listed:
            bad = _uncovered(named[1:], covered, frozen)
            if bad is not None:
                _unlisted_error(model, bad, _LayerPath(model, layer, i), listed)
    if isinstance(model, nn.Module):
        outside = [(n, m) for n, m in _named_modules(model) if id(m) not in inside and n]
        bad = _uncovered(outside, covered, frozen)
        if bad is not None:
            _unlisted_error(model, bad, None, ())
    return tuple(frozen)


def _named_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    return cast("list[tuple[str, nn.Module]]", list(module.named_modules()))  # pyright: ignore[reportUnknownArgumentType] - torch's generator type


def _uncovered(
    named: Sequence[tuple[str, nn.Module]], covered: set[int], frozen: list[nn.Parameter]
) -> tuple[str, nn.Module, list[str]] | None:
    """The first module of ``named`` that may delay with nothing computing or counting it:
    ``(path, module, its parameters outside every listed module)``."""
    wgrad = [(n, m) for n, m in named if _has_backward_dw(m)]
    if not wgrad:
        return None
    paths = [n for n, _ in wgrad]
    for path, module in wgrad:
        count = pending_count(module)
        if count == _BAD:
            _bad_count(module, functools.partial(_at_path, path))
        if count is not None or any(q.startswith(path + ".") for q in paths):
            continue  # counted (checked after the step), or judged by its own parts
        loose = [(pn, p) for pn, p in module.named_parameters() if id(p) not in covered]
        trainable = [pn for pn, p in loose if p.requires_grad]
        if trainable:
            return path, module, trainable
        frozen.extend(p for _, p in loose)
    return None


def _listed_twice_error(
    model: object, parts: Sequence[Sequence[object]], index: int, shared: set[int]
) -> NoReturn:
    """Layer ``index`` lists a module holding parameters an earlier layer's lists hold."""
    names: dict[int, list[str]] = {}
    if isinstance(model, nn.Module):
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in shared:
                names.setdefault(id(p), []).append(name)
    shown = [" = ".join(n) for n in names.values()]
    if len(shown) > 4:
        shown = [*shown[:4], f"... {len(shown) - 4} more"]
    first = next(
        j
        for j, listed in enumerate(parts[:index])
        for part in listed
        if isinstance(part, nn.Module) and any(id(p) in shared for p in part.parameters())
    )
    raise WgradError(
        f"{type(model).__name__}.decoder.layers[{index}]: expected the modules its "
        "pre_dispatch_wgrad() / mlp_wgrad() list to be its own, received modules holding "
        f"{len(shared)} parameters that decoder.layers[{first}] lists too {shown}: a module "
        "shared by two layers (or a layer listed twice) has its delayed weight gradients "
        "computed by whichever layer's backward_dw() runs first, and the two layers' parts "
        "added to .grad apart, in another order than plain backward() (not bit-identical). "
        "Give each layer its own modules (copy.deepcopy the shared one)"
    )


def _at_path(path: str, module: object) -> str:
    return f"{path} ({type(module).__name__})"


class _LayerPath:
    """Layer ``index``'s path in the model (found on an error only)."""

    def __init__(self, model: object, layer: nn.Module, index: int) -> None:
        self.model = model
        self.layer = layer
        self.index = index

    def __call__(self) -> str:
        if isinstance(self.model, nn.Module):
            for name, module in _named_modules(self.model):
                if module is self.layer:
                    return name
        return f"decoder.layers[{self.index}]"


def _unlisted_error(
    model: object,
    bad: tuple[str, nn.Module, list[str]],
    layer: _LayerPath | None,
    listed: Sequence[object],
) -> NoReturn:
    path, module, params = bad
    owner = type(model).__name__
    if layer is not None:
        where = f"{layer()}.{path}"
        context = (
            f"{owner}.decoder.layers[{layer.index}] delays weight gradients (its "
            f"pre_dispatch_wgrad() / mlp_wgrad() list {len(listed)} modules), but"
        )
        fix = (
            "list it (pre_dispatch_wgrad(): WgradScope(CudaGraphModule.attn, module); "
            "mlp_wgrad(): the module) or a module holding it"
        )
    else:
        where = path
        context = f"{owner}: its layers delay weight gradients, but outside the layers"
        fix = "list it in a layer's pre_dispatch_wgrad() / mlp_wgrad()"
    shown = params if len(params) <= 4 else [*params[:4], f"... {len(params) - 4} more"]
    raise WgradError(
        f"{context} {where} ({type(module).__name__}) has a backward_dw() (a WgradLayer: its "
        f"weight gradient may wait for it) and trainable parameters {shown} that no listed "
        "module holds, and it counts nothing owed (no pending_wgrad): if it delays, the "
        "schedule never runs its backward_dw() and its .grad stays missing, unnoticed. "
        f"Expected it listed or counted; {fix}, or, if it computes its weight gradient in "
        "backward, give it a read-only int property pending_wgrad (0 then)"
    )
