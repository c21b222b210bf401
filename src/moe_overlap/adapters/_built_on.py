"""What an adapter was built on: the modules its slots call, by identity.

An adapter reads a model's structure once, at construction (its blocks, each block's
attention and MoE, the MoE's router and experts) and keeps references to what it found.
A model changed afterwards (a block added, removed or replaced; a block's MoE, experts,
router or attention replaced; a linear the adapter swapped for a delayable one replaced;
a parameter the adapter holds by reference replaced; a setting it read once changed) would
be trained as it was: the new modules get no gradient, silently. :class:`BuiltOn` records
the identities (and those settings) at construction; :meth:`BuiltOn.check_blocks` and
:meth:`BuiltOn.check_children` compare them at every plan build (a few dictionary reads per
module), refusing a changed model with the library's error.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from moe_overlap import ConfigError
from moe_overlap.adapters._hf_experts import DelayedLinear
from moe_overlap.adapters._torch_private import parameters

__all__ = ["BuiltOn"]


def _children(module: nn.Module) -> dict[str, int]:
    """Each child's identity; a :class:`DelayedLinear` another adapter swapped in has the
    identity of the linear it replaced (same parameters, same product: nothing changed)."""
    return {
        name: id(child.replaced if isinstance(child, DelayedLinear) else child)
        for name, child in module.named_children()
    }


def _parameters(module: nn.Module) -> dict[str, int]:
    """Each parameter registered on ``module`` itself, by identity."""
    return {name: id(p) for name, p in parameters(module).items() if p is not None}


class BuiltOn:
    """The identities of ``blocks`` (their names and modules, in order), of the direct
    children of every module in ``watched`` (name, module) pairs and of the parameters
    registered on every module in ``held`` (those the adapter calls by reference, not
    through the module); the values of ``settings`` (name, object, attribute, what reads
    it). Parameters are compared only on ``held`` modules: FSDP2 and torchtitan's
    parallelisms replace them with sharded ones in place, on the modules the adapter
    calls."""

    __slots__ = ("_adapter", "_blocks", "_held", "_settings", "_watched")

    def __init__(
        self,
        adapter: str,
        blocks: Iterable[tuple[str, nn.Module]],
        watched: Iterable[tuple[str, nn.Module]],
        *,
        held: Iterable[tuple[str, nn.Module]] = (),
        settings: Iterable[tuple[str, object, str, str]] = (),
    ) -> None:
        self._adapter = adapter
        self._blocks = [(name, id(block)) for name, block in blocks]
        self._watched = [(name, module, _children(module)) for name, module in watched]
        self._held = [(name, module, _parameters(module)) for name, module in held]
        self._settings = [
            (name, owner, attr, why, getattr(owner, attr, None))
            for name, owner, attr, why in settings
        ]

    def check_blocks(self, blocks: Iterable[tuple[str, nn.Module]], owner: str) -> None:
        """Raise :class:`~moe_overlap.ConfigError` when blocks were added, removed or
        reordered (``blocks``: the model's blocks now; ``owner``: its name). A block replaced
        in its place is left to the adapter's own check, which names a torch wrapper."""
        was = [name for name, _ in self._blocks]
        names = [name for name, _ in blocks]
        if names == was:
            return
        added = [n for n in names if n not in was]
        removed = [n for n in was if n not in names]
        what = f"blocks added {added}, removed {removed}" + (
            "" if added or removed else ", reordered"
        )
        raise self._changed(f"{owner}'s blocks", what)

    def check_children(self, owner: str) -> None:
        """Raise :class:`~moe_overlap.ConfigError` when a child of a watched module (a
        block's attention or MoE, the MoE's router or experts) was replaced, added or
        removed."""
        for name, module, children in self._watched:
            found = _children(module)
            if found != children:
                changed = sorted(
                    n for n in set(children) | set(found) if children.get(n) != found.get(n)
                )
                raise self._changed(f"{owner}.{name}", f"submodule(s) {changed} replaced")
        for name, module, held in self._held:
            found = _parameters(module)
            if found != held:
                changed = sorted(n for n in set(held) | set(found) if held.get(n) != found.get(n))
                raise self._changed(
                    f"{owner}.{name}",
                    f"parameter(s) {changed} replaced, which the adapter holds by reference",
                )

    def check_settings(self, owner: str) -> None:
        """Raise :class:`~moe_overlap.ConfigError` when a setting the adapter read once, at
        construction, has another value now."""
        for name, obj, attr, why, was in self._settings:
            now: object = getattr(obj, attr, None)
            if now != was or type(now) is not type(was):
                raise ConfigError(
                    f"{self._adapter}: {owner}.{name}: expected {was!r}, its value when the "
                    f"adapter was built ({why}), received {now!r}; the adapter would keep "
                    f"following the old value: build a new {self._adapter} after changing it"
                )

    def _changed(self, where: str, what: str) -> ConfigError:
        return ConfigError(
            f"{self._adapter}: {where}: expected the modules the adapter was built on, received "
            f"a changed model ({what} after the adapter was built); the adapter would keep "
            f"training what it saw at construction, leaving the new modules without gradient: "
            f"build a new {self._adapter} after changing the model"
        )
