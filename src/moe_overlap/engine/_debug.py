"""Debug mode: ``MOE_OVERLAP_DEBUG=1`` before import checks every call with beartype.

It also turns on the costly checks that read :data:`DEBUG`: the autograd-graph walks of the
layer nodes (``_node.py``, ``_layer_node.py``) and the first-step comparison of the
schedule with the model's plain forward (``_plain_check.py``, run by ``combined_1f1b``).
"""

from __future__ import annotations

import os

__all__ = ["DEBUG", "DEBUG_ENV", "debug_enabled", "install_beartype"]

DEBUG_ENV = "MOE_OVERLAP_DEBUG"


def debug_enabled() -> bool:
    """Whether the environment asks for runtime type checking (read at import time)."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


DEBUG = debug_enabled()
"""Read once, at import: debug mode's costly checks (saved-tensor hooks, ...) are on."""


def install_beartype() -> None:
    """Check every later-imported module of the package with beartype.

    Violations raise :class:`~moe_overlap.TypeHintError` (an ``IntegrationError``, so a
    ``TypeError``); an ``int`` is accepted where the hint says ``float`` (PEP 484's
    numeric tower). Protocol-typed parameters are not checked per call (an
    ``isinstance`` against a runtime Protocol costs microseconds and, on Python 3.12+,
    misses ``nn.Module`` submodules): beartype sees them as ``object``, and plans check
    integrations once, at construction, member by member.
    """
    from beartype import BeartypeConf, FrozenDict
    from beartype.claw import beartype_package

    from moe_overlap.engine import _protocols as protocols
    from moe_overlap.engine._errors import TypeHintError

    members = [getattr(protocols, name) for name in protocols.__all__]
    overrides: dict[object, object] = {
        p: object for p in members if getattr(p, "_is_protocol", False)
    }
    beartype_package(
        "moe_overlap",
        conf=BeartypeConf(
            hint_overrides=FrozenDict(overrides),
            is_pep484_tower=True,
            violation_type=TypeHintError,
        ),
    )
