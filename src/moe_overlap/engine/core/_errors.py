"""The library's exception hierarchy.

Every user error raised by ``moe_overlap`` is a :class:`~moe_overlap.MoeOverlapError`. Messages name
the object involved, what was expected and what was received. ``assert`` only guards
internal invariants.

The classes are defined here and shown from their public module: each one's ``__module__``
is ``moe_overlap.errors``, so tracebacks and reprs name ``moe_overlap.errors.ConfigError``
and pickles refer to the public path.
"""

from __future__ import annotations

from functools import partial

__all__ = [
    "FREED_MEMORY_HINT",
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
    "freed_memory_hint",
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


# Shown from the public module that re-exports them (tracebacks, reprs, pickles).
for _error in (
    MoeOverlapError,
    ConfigError,
    IntegrationError,
    TypeHintError,
    LayerStateAttributeError,
    NodeStateError,
    PlanReleasedError,
    StreamError,
    WgradError,
    ScheduleError,
):
    _error.__module__ = "moe_overlap.errors"
del _error

FREED_MEMORY_HINT = (
    "hint: a tensor released by the free-input policy was read again (a slot returned or "
    "kept its input, or autograd saved it for backward); rerun with MOE_OVERLAP_DEBUG=1 to "
    "find the slot at forward, see the free-input rules in docs/integrate.md, or pass "
    "ScheduleOptions(free_input=False)"
)

# What torch says when a kernel touches a storage that ``resize_(0)`` emptied.
_FREED_MESSAGES = ("data is not allocated yet", "setStorage", "out of bounds for storage")


def freed_memory_hint(exc: BaseException) -> str:
    """:data:`FREED_MEMORY_HINT` when ``exc`` looks like a read of freed input memory."""
    text = str(exc)
    return FREED_MEMORY_HINT if any(m in text for m in _FREED_MESSAGES) else ""
