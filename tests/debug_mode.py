"""What a refusal raises in this process's mode: the library's ``ConfigError``, or in debug mode
(``MOE_OVERLAP_DEBUG=1``) beartype's ``TypeHintError`` first where the value breaks the
parameter's annotation itself (a string where the hint says ``int``)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from moe_overlap import ConfigError
from moe_overlap.engine import DEBUG
from moe_overlap.errors import TypeHintError

__all__ = ["refusal"]


def refusal(pattern: str, hinted: str | None = None) -> Any:
    """``pytest.raises`` for a refusal matching ``pattern``; in debug mode, when ``hinted`` names
    the parameter whose annotation the value breaks, beartype's error naming that parameter."""
    if DEBUG and hinted is not None:
        return pytest.raises(TypeHintError, match=rf"parameter {re.escape(hinted)}=")
    return pytest.raises(ConfigError, match=pattern)
