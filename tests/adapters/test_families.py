"""Every MoE family of the installed transformers: supported exactly, or refused at
construction with a reason; never accepted and wrong. The docs' table is current."""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from tests import forked
from tests.adapters._hf import ON_OLD_TORCH
from tests.adapters.families import KNOWN_BOUNDS, Row, discover, run_all, table
from tests.gloo_ranks import worker_env

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "families.md"

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
    """Every family's row (in :func:`discover`'s order): every other family checked in this
    process while a second one (``python -m tests.adapters.families --json``, forked from a
    zygote) checks the rest on the other core."""
    found = discover()
    there = found[1::2]
    argv = [sys.executable, "-m", "tests.adapters.families", "--json"]
    argv += [a for family, _ in there for a in ("--family", family)]
    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(forked.run, argv, timeout=900, cwd=ROOT, env=worker_env())
        here = run_all(families=[family for family, _ in found[0::2]])
        done = other.result()
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = [Row(**json.loads(line)) for line in done.stdout.splitlines() if line[:1] == "{"]
    by_family = {(r.family, r.causal_lm): r for r in [*here, *theirs]}
    assert sorted(by_family) == sorted(found), (sorted(by_family), sorted(found))
    return [by_family[f] for f in found]


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
