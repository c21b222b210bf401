"""Exact DCP checkpoints under EP and FSDP2 x EP, with resharding, on real gloo ranks.

The layouts save in one launch and load in a fresh one (the ``checkpoint_layouts``
fixture of ``conftest.py``; this file's parts: ``ckpt_worker.py``), in the same and in
other layouts.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from moe_overlap import ConfigError
from moe_overlap.integrations.checkpoint import expert_shards, register_expert_shards
from moe_overlap.models import GPTMoEConfig, GPTMoEModel
from tests.gloo_ranks import torchrun
from tests.integrations.conftest import Layouts

SAVE = [
    "experts_are_dtensors",
    "optimizer_states_are_dtensors",
    "plain_round_trip",
    "ep1_state_dict_plain",
]
FSDP_SAVE = ["fsdp_experts_2d"]
FSDP_RESUME = ["fsdp_loaded_equals_saved", "fsdp_resume_bit_identical"]
LOAD = [
    "ep2_loaded_equals_saved",
    "ep2_resume_bit_identical",
    "ep2_to_ep1",
    "ep1_plain_tensors",
    "ep1_to_ep2",
    "fsdp_dp2_to_dp1",
    "hf_resume_bit_identical",
    "hf_ep2_to_ep1_equals_gather_experts",
    "other_rank_state_dict_refused",
    "local_rows_refused",
    "full_tensor_sliced",
    "fsdp_without_expert_mesh_refused",
    "adagrad_state_attached",
    "odd_optimizer_state_refused",
    "register_wrong_shape_refused",
    "fsdp_unregistered_refused",
    "deepcopy_keeps_optimizer_exposure",
]


def _checks(rows: list[dict[str, object]], ranks: range, checks: list[str]) -> None:
    """Every rank of ``ranks`` reported exactly ``checks``, in order, all passed."""
    for rank in ranks:
        mine = [r for r in rows if r["rank"] == rank and r["check"] in checks]
        assert [r["check"] for r in mine] == checks, (rank, mine)
        failed = [r for r in mine if not r["ok"]]
        assert failed == [], (rank, failed)


@pytest.mark.slow
def test_checkpoints_are_exact_in_every_layout(checkpoint_layouts: Layouts) -> None:
    """Save (EP=2, EP=1, the adapter at EP=2 on ranks 0-1; FSDP2 DP=2 x EP=2 on four), then
    in fresh processes: resume bit-identically, and load EP=2 -> EP=1, EP=1 -> EP=2,
    DP=2 -> DP=1 exactly."""
    _checks(checkpoint_layouts.save, range(4), FSDP_SAVE)
    _checks(checkpoint_layouts.save, range(2), SAVE)
    _checks(checkpoint_layouts.load, range(4), FSDP_RESUME)
    _checks(checkpoint_layouts.load, range(2), LOAD)
    ep_only = set(SAVE + LOAD)
    rows = checkpoint_layouts.save + checkpoint_layouts.load
    assert not [r for r in rows if r["rank"] >= 2 and r["check"] in ep_only], "ranks 2-3 run PP"


def test_ep1_state_dict_is_plain_and_loads_into_the_plain_model() -> None:
    config = GPTMoEConfig(hidden_size=16, num_layers=2, num_attention_heads=2, num_experts=4)
    model = GPTMoEModel(config, ep_group=None)
    assert register_expert_shards(model, ["embedding.weight"], num_experts=4, group=None) is None
    assert all(expert_shards(m) is None for m in model.modules())
    state = model.state_dict()
    assert all(type(v) is Tensor for v in state.values())
    other = GPTMoEModel(config)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    other.load_state_dict(state)
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters(), strict=True)
    )


def test_register_expert_shards_checks_the_names_without_an_ep_group() -> None:
    """A misspelt or repeated name was taken without a word at EP=1 (nothing to register)
    and refused only when the same code ran under EP."""
    with pytest.raises(ConfigError, match=r"expected a parameter 'wieght', received none"):
        register_expert_shards(nn.Linear(2, 2), ["wieght"], num_experts=2, group=None)
    with pytest.raises(ConfigError, match=r"expected each expert tensor name once, received"):
        register_expert_shards(nn.Linear(2, 2), ["weight", "weight"], num_experts=2, group=None)
    assert register_expert_shards(nn.Linear(2, 2), ["weight"], num_experts=2, group=None) is None


def test_adapter_at_ep1_keeps_the_transformers_state_dict() -> None:
    pytest.importorskip("transformers")
    from moe_overlap.adapters.transformers import TransformersMoEAdapter
    from tests.adapters._hf import mixtral

    model = mixtral()
    TransformersMoEAdapter(model)
    state = model.state_dict()
    assert all(type(v) is Tensor for v in state.values())
    fresh = mixtral(seed=1)
    fresh.load_state_dict(state)
    assert all(torch.equal(state[k], v) for k, v in fresh.state_dict().items())


SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "checkpoint.py"


@pytest.mark.slow
def test_example_resumes_exactly(tmp_path: Path) -> None:
    out = torchrun(SCRIPT, 2, "--ep", "2", "--dir", str(tmp_path), timeout=240)
    assert f"wrote {tmp_path / 'ckpt'}" in out, out
    assert (tmp_path / "ckpt" / ".metadata").exists()
    out = torchrun(SCRIPT, 2, "--ep", "2", "--dir", str(tmp_path), "--resume", timeout=240)
    assert re.search(r"at EP=2: global tensors equal: True", out), out
    assert "matches the uninterrupted run: True" in out, out
