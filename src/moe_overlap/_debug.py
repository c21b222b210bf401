"""Debug mode: ``MOE_OVERLAP_DEBUG=1`` before import checks every call with beartype."""

from __future__ import annotations

import os

__all__ = ["DEBUG_ENV", "debug_enabled"]

DEBUG_ENV = "MOE_OVERLAP_DEBUG"


def debug_enabled() -> bool:
    """Whether the environment asks for runtime type checking (read at import time)."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() in {"1", "true", "yes", "on"}
