"""Stages name layers by their global index; plain state dicts round trip (one process)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
)

from moe_overlap import ConfigError
from moe_overlap.blocks import StageLayers
from moe_overlap.models import GPTMoEConfig, GPTMoEModel, GPTMoEStage
from tests.adapters._hf import qwen3_moe

CONFIG = GPTMoEConfig(
    num_layers=4,
    first_k_dense=1,
    hidden_size=32,
    ffn_hidden_size=64,
    num_experts=4,
    moe_ffn_hidden_size=16,
    moe_router_topk=2,
)


def _scrambled(model: nn.Module, seed: int) -> nn.Module:
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=gen))
    return other


def test_stage_layers_are_a_list_by_position_and_global_by_name() -> None:
    mods = [nn.Linear(2, 2) for _ in range(3)]
    layers = StageLayers(mods, start=4)
    assert isinstance(layers, nn.ModuleList)
    assert len(layers) == 3 and list(layers) == mods
    assert layers[0] is mods[0] and layers[-1] is mods[2]
    assert layers.global_indices() == [4, 5, 6] and layers.global_index(-1) == 6
    assert [n for n, _ in layers.named_children()] == ["4", "5", "6"]
    assert list(layers.state_dict())[:2] == ["4.weight", "4.bias"]
    assert getattr(layers, "5") is mods[1]  # what DCP's name resolution walks
    tail = layers[1:]
    assert tail.global_indices() == [5, 6]
    with pytest.raises(IndexError):
        layers.global_index(3)
    with pytest.raises(IndexError):
        _ = layers[-4]
    replacement = nn.Linear(2, 2)
    layers[1] = replacement
    assert layers[1] is replacement and layers.global_indices() == [4, 5, 6]
    layers.append(nn.Linear(2, 2))
    assert layers.global_indices() == [4, 5, 6, 7]
    del layers[0]
    assert layers.global_indices() == [5, 6, 7] and layers[0] is replacement
    assert layers.pop(-1) is not None and layers.global_indices() == [5, 6]
    both = StageLayers([nn.Linear(2, 2)], start=0) + layers
    assert both.global_indices() == [0, 5, 6]
    assert "(5): Linear" in repr(layers)
    with pytest.raises(ConfigError, match=r"StageLayers \+: expected lists of distinct layers"):
        _ = layers + layers
    with pytest.raises(ConfigError, match="StageLayers.insert: a layer inserted"):
        layers.insert(0, nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="StageLayers: expected start as an int >= 0"):
        StageLayers(mods, start=-1)
    copied = copy.deepcopy(layers)
    copied.append(nn.Linear(2, 2))
    assert copied.global_indices() == [5, 6, 7]


def test_stages_use_the_whole_model_s_names() -> None:
    model = GPTMoEModel(CONFIG)
    stages = [GPTMoEStage(model, r) for r in (range(0, 2), range(2, 4))]
    whole = model.state_dict()
    keys = [list(s.state_dict()) for s in stages]
    assert keys[0] + keys[1] == list(whole)
    assert keys[1][0].startswith("decoder.layers.2.") and keys[1][-1] == "output_layer.weight"
    for s in stages:
        for name, p in s.named_parameters():
            assert model.get_parameter(name) is p
        assert [s.decoder.layers[i] for i in range(len(s.decoder.layers))] == list(
            model.layer_list[s.layers_range.start : s.layers_range.stop]
        )
        # DCP's helpers resolve every key on the stage (model and optimizer state).
        opt = torch.optim.AdamW(s.parameters())
        flat = StateDictOptions(flatten_optimizer_state_dict=True)
        assert list(get_model_state_dict(s)) == list(s.state_dict())
        names = {
            k.split(".", 1)[1].rpartition(".")[0]
            for k in get_optimizer_state_dict(s, opt, options=flat)
            if k.startswith("state.")
        }
        assert names == {n for n, _ in s.named_parameters()}


def test_plain_state_dicts_between_stages_and_the_whole_model() -> None:
    """Torch's own semantics: strict loads refuse the other stages' keys, strict=False
    loads exactly this stage's and lists the rest."""
    model = GPTMoEModel(CONFIG)
    other = _scrambled(model, 1)
    assert isinstance(other, GPTMoEModel)
    stage = GPTMoEStage(other, range(2, 4))
    whole = model.state_dict()
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\).*decoder\.layers\.0\."):
        stage.load_state_dict(whole)
    result = stage.load_state_dict(whole, strict=False)
    assert result.missing_keys == []
    assert set(result.unexpected_keys) == set(whole) - set(stage.state_dict())
    for k, v in stage.state_dict().items():
        assert torch.equal(v, whole[k]), k
    assert not torch.equal(other.embedding.weight, model.embedding.weight)  # not this stage's
    # The whole model from a stage's state dict: strict=False fills this stage's part.
    fresh = _scrambled(model, 2)
    back = fresh.load_state_dict(GPTMoEStage(model, range(0, 2)).state_dict(), strict=False)
    assert set(back.missing_keys) == set(stage.state_dict())
    set_model_state_dict(stage, whole, options=StateDictOptions(strict=False))
    # A plain round trip of the whole model.
    again = _scrambled(model, 3)
    again.load_state_dict(whole)
    assert all(torch.equal(v, whole[k]) for k, v in again.state_dict().items())


def _qwen3_moe() -> nn.Module:
    """The shared Qwen3-MoE with layer 1 dense."""
    return qwen3_moe(mlp_only_layers=[1])


def test_transformers_stages_and_save_pretrained_keep_the_model_s_names(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from moe_overlap.adapters.transformers import TransformersMoEAdapter, TransformersMoEStage

    model: Any = _qwen3_moe()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    adapter = TransformersMoEAdapter(
        model, delay_wgrad_compute=True, recompute=("attention", "norm")
    )
    assert list(model.state_dict()) == list(before)
    stages = [TransformersMoEStage(adapter, r) for r in (range(0, 1), range(1, 2), range(2, 3))]
    keys = [list(s.state_dict()) for s in stages]
    assert keys[0] + keys[1] + keys[2] == list(before)
    assert keys[1][0].startswith("model.layers.1.")
    for s in stages:
        for name, p in s.named_parameters():
            assert model.get_parameter(name) is p
        assert list(get_model_state_dict(s)) == list(s.state_dict())
    # Patched modules (delayed-wgrad linears, recomputed attention and norms) save as the
    # unwrapped model and load back bit for bit.
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path)
    after = loaded.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_transformers_stage_refuses_a_model_name_that_shadows_a_stage_member() -> None:
    pytest.importorskip("transformers")
    from moe_overlap.adapters.transformers import TransformersMoEAdapter, TransformersMoEStage

    model: Any = _qwen3_moe()
    adapter = TransformersMoEAdapter(model)
    model.add_module("decoder", model.lm_head)  # the LM head also under a stage member's name
    with pytest.raises(ConfigError, match=r"the model's 'decoder' would be named like the stage"):
        TransformersMoEStage(adapter, range(2, 3))
