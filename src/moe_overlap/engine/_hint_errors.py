"""Debug mode: an argument whose type check raises is the library's ``TypeHintError``.

beartype's checks call an argument's own methods (``len``, ``__getitem__``, an ABC's
``__instancecheck__``) and build their report with its ``repr``; one that raises (``len()``
of a 0-d tensor checked against ``Iterable[str]``) would escape as that bare exception.
:func:`install` wraps the decorator beartype's import hook applies to the package, so that
every callable it checks turns such an exception into :class:`~moe_overlap.TypeHintError`
naming the argument, in beartype's message format (``Function <name>() parameter
<arg>=<value> violates type hint <hint>, as ...``), the bare exception chained as its cause.

Which argument: beartype checks the arguments before the call, in order, so the first
argument whose check, run again with the same configuration, raises (or fails: the exception
came from beartype's report of the violation) is the one. An exception that no argument's
check reproduces came from the call itself and passes unchanged. Only this package's objects
are wrapped; what another package's import hook decorates is left as beartype made it.

A dataclass's ``__init__`` whose arguments beartype refuses runs unchecked instead, as
without debug mode, and its ``__post_init__`` (the library's field specs, ``check_fields``)
decides: what it accepts stands if every field it stored then fits the field's annotation
(a list or a generator the specs store as a tuple where the field says ``tuple[X, ...]``);
what it refuses, or a stored field that still breaks its annotation, raises beartype's
error. The same value is then accepted or refused with and without debug mode.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import types
import typing
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any, cast

from beartype import BeartypeConf
from beartype.door import is_bearable
from beartype.roar import BeartypeException

from moe_overlap.errors import MoeOverlapError, TypeHintError

__all__ = ["install"]

CLAW_DECORATOR = ("beartype.claw._ast._clawaststar", "__beartype__")
"""Where beartype's import hook finds the decorator it applies (module, name): every module
it rewrites star-imports it from there."""

_Decorate = Callable[..., Any]
_WRAPPED = "_moe_overlap_hint_errors"
"""Set on the callables :func:`install` made, so none is wrapped twice."""


def install(package: str) -> None:
    """Make the decorator beartype's import hook applies wrap what it checks in ``package``.

    Call it before the hook is installed (``beartype_package``): each module the hook rewrites
    imports the decorator when it is imported.
    """
    try:
        module = importlib.import_module(CLAW_DECORATOR[0])
        decorate = cast(_Decorate, getattr(module, CLAW_DECORATOR[1]))
    except (ImportError, AttributeError) as error:  # a beartype whose hook moved (a private name)
        warnings.warn(
            f"moe_overlap debug mode: this beartype has no {'.'.join(CLAW_DECORATOR)} "
            f"({error}); debug mode still checks every annotation, but an argument whose "
            "check itself raises (a value beartype cannot inspect) shows that exception "
            "instead of a TypeHintError naming the parameter; beartype 0.23.1 is the tested "
            "version",
            stacklevel=2,
        )
        return
    if getattr(decorate, _WRAPPED, False):
        return
    setattr(module, CLAW_DECORATOR[1], _claw_decorator(decorate, package))


def _claw_decorator(beartype: _Decorate, package: str) -> _Decorate:
    """beartype's decorator, whose results for ``package``'s objects translate argument-check
    errors (the hook's configuration is its own copy of the one given to it)."""

    def decorate(*args: Any, **kwargs: Any) -> Any:
        if not args:  # @beartype(conf=...): the object comes next
            return functools.partial(decorate, **kwargs)
        obj: object = args[0]
        module = str(getattr(obj, "__module__", None) or "")
        if len(args) > 1 or module.partition(".")[0] != package:  # another package's
            return beartype(*args, **kwargs)
        return _checked(beartype, obj, kwargs)

    setattr(decorate, _WRAPPED, True)
    return decorate


def _checked(beartype: _Decorate, obj: object, options: dict[str, Any]) -> Any:
    """``obj`` decorated by beartype with ``options``; what beartype wrapped, translating."""
    conf = cast(BeartypeConf, options.get("conf") or BeartypeConf())
    if not isinstance(obj, type):
        out = beartype(obj, **options)
        return _translating(out, conf) if out is not obj and _is_function(out) else out
    before = {kind: dict(vars(kind)) for kind in _nested(obj)}
    out = beartype(obj, **options)
    for kind, members in before.items():  # beartype replaced the members it wrapped
        for name, new in list(vars(kind).items()):
            old = members.get(name)
            if new is not old:
                translated = _member(new, old, conf)
                if name == "__init__" and _is_record(kind) and _is_function(old):
                    translated = _fields_decide(
                        cast("Callable[..., Any]", translated), cast(_Decorate, old), conf
                    )
                if translated is not new:
                    setattr(kind, name, translated)
    return out


def _nested(kind: type) -> Iterable[type]:
    """``kind`` and the classes defined in its body, at any depth."""
    yield kind
    for name, value in vars(kind).items():
        if isinstance(value, type) and value.__qualname__ == f"{kind.__qualname__}.{name}":
            yield from _nested(value)


def _is_record(kind: type) -> bool:
    """Whether ``kind`` is a dataclass (its ``__init__`` made from its fields)."""
    return dataclasses.is_dataclass(kind)


def _is_function(obj: object) -> bool:
    return isinstance(obj, types.FunctionType) and not getattr(obj, _WRAPPED, False)


def _member(new: object, old: object, conf: BeartypeConf) -> object:
    """A class member beartype replaced (``new``, was ``old``), translating."""
    if _is_function(new):
        return _translating(cast(types.FunctionType, new), conf)
    if type(new) in (staticmethod, classmethod):
        inner = cast("Callable[..., Any]", cast(Any, new).__func__)
        if not _is_function(inner) or inner is getattr(old, "__func__", None):
            return new
        translated = _translating(inner, conf)
        return staticmethod(translated) if type(new) is staticmethod else classmethod(translated)
    if type(new) is property:

        def part(attr: str) -> Callable[..., Any] | None:
            fn = cast("Callable[..., Any] | None", getattr(new, attr))
            replaced = _is_function(fn) and fn is not getattr(old, attr, None)
            return _translating(cast(Callable[..., Any], fn), conf) if replaced else fn

        return property(part("fget"), part("fset"), part("fdel"), new.__doc__)
    return new


def _translating(checked: Callable[..., Any], conf: BeartypeConf) -> Callable[..., Any]:
    """``checked`` (beartype's wrapper), raising ``TypeHintError`` where a check raised."""

    @functools.wraps(checked)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return checked(*args, **kwargs)
        except MoeOverlapError:
            raise
        except Exception as exc:
            error = _argument_error(checked, conf, exc, args, kwargs)
            if error is None:
                raise
            raise error from exc

    setattr(call, _WRAPPED, True)
    return call


def _fields_decide(
    checked: Callable[..., Any], plain: Callable[..., Any], conf: BeartypeConf
) -> Callable[..., Any]:
    """A dataclass's ``__init__`` (``checked``: beartype's, translating; ``plain``: the
    dataclass's own): where beartype refuses an argument, ``plain`` decides (the module
    doc says how)."""

    @functools.wraps(checked)
    def init(self: object, *args: Any, **kwargs: Any) -> None:
        try:
            checked(self, *args, **kwargs)
        except TypeHintError as refused:
            if not _breaks_a_hint(checked, conf, (self, *args), kwargs):
                raise  # raised by the call itself, not by an argument's check
            try:
                plain(self, *args, **kwargs)
            except Exception:  # refused without debug mode too (its error is the context)
                raise refused  # noqa: B904 - chained to the library's error as its context
            if not _fields_fit(self, checked, conf):
                raise

    setattr(init, _WRAPPED, True)
    return init


def _fits(value: object, hint: object, conf: BeartypeConf) -> bool:
    """Whether ``value`` fits ``hint`` (no hint, or a string one, fits anything; a check
    that raises does not fit: _translating named it)."""
    if hint is None or isinstance(hint, str):
        return True
    try:
        return is_bearable(value, cast(Any, hint), conf=conf)
    except Exception:
        return False


def _breaks_a_hint(
    checked: Callable[..., Any],
    conf: BeartypeConf,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
) -> bool:
    """Whether an argument of ``checked(*args, **kwargs)`` breaks its annotation."""
    try:
        bound = inspect.signature(checked).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return False
    hints = _hints(checked)
    return not all(_fits(v, hints.get(n), conf) for n, v in bound.arguments.items())


def _fields_fit(obj: object, checked: Callable[..., Any], conf: BeartypeConf) -> bool:
    """Whether every field of the dataclass instance ``obj`` fits its annotation (as
    ``checked``, its ``__init__``, declares it)."""
    hints = _hints(checked)
    return all(
        _fits(getattr(obj, f.name), hints.get(f.name), conf)
        for f in dataclasses.fields(cast(Any, obj))
    )


def _argument_error(
    checked: Callable[..., Any],
    conf: BeartypeConf,
    exc: Exception,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
) -> TypeHintError | None:
    """The ``TypeHintError`` for the argument of ``checked(*args, **kwargs)`` whose check
    raised ``exc``; ``None`` where no argument's check raises again (``exc`` came from the
    call itself)."""
    try:
        signature = inspect.signature(checked)
        bound = signature.bind(*args, **kwargs)
    except (TypeError, ValueError):  # a call beartype passed on as it was: the call raised
        return None
    hints = _hints(checked)
    for name, value in bound.arguments.items():
        hint = hints.get(name)
        if hint is None or isinstance(hint, str):
            continue
        kind = signature.parameters[name].kind
        values: Iterable[object] = (
            cast("tuple[object, ...]", value)
            if kind is inspect.Parameter.VAR_POSITIONAL
            else cast("dict[str, object]", value).values()
            if kind is inspect.Parameter.VAR_KEYWORD
            else (value,)
        )
        for item in values:
            try:
                if is_bearable(item, cast(Any, hint), conf=conf):
                    continue
                how = "and beartype's report of it raised"
            except BeartypeException:  # a hint the door cannot check alone: not this one
                break
            except Exception:
                how = "as checking it raised"
            return TypeHintError(
                f"{_label(signature)} {checked.__module__}.{checked.__qualname__}() parameter "
                f"{name}={_shown(value)} violates type hint {hint!r}, {how} "
                f"{type(exc).__name__}: {exc}; pass a value its annotation allows"
            )
    return None


def _hints(checked: Callable[..., Any]) -> dict[str, object]:
    """The hints of what ``checked`` wraps: beartype resolved them in place; those it left as
    strings are resolved here where they can be."""
    wrapped: object = getattr(checked, "__wrapped__", checked)
    hints = dict(cast("dict[str, object]", getattr(wrapped, "__annotations__", {})))
    if any(isinstance(hint, str) for hint in hints.values()):
        with contextlib.suppress(Exception):  # left as strings: those arguments are not named
            hints |= typing.get_type_hints(inspect.unwrap(checked), include_extras=True)
    return hints


def _label(signature: inspect.Signature) -> str:
    """What beartype calls the callable: by its first parameter's name, as beartype does."""
    first = next(iter(signature.parameters), None)
    return {"self": "Method", "cls": "Class method"}.get(first or "", "Function")


def _shown(value: object) -> str:
    try:
        text = repr(value)
    except Exception:  # a broken __repr__ must not hide the error
        text = f"<{type(value).__name__} object>"
    return text if len(text) <= 80 else text[:77] + "..."
