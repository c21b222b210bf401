"""A decoder's layer list whose module names are the layers' global indices in the model.

A pipeline stage holding layers ``a .. b-1`` of a model names them ``a .. b-1`` in its
``state_dict`` and ``named_parameters`` (the full model's names), so per-rank checkpoints
of different stages never collide and any layout loads them (``torch.distributed.checkpoint``
matches tensors by name). The schedule still reads the list by position.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import cast, overload

from torch import nn
from typing_extensions import Self

from moe_overlap import ConfigError
from moe_overlap.args import MODULE, NON_NEGATIVE, Mismatch, check_arg, refuse, shown
from moe_overlap.blocks._torch_private import list_entries

__all__ = ["StageLayers"]


class StageLayers(nn.ModuleList):
    """The layers of a model or of one pipeline stage, named by their global index.

    ``StageLayers(layers, start=a)`` registers ``layers[i]`` under the name ``str(a + i)``:
    ``decoder.layers.{a + i}...`` in ``state_dict`` / ``named_parameters``, as in the full
    model, whichever stage holds the layer. By position it is a list, like the
    ``nn.ModuleList`` it subclasses: ``len``, iteration and ``layers[i]`` (``i`` from 0, negative
    from the end) give the stage's own layers in order; a slice keeps the global names;
    ``layers[i] = m`` replaces a layer under the same name; ``append`` / ``extend`` continue
    after the highest index (from ``start`` when empty); deleting keeps the other layers'
    names. :meth:`~moe_overlap.blocks.StageLayers.global_index` maps
    a position to its index in the model.

    Refused with :class:`~moe_overlap.ConfigError`: a negative ``start``, ``insert`` (the
    new layer would have no global index), and a concatenation (``+``) of lists that share
    a global index.
    """

    def __init__(self, layers: Iterable[nn.Module] | None = None, *, start: int = 0) -> None:
        super().__init__()
        try:
            start = NON_NEGATIVE.check(start)  # an int (NumPy's too), never a bool
        except Mismatch:
            raise ConfigError(
                f"StageLayers: expected start as an int >= 0 (the global index of the first "
                f"layer), received {shown(start)}"
            ) from None
        self._start = start
        if layers is not None:
            self.extend(layers)

    @classmethod
    def _of(cls, items: Iterable[tuple[str, nn.Module]]) -> StageLayers:
        out = cls()
        for key, module in items:
            out.add_module(key, module)
        return out

    def global_index(self, position: int) -> int:
        """The index in the full model of the layer at ``position`` of this list."""
        return int(self._key(position))

    def global_indices(self) -> list[int]:
        """The global index of every layer, in order."""
        return [int(k) for k in self._modules]

    def _key(self, position: int) -> str:
        n = len(self._modules)
        if not -n <= position < n:
            raise IndexError(f"StageLayers: index {position} is out of range for {n} layers")
        return list(self._modules)[position % n]

    @overload
    def __getitem__(self, idx: slice) -> StageLayers: ...

    @overload
    def __getitem__(self, idx: int) -> nn.Module: ...

    def __getitem__(self, idx: int | slice) -> nn.Module | StageLayers:
        if isinstance(idx, slice):
            return self._of(list(self._modules.items())[idx])
        module = self._modules[self._key(idx)]
        assert module is not None
        return module

    def __setitem__(self, idx: int, module: nn.Module) -> None:
        check_arg("StageLayers", "a layer", module, MODULE)
        self.add_module(self._key(idx), module)

    def __delitem__(self, idx: int | slice) -> None:
        keys = list(self._modules)
        for key in keys[idx] if isinstance(idx, slice) else [self._key(idx)]:
            del self._modules[key]

    def __add__(self, other: Iterable[nn.Module]) -> StageLayers:
        mine = list(self._modules.items())
        if isinstance(other, StageLayers):
            theirs = list(list_entries(other).items())
        else:
            nxt = self._next()
            theirs = [(str(nxt + i), m) for i, m in enumerate(other)]
        shared = sorted({k for k, _ in mine} & {k for k, _ in theirs}, key=int)
        if shared:
            raise ConfigError(
                f"StageLayers +: expected lists of distinct layers, received both holding "
                f"global indices {[int(k) for k in shared]}"
            )
        return self._of(mine + theirs)

    def insert(self, index: int, module: nn.Module) -> None:
        del index, module
        raise ConfigError(
            "StageLayers.insert: a layer inserted between others has no global index in the "
            "model; expected the list built with every layer (StageLayers(layers, start=...)), "
            "received an insert"
        )

    def _next(self) -> int:
        return max((int(k) + 1 for k in self._modules), default=self._start)

    def append(self, module: nn.Module) -> Self:
        check_arg("StageLayers", "a layer", module, MODULE)
        self.add_module(str(self._next()), module)
        return self

    def extend(self, modules: Iterable[nn.Module]) -> Self:
        given = cast(object, modules)
        if not isinstance(given, Iterable) or isinstance(given, (str, bytes, Mapping)):
            raise refuse("StageLayers: layers", "an iterable of nn.Modules", modules)
        for module in modules:
            self.append(module)
        return self

    def __repr__(self) -> str:
        lines = [f"  ({k}): " + repr(m).replace("\n", "\n  ") for k, m in self._modules.items()]
        return f"{type(self).__name__}(" + ("\n" + "\n".join(lines) + "\n" if lines else "") + ")"
