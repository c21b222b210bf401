"""Debug mode: ``MOE_OVERLAP_DEBUG=1`` before import checks every call with beartype.

It also turns on the costly checks that read :data:`DEBUG`: the autograd-graph walks of the
layer nodes (``_node.py``, ``_layer_node.py``) and the first-step comparison of the
schedule with the model's plain forward (``_plain_check.py``, run by ``combined_1f1b``).
"""

from __future__ import annotations

import os
from collections.abc import Callable

__all__ = ["DEBUG", "DEBUG_ENV", "debug_enabled", "install_beartype"]

DEBUG_ENV = "MOE_OVERLAP_DEBUG"


def debug_enabled() -> bool:
    """Whether the environment asks for runtime type checking (read at import time)."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


DEBUG = debug_enabled()
"""Read once, at import: debug mode's costly checks (saved-tensor hooks, ...) are on."""


def _rules(protocol: type) -> Callable[[object], bool]:
    """A beartype validator for ``protocol``: its rule table's fast check (``engine/contracts.py``).

    The table is looked up on the first call: its module is imported after beartype's hook
    is installed, so it is checked too.
    """
    found: list[Callable[[object], bool]] = []

    def conforms(value: object) -> bool:
        if not found:
            from moe_overlap.engine.contracts import contract_of

            contract = contract_of(protocol)
            assert contract is not None, f"{protocol.__name__} has no rule table"
            found.append(contract.conforms)
        return found[0](value)

    conforms.__name__ = conforms.__qualname__ = f"{protocol.__name__}_rule_table"
    return conforms


def install_beartype() -> None:
    """Check every later-imported module of the package with beartype.

    Violations raise :class:`~moe_overlap.TypeHintError` (an ``IntegrationError``, so a
    ``TypeError``), and so does an argument whose check raises (``len()`` of a 0-d tensor
    checked against ``Iterable[str]``: ``_hint_errors.py``). Where a hint is narrower than
    the library's own argument specs (:mod:`moe_overlap.args`), the specs win: an ``int``
    hint accepts any :class:`numbers.Integral` (NumPy's integers, as ``args.Int``), a
    ``float`` hint any :class:`numbers.Real` (an ``int``, NumPy's floats, as ``args.Real``);
    the library's checks then refuse what the spec refuses (a ``bool``) with their own
    message. A parameter or return value typed with one of the library's Protocols
    is checked with that Protocol's rule table (``Annotated[object, Is[<its table>]]``),
    the very check plans run at construction: each member looked up with ``getattr`` (an
    ``isinstance`` against a runtime Protocol misses ``nn.Module`` submodules on Python
    3.12+) and its value checked.
    """
    import numbers
    from typing import Annotated

    from beartype import BeartypeConf, FrozenDict
    from beartype.claw import beartype_package
    from beartype.vale import Is

    from moe_overlap import protocols
    from moe_overlap.engine import _hint_errors
    from moe_overlap.errors import TypeHintError

    overrides: dict[object, object] = {
        kind: Annotated[object, Is[_rules(kind)]]
        for kind in vars(protocols).values()
        if isinstance(kind, type)
        and kind.__module__ == protocols.__name__
        and getattr(kind, "_is_runtime_protocol", False)
    }
    # What the library's specs accept (args.Int, args.Real); replaces PEP 484's tower.
    overrides[int] = int | numbers.Integral
    overrides[float] = float | numbers.Real
    conf = BeartypeConf(hint_overrides=FrozenDict(overrides), violation_type=TypeHintError)
    _hint_errors.install("moe_overlap")  # before the hook: each module imports it
    beartype_package("moe_overlap", conf=conf)
