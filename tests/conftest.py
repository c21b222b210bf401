"""Shared fixtures: deterministic CPU runs."""

from __future__ import annotations

import pytest
import torch

from moe_overlap.engine._streams import reset_streams


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    reset_streams()
