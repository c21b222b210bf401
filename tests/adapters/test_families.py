"""Every MoE family of the installed transformers: supported exactly, or refused at
construction with a reason; never accepted and wrong. The docs' table is current."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from tests.adapters._hf import ON_OLD_TORCH
from tests.adapters.families import KNOWN_BOUNDS, Row, run_all, table

DOCS = Path(__file__).resolve().parents[2] / "docs" / "families.md"

REQUIRED = (
    "deepseek_v3",
    "deepseek_v2",
    "glm4_moe",
    "ernie4_5_moe",
    "dots1",
    "gpt_oss",
    "llama4",
    "granitemoe",
    "phimoe",
    "minimax_m2",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
)


@pytest.fixture(scope="module")
def rows() -> list[Row]:
    return run_all()


def test_no_family_is_accepted_and_wrong(rows: list[Row]) -> None:
    wrong = [r for r in rows if r.status == "wrong"]
    assert wrong == [], wrong


@ON_OLD_TORCH
def test_required_families_are_supported(rows: list[Row]) -> None:
    status = {r.family: r.status for r in rows}
    assert {f: status.get(f) for f in REQUIRED} == dict.fromkeys(REQUIRED, "supported")


def test_supported_families_say_how_they_compare_with_the_model(rows: list[Row]) -> None:
    """Each supported family is bit-identical to the model's own forward and backward, or
    within its stated bound (a difference without one makes it *wrong*, above)."""
    vs = {r.family: r.vs_original for r in rows if r.status == "supported"}
    assert all(v == "bit-identical" or v.startswith("within ") for v in vs.values()), vs


def test_known_bounds_are_needed(rows: list[Row]) -> None:
    """A family listed in KNOWN_BOUNDS that is now bit-identical makes the list stale."""
    vs = {r.family: r.vs_original for r in rows}
    stale = [f for f in KNOWN_BOUNDS if vs.get(f) == "bit-identical"]
    assert stale == [], f"remove {stale} from KNOWN_BOUNDS (tests/adapters/families.py)"


def test_refusals_give_a_reason(rows: list[Row]) -> None:
    assert all(r.detail for r in rows if r.status in ("refused", "not built"))


@ON_OLD_TORCH
def test_docs_table_is_current(rows: list[Row]) -> None:
    assert DOCS.read_text() == table(rows), (
        "docs/families.md is stale: run `python -m tests.adapters.families --write "
        "docs/families.md`"
    )
