"""docs/torchtitan_families.md is what ``tests.adapters.titan_families`` finds now."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torchtitan")

from tests.adapters import titan_families

DOCS = Path(__file__).resolve().parents[2] / "docs" / "torchtitan_families.md"


@pytest.mark.slow
def test_the_families_table_is_current_and_nothing_is_wrong() -> None:
    found = titan_families.rows()
    wrong = [r for r in found if r.status == "WRONG"]
    assert not wrong, f"the adapter is not exact on {wrong}"
    assert {r.family for r in found if r.status == "supported"} >= {
        "deepseek_v3",
        "qwen3",
        "gpt_oss",
        "kimi_k2_7",
    }
    assert DOCS.read_text() == titan_families.render(found), (
        "docs/torchtitan_families.md is stale: run `python -m tests.adapters.titan_families "
        "--write docs/torchtitan_families.md`"
    )
