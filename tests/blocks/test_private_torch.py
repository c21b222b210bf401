"""torch's private names in ``moe_overlap.blocks`` live in ``_torch_private.py`` alone.

Every other module of the subpackage is parsed (:mod:`tests.private_torch`); a private
torch name there fails, so a torch release that moves one breaks that module alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import moe_overlap.blocks as blocks
from tests.private_torch import private_torch_uses

PACKAGE = Path(blocks.__file__).resolve().parent
OWNER = "_torch_private.py"
MODULES = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py"))


def test_the_owner_uses_private_torch_names() -> None:
    """The check sees the owner's names: it would see them elsewhere."""
    uses = "\n".join(private_torch_uses((PACKAGE / OWNER).read_text()))
    for name in ("torch._grouped_mm", "_pytree", "'_scaled_dot_product_flash_attention'"):
        assert name in uses


@pytest.mark.parametrize("module", [m for m in MODULES if m != OWNER])
def test_no_private_torch_name_outside_its_module(module: str) -> None:
    uses = private_torch_uses((PACKAGE / module).read_text())
    assert not uses, f"blocks/{module} uses private torch names (move them to {OWNER}): {uses}"
