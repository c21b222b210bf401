"""The transformers adapter's recomputation: exact against storing and the model's forward."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from moe_overlap import ConfigError, combined_1f1b
from moe_overlap.adapters.transformers import TransformersMoEAdapter
from tests.saved_bytes import RECOMPUTED, Recomputed, SavedBytes, saved_bytes

from ._hf import (
    GRAD_RTOL,
    LOSS_ATOL,
    adapter_step,
    grads,
    max_rel_diff,
    microbatches,
    mixtral,
    qwen2_moe,
    reference_step,
)

pytest.importorskip("transformers")


@pytest.mark.parametrize("family", [mixtral, qwen2_moe])
@pytest.mark.parametrize("delay", [False, True])
def test_recomputed_adapter_is_exact(family: Callable[[], nn.Module], delay: bool) -> None:
    model = family()
    mbs = microbatches(3, padded=True)
    recomputed = copy.deepcopy(model)
    stored = copy.deepcopy(model)
    a = TransformersMoEAdapter(
        recomputed, delay_wgrad_compute=delay, recompute=("attention", "norm")
    )
    b = TransformersMoEAdapter(stored, delay_wgrad_compute=delay)
    la = adapter_step(a, mbs, overlap=True)
    lb = adapter_step(b, mbs, overlap=True)
    assert [float(x) for x in la] == [float(x) for x in lb]
    ga, gb = grads(recomputed), grads(stored)
    assert all(torch.equal(ga[k], gb[k]) for k in ga), "recomputing changed a gradient"
    ref = copy.deepcopy(model)
    ref_losses = reference_step(ref, mbs)
    gr = grads(ref)
    assert max(abs(float(x) - float(y)) for x, y in zip(la, ref_losses, strict=True)) <= LOSS_ATOL
    assert max(max_rel_diff(ga[k], gr[k]) for k in ga) <= GRAD_RTOL


def test_recompute_patches_the_model_s_own_modules() -> None:
    model: Any = mixtral()
    TransformersMoEAdapter(model, recompute=("attention",))
    layer = model.model.layers[0]
    assert "_moe_overlap_recompute" in layer.self_attn.__dict__
    assert "_moe_overlap_recompute" not in layer.input_layernorm.__dict__
    copied = copy.deepcopy(layer)  # a copy recomputes its own forward, not the original's
    assert copied.self_attn.forward.__self__ is copied.self_attn


def test_parts_inside_transformers_modules_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"received also \['activation'\]"):
        TransformersMoEAdapter(mixtral(), recompute=("norm", "activation"))


def test_recomputed_attention_runs_again_in_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    model: Any = mixtral()
    cls = type(model.model.layers[0].self_attn)
    original = cls.forward
    calls = {"n": 0}

    def counted(self: object, *args: object, **kwargs: object) -> object:
        calls["n"] += 1
        return original(self, *args, **kwargs)

    counts: dict[bool, int] = {}
    for on in (False, True):
        adapter = TransformersMoEAdapter(
            copy.deepcopy(model), recompute=("attention",) if on else ()
        )
        monkeypatch.setattr(cls, "forward", counted)
        calls["n"] = 0
        adapter_step(adapter, microbatches(2), overlap=True)
        monkeypatch.setattr(cls, "forward", original)
        counts[on] = calls["n"]
    assert counts[True] == 2 * counts[False]


def _saved(family: Callable[[], nn.Module], recompute: Recomputed) -> SavedBytes:
    """What autograd keeps over one fill/drain step with ``recompute``d slots."""
    adapter = TransformersMoEAdapter(family())
    options = dataclasses.replace(adapter.schedule_options(), recompute=recompute)
    mbs = microbatches(3)
    return saved_bytes(
        lambda observer: combined_1f1b(
            adapter, mbs, options=options, fill_drain=True, observer=observer
        ),
        recompute,
    )


@pytest.mark.parametrize("family", [mixtral, qwen2_moe])
def test_recomputed_slots_release_their_forward_graph(family: Callable[[], nn.Module]) -> None:
    """Slots the schedule recomputes (``ScheduleOptions.recompute``) drop their forward graph
    as they end: nothing the model's own code keeps holds it. Peak saved bytes of one
    fill/drain step against the same step storing everything, measured (pre_dispatch / mlp /
    both): Mixtral 0.76x / 0.50x / 0.20x, Qwen2-MoE 0.41x / 0.79x / 0.14x (overlapped:
    0.76x / 0.68x / 0.32x and 0.45x / 0.86x / 0.20x)."""
    kept = _saved(family, ()).peak
    for recompute in RECOMPUTED:
        assert _saved(family, recompute).held == 0, f"{recompute}: a forward graph kept"
    assert _saved(family, ("pre_dispatch", "mlp")).peak < 0.3 * kept


@pytest.mark.parametrize("aux", [False, True], ids=["no_aux", "aux"])
@pytest.mark.parametrize("family", [mixtral, qwen2_moe])
def test_schedule_recompute_is_exact(family: Callable[..., nn.Module], aux: bool) -> None:
    """Slots the schedule recomputes give the step that stores, bit for bit; with the
    load-balancing loss, a recomputed pre-dispatch attaches its gradient to the batch its
    forward added to, counting nothing twice."""
    model = family(aux=aux)
    mbs = microbatches(3, padded=True)
    runs: list[tuple[list[torch.Tensor], dict[str, torch.Tensor]]] = []
    for recompute in ((), ("pre_dispatch", "mlp")):
        copied = copy.deepcopy(model)
        adapter = TransformersMoEAdapter(copied)
        options = dataclasses.replace(adapter.schedule_options(), recompute=recompute)
        losses = combined_1f1b(adapter, mbs, options=options, fill_drain=True)
        runs.append((losses, grads(copied)))
    (kept, gk), (recomputed, gr) = runs
    assert all(torch.equal(a, b) for a, b in zip(recomputed, kept, strict=True))
    assert all(torch.equal(gr[k], gk[k]) for k in gk), "recomputing changed a gradient"
