"""The ``arguments`` hook's guard list, apart from the other hooks (:mod:`._hooks`).

The data types that call it (options, streams, orders, schedules) sit below the plans and
nodes the :class:`~._guard.Guard` Protocol names, which :mod:`moe_overlap.protocols`
imports for its annotations: this list's type names no plan, so they import nothing that
imports the Protocols back.
"""

from typing import Protocol, runtime_checkable

__all__ = ["ArgumentsGuard", "on_arguments"]


@runtime_checkable
class ArgumentsGuard(Protocol):
    """The ``arguments`` hook of a :class:`~._guard.Guard`."""

    def arguments(self, owner: str, value: object) -> None: ...


on_arguments: list[ArgumentsGuard] = []
"""The guards attached to ``arguments`` (mutated in place, never rebound)."""
