"""Argument and field validation: one mechanism for every public constructor and function.

A :class:`Spec` says what a value must be, in words (:attr:`Spec.expects`) and as a check
(:meth:`Spec.check`, which returns the value, normalised, or raises). Two entry points use
it:

- :func:`check_arg` for an argument of a function or constructor. Its message is
  ``"<where>: <name> must be <expects>, received <type> <value>"``;
- :func:`check_fields` for every field of a configuration dataclass (in its
  ``__post_init__``), each field with its spec (a field without one is a bug of the library).
  Its message is ``"<Class>.<field>: expected <expects>, received <type> <value>"``.

Both raise :class:`~moe_overlap.ConfigError` for a wrong value, or the spec's own error
class (:class:`~moe_overlap.IntegrationError` for objects that must honour a Protocol or be a
module: a model, a layer, an optimizer). :func:`refuse` builds the same message for a check
across several values (``topk`` above ``num_experts``).

What the specs accept:

- ``bool`` only where a bool belongs: ``1``, ``"yes"``, ``numpy.bool_`` are refused (a truthy
  value would act as ``True`` while anything reading the flag with ``isinstance`` reads
  "not set");
- an int (:class:`Int`) is a Python ``int`` or any :class:`numbers.Integral` (NumPy's
  integer scalars), returned as ``int``; never a ``bool`` (``True`` experts) nor a tensor
  (reading a CUDA tensor's value would synchronise the device);
- a real number (:class:`Real`) is an ``int``, ``float`` or any :class:`numbers.Real` (NumPy's
  float scalars), not a ``bool``, returned as ``float``; finite unless the spec says
  otherwise (NaN and infinities refused);
- a choice (:class:`OneOf`) is one of the listed values, of the same type: a string where
  an enum member is asked for is refused (pass the member);
- a collection (:class:`Items`) is any iterable but a string, bytes or a mapping, returned as
  a tuple of its checked items.

Every subpackage checks its arguments with it, the schedule core (``engine/core``) included,
so it imports nothing of the package but :mod:`moe_overlap.errors`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from enum import Enum
from typing import TYPE_CHECKING, Generic, TypeVar, cast

import torch
from torch import nn

from moe_overlap.errors import ConfigError, IntegrationError, MoeOverlapError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = [
    "ANY",
    "BOOL",
    "CALLABLE",
    "DEVICE",
    "FLOAT_DTYPE",
    "GROUP",
    "MODULE",
    "NONE",
    "NON_NEGATIVE",
    "OPT_DEVICE",
    "POSITIVE",
    "TENSOR",
    "Bool",
    "Device",
    "Func",
    "Instance",
    "Int",
    "Items",
    "Mismatch",
    "OneOf",
    "Opt",
    "Real",
    "Spec",
    "check_arg",
    "check_fields",
    "refuse",
    "replaced",
    "shown",
]

T_co = TypeVar("T_co", covariant=True)
T = TypeVar("T")


class Mismatch(Exception):
    """Raised by :meth:`Spec.check` (internal): the value is not what the spec expects.

    ``detail`` says more than the spec's words (which item of a collection, why a device
    cannot be used).
    """

    def __init__(self, detail: str = "") -> None:
        super().__init__(detail)
        self.detail = detail


def shown(value: object) -> str:
    """``<type> <value>`` as messages show a received value (a tensor by dtype and shape)."""
    if isinstance(value, torch.Tensor):
        return f"Tensor {str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    try:
        text = repr(value)
    except Exception:  # a broken __repr__ must not hide the real error
        text = "<unprintable>"
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{type(value).__name__} {text}"


class Spec(Generic[T_co]):
    """What a value must be: :attr:`expects` in words, :meth:`check` as code.

    ``error``: the class raised for a mismatch (``ConfigError`` for values,
    ``IntegrationError`` for objects that must honour a Protocol); ``hint``: what to do
    instead, appended to the message.
    """

    __slots__ = ("error", "expects", "hint")

    def __init__(
        self, expects: str, *, error: type[MoeOverlapError] = ConfigError, hint: str = ""
    ) -> None:
        self.expects = expects
        self.error = error
        self.hint = hint

    def check(self, value: object) -> T_co:
        """``value`` (normalised), or :class:`Mismatch`."""
        raise NotImplementedError

    def accepts(self, value: object) -> bool:
        """Whether :meth:`check` accepts ``value`` (a boolean, for fast paths)."""
        try:
            self.check(value)
        except Mismatch:
            return False
        return True

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.expects!r})"


class Bool(Spec[bool]):
    """A Python ``bool``."""

    __slots__ = ()

    def __init__(self, *, hint: str = "") -> None:
        super().__init__("a bool", hint=hint)

    def check(self, value: object) -> bool:
        if not isinstance(value, bool):
            raise Mismatch
        return value

    def accepts(self, value: object) -> bool:
        return isinstance(value, bool)


def _bound(value: float, name: str | None) -> str:
    return f"{name}={value}" if name else f"{value}"


class Int(Spec[int]):
    """An int (not a bool), ``min <= value <= max`` where given; returned as ``int``.

    ``max_name`` names a bound that comes from another value (``topk <= num_experts=8``);
    ``exact`` accepts a Python ``int`` only (a member the schedule reads as it is, not
    normalised: NumPy's integers refused).
    """

    __slots__ = ("exact", "max", "min")

    def __init__(
        self,
        min: int | None = None,
        max: int | None = None,
        *,
        max_name: str | None = None,
        exact: bool = False,
        error: type[MoeOverlapError] = ConfigError,
        hint: str = "",
    ) -> None:
        if min is not None and max is not None:
            words = f"an int in [{min}, {_bound(max, max_name)}]"
        elif min is not None:
            words = f"an int >= {min}"
        elif max is not None:
            words = f"an int <= {_bound(max, max_name)}"
        else:
            words = "an int"
        super().__init__(words, error=error, hint=hint)
        self.min = min
        self.max = max
        self.exact = exact

    def check(self, value: object) -> int:
        if self.exact:
            if type(value) is not int:
                raise Mismatch
            n = value
        elif isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise Mismatch
        else:
            n = int(value)
        if (self.min is not None and n < self.min) or (self.max is not None and n > self.max):
            raise Mismatch
        return n


class Real(Spec[float]):
    """A real number (not a bool), finite unless ``finite=False``; ``value >= min`` and
    ``value > above`` where given; returned as ``float``."""

    __slots__ = ("above", "finite", "min")

    def __init__(
        self,
        *,
        min: float | None = None,
        above: float | None = None,
        finite: bool = True,
        hint: str = "",
    ) -> None:
        words = "a finite real number" if finite else "a real number"
        if min is not None:
            words += f" >= {min:g}"
        if above is not None:
            words += f" > {above:g}"
        super().__init__(words, hint=hint)
        self.min = min
        self.above = above
        self.finite = finite

    def check(self, value: object) -> float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise Mismatch
        x = float(value)
        if math.isnan(x) or (self.finite and not math.isfinite(x)):
            raise Mismatch
        if (self.min is not None and x < self.min) or (self.above is not None and x <= self.above):
            raise Mismatch
        return x


class OneOf(Spec[T]):
    """One of ``choices`` (compared with ``==`` after a type check: a value of another type
    is refused even if it compares equal, so ``"attn"`` is not a ``CudaGraphModule``);
    returns the choice itself."""

    __slots__ = ("choices", "kinds")

    def __init__(self, choices: Sequence[T], *, expects: str | None = None, hint: str = "") -> None:
        enums = {type(c).__name__ for c in choices if isinstance(c, Enum)}
        listed = [c.name if isinstance(c, Enum) else c for c in choices]
        words = f"a {enums.pop()} among {listed}" if len(enums) == 1 else f"one of {listed}"
        super().__init__(expects or words, hint=hint)
        self.choices = tuple(choices)
        self.kinds = tuple({type(c) for c in choices})

    def check(self, value: object) -> T:
        if not isinstance(value, self.kinds):
            raise Mismatch
        for choice in self.choices:
            if value == choice:
                return choice
        raise Mismatch


class Instance(Spec[T]):
    """An instance of ``kind``: a class, a tuple of classes, or a callable returning the
    class (for one imported only when a value is checked); ``error`` defaults to
    ``ConfigError``."""

    __slots__ = ("_kind",)

    def __init__(
        self,
        kind: type[T] | tuple[type[T], ...] | Callable[[], type[T]],
        expects: str,
        *,
        error: type[MoeOverlapError] = ConfigError,
        hint: str = "",
    ) -> None:
        super().__init__(expects, error=error, hint=hint)
        self._kind = kind

    def check(self, value: object) -> T:
        given = self._kind
        kind: type | tuple[type, ...] = (
            cast("type | tuple[type, ...]", given) if isinstance(given, (type, tuple)) else given()
        )
        if not isinstance(value, kind):
            raise Mismatch
        return cast(T, value)


class Func(Spec[Callable[..., object]]):
    """Anything ``callable`` (a function, a bound method, a module)."""

    __slots__ = ()

    def check(self, value: object) -> Callable[..., object]:
        if not callable(value):
            raise Mismatch
        return value

    def accepts(self, value: object) -> bool:
        return callable(value)


class Opt(Spec["T | None"]):
    """``None`` or what ``spec`` accepts; ``expects`` replaces the words ``"<spec's> or None"``."""

    __slots__ = ("spec",)

    def __init__(self, spec: Spec[T], *, expects: str | None = None) -> None:
        words = expects or f"{spec.expects} or None"
        super().__init__(words, error=spec.error, hint=spec.hint)
        self.spec = spec

    def check(self, value: object) -> T | None:
        return None if value is None else self.spec.check(value)


class Items(Spec[tuple[T, ...]]):
    """A collection (any iterable but a string, bytes or a mapping) of what ``item``
    accepts, with at least ``min_len`` items; returned as a tuple of the checked items.
    ``ordered``: the items' order means something (one per layer, in order), so a set,
    whose order is its hashing's, is refused."""

    __slots__ = ("item", "min_len", "ordered")

    def __init__(
        self,
        item: Spec[T],
        *,
        expects: str | None = None,
        min_len: int = 0,
        hint: str = "",
        ordered: bool = False,
    ) -> None:
        words = expects or f"a {'sequence' if ordered else 'collection'}, each item {item.expects}"
        if min_len and expects is None:
            kind = "sequence" if ordered else "collection"
            words = f"a {kind} of at least {min_len} items, each {item.expects}"
        super().__init__(words, error=item.error, hint=hint or item.hint)
        self.item = item
        self.min_len = min_len
        self.ordered = ordered

    def check(self, value: object) -> tuple[T, ...]:
        if isinstance(value, (str, bytes, Mapping, torch.Tensor)) or not isinstance(
            value, Iterable
        ):
            raise Mismatch
        if self.ordered and isinstance(value, AbstractSet):
            raise Mismatch("a set has no order: give a list or tuple, in order")
        items = tuple(cast("Iterable[object]", value))
        out: list[T] = []
        for i, item in enumerate(items):
            try:
                out.append(self.item.check(item))
            except Mismatch as bad:
                more = f": {bad.detail}" if bad.detail else ""
                raise Mismatch(f"item {i} is {shown(item)}{more}") from None
        if len(out) < self.min_len:
            raise Mismatch(f"{len(out)} items")
        return tuple(out)


class Device(Spec[torch.device]):
    """A ``torch.device`` or device string this process can allocate on: ``cpu``, ``meta``,
    or ``cuda[:i]`` with CUDA present and ``i`` below the device count; returned as a
    ``torch.device``."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(
            "a torch.device or device string of a device this process has ('cpu', 'meta', "
            "'cuda[:i]' with CUDA present)"
        )

    def check(self, value: object) -> torch.device:
        if not isinstance(value, (str, torch.device)):
            raise Mismatch
        try:
            dev = torch.device(value)
        except (RuntimeError, ValueError, TypeError):
            raise Mismatch("not a device torch knows") from None
        if dev.type in ("cpu", "meta"):
            return dev
        if dev.type != "cuda":
            raise Mismatch(f"device type {dev.type!r} is not one the library runs on")
        if not torch.cuda.is_available():
            raise Mismatch("CUDA is not available in this process")
        count = torch.cuda.device_count()
        if (dev.index or 0) >= count:  # no index: the current device
            raise Mismatch(f"this process sees {count} CUDA device(s)")
        return dev


TENSOR: Spec[torch.Tensor] = Instance(torch.Tensor, "a Tensor")
"""A ``torch.Tensor``."""

POSITIVE = Int(1)
"""An int >= 1 (a size, a count)."""

NON_NEGATIVE = Int(0)
"""An int >= 0 (an index, an offset)."""


def _process_group() -> type[object]:
    import torch.distributed as dist

    return cast("type[object]", dist.ProcessGroup)


class _Any(Spec[object]):
    __slots__ = ()

    def check(self, value: object) -> object:
        return value


ANY: Spec[object] = _Any("anything")
"""Anything (a field the library passes on unread, e.g. Megatron-Core's ``packed_seq_params``)."""

BOOL = Bool()
"""A Python ``bool``."""

NONE: Spec[None] = Instance(type(None), "None (the only value supported)")
"""``None`` only (a field fixed to what a model supports)."""

CALLABLE = Func("a callable")
"""Anything ``callable``."""

DEVICE = Device()
"""See :class:`Device`."""

OPT_DEVICE: Spec[torch.device | None] = Opt(DEVICE)
"""A device (:class:`Device`) or ``None``."""

GROUP: Spec[object] = Instance(
    _process_group,
    "a torch.distributed ProcessGroup",
    hint="pass a group from dist.new_group (or dist.group.WORLD)",
)
"""A ``torch.distributed.ProcessGroup``."""


class _FloatDtype(Spec[torch.dtype]):
    __slots__ = ()

    def check(self, value: object) -> torch.dtype:
        if not isinstance(value, torch.dtype) or not value.is_floating_point:
            raise Mismatch
        return value


FLOAT_DTYPE: Spec[torch.dtype] = _FloatDtype("a floating-point torch.dtype (parameters need one)")
"""A floating-point ``torch.dtype``."""


MODULE: Spec[nn.Module] = Instance(nn.Module, "an nn.Module", error=IntegrationError)
"""An ``nn.Module`` (an :class:`~moe_overlap.IntegrationError` otherwise)."""


def _message(subject: str, verb: str, expects: str, value: object, detail: str, hint: str) -> str:
    more = f" ({detail})" if detail else ""
    tail = f"; {hint}" if hint else ""
    return f"{subject}{verb}{expects}, received {shown(value)}{more}{tail}"


def refuse(
    subject: str,
    expects: str,
    value: object,
    *,
    detail: str = "",
    hint: str = "",
    error: type[MoeOverlapError] = ConfigError,
    field: bool = False,
) -> MoeOverlapError:
    """The error to raise for ``value`` where ``expects`` was expected (the messages of
    :func:`check_arg`, or of :func:`check_fields` with ``field``): for checks that read
    several values. ``subject`` is ``"<where>: <name>"`` for an argument, ``"<Class>.<field>"``
    for a field."""
    verb = ": expected " if field else " must be "
    return error(_message(subject, verb, expects, value, detail, hint))


def check_arg(where: str, name: str, value: object, spec: Spec[T]) -> T:
    """``value`` (normalised: an int as ``int``, a real number as ``float``, a collection as a
    tuple) when ``spec`` accepts it, else the spec's error: ``"<where>: <name> must be
    <expects>, received <type> <value>"``."""
    try:
        return spec.check(value)
    except Mismatch as bad:
        raise refuse(
            f"{where}: {name}",
            spec.expects,
            value,
            detail=bad.detail,
            hint=spec.hint,
            error=spec.error,
        ) from None


_FIELDS: dict[type, tuple[str, ...]] = {}


def replaced(obj: T, changes: Mapping[str, object]) -> T:
    """``dataclasses.replace(obj, **changes)`` for a dataclass's ``replace`` method; a name
    that is not one of its fields is a :class:`~moe_overlap.ConfigError` naming the class,
    the names and the fields there are (``dataclasses.replace`` raises a bare
    ``TypeError``). The copy's ``__post_init__`` checks the new values."""
    fields = [f.name for f in dataclasses.fields(cast("DataclassInstance", obj))]
    unknown = sorted(set(changes) - set(fields))
    if unknown:
        raise ConfigError(
            f"{type(obj).__name__}.replace: expected fields of {type(obj).__name__} "
            f"({', '.join(fields)}), received {', '.join(unknown)}; use those names"
        )
    return cast(T, dataclasses.replace(cast("DataclassInstance", obj), **changes))


def check_fields(obj: object, specs: Mapping[str, Spec[object]]) -> None:
    """Check every field of the dataclass ``obj`` against ``specs`` (one per field), in
    declaration order, replacing a value by its normalised form (frozen dataclasses too).

    The error names the field: ``"<Class>.<field>: expected <expects>, received <type>
    <value>"``.
    """
    kind = type(obj)
    names = _FIELDS.get(kind)
    if names is None:
        names = tuple(f.name for f in dataclasses.fields(cast("DataclassInstance", obj)))
        assert set(names) == set(specs), f"{kind.__name__}: fields and specs differ"
        _FIELDS[kind] = names
    cls = kind.__name__
    for name in names:
        value: object = getattr(obj, name)
        spec = specs[name]
        try:
            checked = spec.check(value)
        except Mismatch as bad:
            raise refuse(
                f"{cls}.{name}",
                spec.expects,
                value,
                detail=bad.detail,
                hint=spec.hint,
                error=spec.error,
                field=True,
            ) from None
        if checked is not value:
            object.__setattr__(obj, name, checked)
