"""Pipeline stages checkpointed with ``torch.distributed.checkpoint``, per rank, on gloo.

Stages name their tensors as the full model does, so the ranks' checkpoints never collide
and any layout loads them: PP=2 save, load in fresh processes, training continues
bit-identically; PP=2 -> PP=1 and PP=1 -> PP=2 restore parameters and AdamW states bit for
bit; the transformers stages save and load once. Two launches of two ranks
(``ckpt_pp_worker.py``) do every check; the single-process PP=1 side runs here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from tests.gloo_ranks import run_ranks
from tests.integrations.ckpt_pp_worker import FLAT, HF_CASE, LR, REF_CASE, plain, same, scramble
from tests.integrations.pp_worker import batch, build, loss_fn

pytest.importorskip("transformers")


def _launch(phase: int, folder: Path) -> list[dict[str, Any]]:
    os.environ["CKPT_CASE"] = json.dumps({"phase": phase, "dir": str(folder)})
    try:
        rows = run_ranks("tests.integrations.ckpt_pp_worker", world=2, timeout=300)
    finally:
        del os.environ["CKPT_CASE"]
    return sorted((dict(r) for r in rows), key=lambda r: int(r["rank"]))


def _state(model: Any, opt: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    return {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, opt, options=FLAT),
    }


def _whole_model_pp1(folder: Path) -> set[str]:
    """PP=1: the whole model trained 2 steps (plain backward, AdamW), saved in one process."""
    built = build(REF_CASE, None, delay=False)
    model = built.model
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    n = REF_CASE["microbatches"]
    for step in range(2):
        model.zero_grad(set_to_none=True)
        x, y = batch(REF_CASE, step)
        for xs, ys in zip(x.chunk(n), y.chunk(n), strict=True):
            (loss_fn(built.logits(xs, None), ys) / n).backward()
        opt.step()
    state = _state(model, opt)
    torch.save(plain(state), folder / "pp1.pt")
    dcp_save(state, checkpoint_id=str(folder / "pp1"), no_dist=True)
    return set(state["model"])


def _load_whole_model(folder: Path) -> tuple[list[str], list[str]]:
    """PP=2 -> PP=1: the two ranks' stage checkpoint into the whole model (other weights)."""
    built = build(REF_CASE, None, delay=False)
    model = built.model
    scramble(model, 5)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    state = _state(model, opt)
    dcp_load(state, checkpoint_id=str(folder / "pp2"), no_dist=True)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"], options=FLAT)
    saved: dict[str, dict[str, Any]] = {"model": {}, "optim": {}}
    for rank in range(2):
        part = torch.load(folder / f"pp2_{rank}.pt")
        for k in saved:
            saved[k].update(part[k])
    got = _state(model, opt)
    return same(got["model"], saved["model"]), same(got["optim"], saved["optim"])


def _hf_model() -> Any:
    model = build(HF_CASE, None, delay=False).model
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def _whole_hf_pp1(folder: Path) -> None:
    """The whole transformers model, one step of its own forward and loss, saved."""
    model, opt = _hf_model()
    x, y = batch(HF_CASE, 0)
    n = HF_CASE["microbatches"]
    for xs, ys in zip(x.chunk(n), y.chunk(n), strict=True):
        (loss_fn(model(input_ids=xs).logits, ys) / n).backward()
    opt.step()
    state = _state(model, opt)
    torch.save(plain(state), folder / "hf1.pt")
    dcp_save(state, checkpoint_id=str(folder / "hf1"), no_dist=True)


def _load_whole_hf(folder: Path) -> list[str]:
    """The transformers stages' checkpoint (``hf2/``) into the whole transformers model."""
    model, opt = _hf_model()
    scramble(model, 6)
    state = _state(model, opt)
    dcp_load(state, checkpoint_id=str(folder / "hf2"), no_dist=True)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"], options=FLAT)
    saved: dict[str, dict[str, Any]] = {"model": {}, "optim": {}}
    for rank in range(2):
        part = torch.load(folder / f"hf2_{rank}.pt")
        for k in saved:
            saved[k].update(part[k])
    got = _state(model, opt)
    return same(got["model"], saved["model"]) + same(got["optim"], saved["optim"])


def test_pipeline_stages_checkpoint_and_reshard_exactly(tmp_path: Path) -> None:
    pp1_keys = _whole_model_pp1(tmp_path)
    _whole_hf_pp1(tmp_path)
    first = _launch(1, tmp_path)
    assert all(r["same_first_steps"] for r in first)
    keys = [set(r["keys"]) for r in first]
    assert not keys[0] & keys[1], "the ranks' stages share no key"
    assert keys[0] | keys[1] == pp1_keys, "stage keys are the whole model's names"
    assert any(k.startswith("decoder.layers.5.") for k in keys[1] | keys[0])

    model_diff, optim_diff = _load_whole_model(tmp_path)
    assert model_diff == [] and optim_diff == [], (model_diff, optim_diff)

    second = _launch(2, tmp_path)
    for row in second:
        where = f"rank {row['rank']}"
        assert row["differed_before_load"], f"{where}: the fresh models started elsewhere"
        assert row["load_diff"] == [], f"{where}: {row['load_diff']}"
        assert row["losses_identical"], f"{where}: steps 3-4 after the load differ"
        assert row["grad_diff"] == [] and row["param_diff"] == [], where
        assert row["pp1_diff"] == [], f"{where}: PP=1 -> PP=2 {row['pp1_diff']}"
        assert row["hf_diff"] == [], f"{where}: {row['hf_diff']}"
    assert set(second[0]["pp1_keys"]) | set(second[1]["pp1_keys"]) == pp1_keys
    hf_keys = [set(r["hf_keys"]) for r in second]
    assert not hf_keys[0] & hf_keys[1]
    whole_hf = set(torch.load(tmp_path / "hf1.pt")["model"])
    assert hf_keys[0] | hf_keys[1] == whole_hf
    assert _load_whole_hf(tmp_path) == []
