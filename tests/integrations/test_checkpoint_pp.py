"""Pipeline stages checkpointed with ``torch.distributed.checkpoint``, per rank, on gloo.

Stages name their tensors as the full model does, so the ranks' checkpoints never collide
and any layout loads them: PP=2 and PP=2 x EP=2 save, load in fresh processes, training
continues bit-identically; PP=2 -> PP=1, PP=2 x EP=2 -> PP=1 x EP=1, PP=1 -> PP=2 and
PP=1 x EP=1 -> PP=2 x EP=2 restore parameters and AdamW states bit for bit; the
transformers stages save and load once. The launches are the ``checkpoint_layouts``
fixture's (``conftest.py``; this file's parts: ``ckpt_pp_worker.py``); the single-process
PP=1 side runs here.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.integrations.ckpt_pp_worker import (
    LR,
    PPEP_CASE,
    REF_CASE,
    load_whole,
    scramble,
    whole_hf,
)
from tests.integrations.conftest import Layouts
from tests.integrations.pp_worker import build

pytest.importorskip("transformers")


def _whole_model(case: dict[str, Any], seed: int) -> tuple[Any, torch.optim.Optimizer]:
    """The whole model of ``case`` at PP=1 x EP=1, other weights than any saved."""
    model = build(case, None, delay=False).model
    scramble(model, seed)
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def _resumed(rows: list[dict[str, Any]], whole_keys: set[str]) -> None:
    """A layout's load rows: exact resume, and PP=1 (x EP=1) loaded exactly."""
    for row in rows:
        where = f"rank {row['rank']}"
        assert row["differed_before_load"], f"{where}: the fresh models started elsewhere"
        assert row["load_diff"] == [], f"{where}: {row['load_diff']}"
        assert row["losses_identical"], f"{where}: steps 3-4 after the load differ"
        assert row["grad_diff"] == [] and row["param_diff"] == [], where
        assert row["pp1_diff"] == [], f"{where}: PP=1 -> this layout {row['pp1_diff']}"
    assert set().union(*(r["pp1_keys"] for r in rows)) == whole_keys


@pytest.mark.slow
def test_pipeline_stages_checkpoint_and_reshard_exactly(checkpoint_layouts: Layouts) -> None:
    folder, whole_keys = checkpoint_layouts.folder, checkpoint_layouts.whole_keys
    first = checkpoint_layouts.rows("save", "pp")
    assert [r["rank"] for r in first] == [2, 3]
    assert all(r["same_first_steps"] for r in first)
    keys = [set(r["keys"]) for r in first]
    assert not keys[0] & keys[1], "the ranks' stages share no key"
    assert keys[0] | keys[1] == whole_keys, "stage keys are the whole model's names"
    assert any(k.startswith("decoder.layers.5.") for k in keys[1] | keys[0])

    model, opt = _whole_model(REF_CASE, 5)
    assert load_whole(model, opt, str(folder), "pp2") == [], "PP=2 -> PP=1"

    second = checkpoint_layouts.rows("load", "pp")
    _resumed(second, whole_keys)
    for row in second:
        assert row["hf_diff"] == [], f"rank {row['rank']}: {row['hf_diff']}"
    hf_keys = [set(r["hf_keys"]) for r in second]
    assert not hf_keys[0] & hf_keys[1]
    whole_hf_keys = set(torch.load(folder / "hf1.pt")["model"])
    assert hf_keys[0] | hf_keys[1] == whole_hf_keys
    hf, hf_opt = whole_hf()
    scramble(hf, 6)
    assert load_whole(hf, hf_opt, str(folder), "hf2") == [], "transformers PP=2 -> PP=1"


@pytest.mark.slow
def test_pipeline_x_expert_parallel_checkpoint_and_reshard_exactly(
    checkpoint_layouts: Layouts,
) -> None:
    """PP=2 x EP=2 (ranks ``2 p + e``: pipeline rank ``p``, EP rank ``e``), delayed weight
    gradients, AdamW: resumed in fresh processes bit-identically; resharded to and from the
    whole model in one process (PP=1 x EP=1) bit for bit."""
    folder, whole_keys = checkpoint_layouts.folder, checkpoint_layouts.whole_keys
    first = checkpoint_layouts.rows("save", "ppep")
    assert [r["rank"] for r in first] == [0, 1, 2, 3]
    assert all(r["same_first_steps"] for r in first)
    keys = [set(r["keys"]) for r in first]
    assert keys[0] == keys[1] and keys[2] == keys[3], "an EP group's ranks hold one stage set"
    assert not keys[0] & keys[2] and keys[0] | keys[2] == whole_keys

    model, opt = _whole_model(PPEP_CASE, 7)
    assert load_whole(model, opt, str(folder), "ppep2") == [], "PP=2 x EP=2 -> PP=1 x EP=1"

    _resumed(checkpoint_layouts.rows("load", "ppep"), whole_keys)
