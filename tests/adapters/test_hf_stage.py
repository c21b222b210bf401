"""TransformersMoEStage: a range of an adapted model's layers as one pipeline stage."""

from __future__ import annotations

import pytest
import torch

from moe_overlap import ConfigError
from moe_overlap.adapters.transformers import TransformersMoEAdapter, TransformersMoEStage
from tests.adapters._hf import qwen3_moe

pytest.importorskip("transformers")


def test_stages_own_every_parameter_once_and_chain_to_the_model_s_logits() -> None:
    model = qwen3_moe()
    adapter = TransformersMoEAdapter(model)
    stages = [TransformersMoEStage(adapter, r) for r in (range(0, 1), range(1, 3))]
    owned = [id(p) for s in stages for p in s.parameters()]
    assert len(owned) == len(set(owned))
    assert set(owned) == {id(p) for p in model.parameters()}
    assert [s.pre_process for s in stages] == [True, False]
    assert [s.post_process for s in stages] == [False, True]
    x = torch.randint(0, 64, (2, 8))
    logits = stages[1](stages[0](x))
    want = model(input_ids=x).logits
    assert torch.allclose(logits, want, rtol=1e-5, atol=1e-6)


def test_tied_embeddings_split_over_stages_are_refused() -> None:
    adapter = TransformersMoEAdapter(qwen3_moe(tie_word_embeddings=True))
    TransformersMoEStage(adapter, range(0, 3))  # one stage holds both ends: fine
    with pytest.raises(ConfigError, match=r"tied weights\); expected them on one stage"):
        TransformersMoEStage(adapter, range(0, 1))


def test_the_router_aux_loss_and_a_bad_range_are_refused() -> None:
    adapter = TransformersMoEAdapter(qwen3_moe(output_router_logits=True))
    with pytest.raises(ConfigError, match="router aux loss sums over every layer"):
        TransformersMoEStage(adapter, range(0, 1))
    plain = TransformersMoEAdapter(qwen3_moe())
    for bad in (range(2, 1), range(1, 4), range(0, 3, 2)):
        with pytest.raises(ConfigError, match=r"expected layers as range\(a, b\)"):
            TransformersMoEStage(plain, bad)


def test_a_stage_without_layers_between_two_passes_the_hidden_states_on() -> None:
    """It holds nothing and returns its input (at either end it is refused:
    tests/integrations/test_step_inputs.py); its repr said ``layers=1..0``."""
    adapter = TransformersMoEAdapter(qwen3_moe())
    stages = [TransformersMoEStage(adapter, r) for r in (range(0, 1), range(1, 1), range(1, 3))]
    assert not list(stages[1].parameters())
    assert "layers=none (at 1), pre_process=False, post_process=False" in repr(stages[1])
    hidden = stages[0](torch.randint(0, 64, (2, 8)))
    assert stages[1](hidden) is hidden
