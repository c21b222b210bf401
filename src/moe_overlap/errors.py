"""The library's errors: one hierarchy under :class:`MoeOverlapError` (``docs/errors.md``).

Every user error raised by ``moe_overlap`` is a :class:`MoeOverlapError`. Messages name the
object involved, what was expected and what was received. ``assert`` only guards internal
invariants.

The classes are defined here, so tracebacks, reprs and pickles name
``moe_overlap.errors.ConfigError``. This module imports nothing of the package: the schedule
core (``engine/core``) and :mod:`moe_overlap.args` import it.
"""

from __future__ import annotations

from functools import partial

__all__ = [
    "ConfigError",
    "IntegrationError",
    "LayerStateAttributeError",
    "MoeOverlapError",
    "NodeStateError",
    "PlanReleasedError",
    "ScheduleError",
    "StreamError",
    "TypeHintError",
    "WgradError",
]


class MoeOverlapError(Exception):
    """Base class of every error the library raises on purpose."""


class ConfigError(MoeOverlapError, ValueError):
    """A configuration value or layer argument is invalid."""


class IntegrationError(MoeOverlapError, TypeError):
    """A user model, layer or callable does not honour the library's Protocols."""


class TypeHintError(IntegrationError):
    """Debug mode only: an argument or return value does not match its annotation.

    Raised by beartype (``MOE_OVERLAP_DEBUG=1``) at the call that broke the hint.
    """


class LayerStateAttributeError(IntegrationError, AttributeError):
    """A :class:`~moe_overlap.LayerState` attribute that is not one of its declared fields.

    Also an ``AttributeError``, so ``hasattr`` and ``getattr(state, name, default)`` work.
    """


class NodeStateError(MoeOverlapError, RuntimeError):
    """A schedule node was used out of order (run twice, backward before forward, ...)."""


class PlanReleasedError(NodeStateError):
    """A schedule plan was used after its state was released."""


class StreamError(MoeOverlapError, RuntimeError):
    """Streams or events do not match the device the schedule runs on."""


class WgradError(MoeOverlapError, RuntimeError):
    """Delayed weight gradients were computed twice, or never before they were needed."""


class ScheduleError(MoeOverlapError, RuntimeError):
    """A node failed while a schedule ran; the message gives the schedule position.

    The original exception is chained as ``__cause__``.
    """

    def __init__(self, message: str, *, position: str) -> None:
        super().__init__(message)
        self.position = position

    def __reduce__(self) -> tuple[object, ...]:
        """Pickle with ``position``, which the default exception pickling does not pass."""
        return (partial(ScheduleError, position=self.position), self.args, self.__dict__)
