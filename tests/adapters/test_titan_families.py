"""docs/torchtitan_families.md is what ``tests.adapters.titan_families`` finds now."""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")

from tests import forked
from tests.adapters import titan_families
from tests.gloo_ranks import worker_env

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "torchtitan_families.md"


ASIDE = ("qwen3",)
"""Checked in a second process: about as long as all the other families together."""


def _rows() -> list[titan_families.Row]:
    """Every family's row, in order: :data:`ASIDE` checked in a second process (``python -m
    tests.adapters.titan_families --json``, forked from a zygote) on the other core while
    this one checks the rest."""
    names = titan_families.families()
    argv = [sys.executable, "-m", "tests.adapters.titan_families", "--json"]
    argv += [a for family in names if family in ASIDE for a in ("--family", family)]
    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(forked.run, argv, timeout=900, cwd=ROOT, env=worker_env())
        here = titan_families.rows([f for f in names if f not in ASIDE])
        done = other.result()
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = [json.loads(line) for line in done.stdout.splitlines() if line[:1] == "{"]
    by_family = {r.family: r for r in [*here, *(titan_families.Row(**r) for r in theirs)]}
    assert sorted(by_family) == names, (sorted(by_family), names)
    return [by_family[f] for f in names]


@pytest.mark.slow
def test_the_families_table_is_current_and_nothing_is_wrong() -> None:
    found = _rows()
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
