"""Activation recomputation per slot (torch.utils.checkpoint, selective): exact, and
composing with delayed wgrad and free-input."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import Tensor

from moe_overlap import ConfigError, Microbatch, ScheduleError, combined_1f1b
from moe_overlap.blocks import RMSNorm, finish_wgrad, recompute, swiglu
from moe_overlap.models import GPTMoEConfig, GPTMoEModel
from tests.models._helpers import SMALL, microbatches
from tests.saved_bytes import RECOMPUTED, Recomputed, SavedBytes, saved_bytes

PARTS: list[tuple[str, ...]] = [
    ("norm",),
    ("attention_core", "activation"),
    ("attention",),
    ("attention", "norm", "activation", "attention_core"),
]


def _config(recompute: object, delay: bool) -> GPTMoEConfig:
    parts: Any = recompute  # names as data: the config checks them
    return GPTMoEConfig(
        hidden_size=32,
        num_layers=3,
        num_experts=4,
        moe_shared_expert_hidden_size=16,
        delay_wgrad_compute=delay,
        recompute=parts,
    )


def _batches() -> list[Microbatch]:
    g = torch.Generator().manual_seed(0)
    xs = [torch.randint(0, 128, (2, 8), generator=g) for _ in range(3)]
    return [Microbatch(input_ids=x, labels=x.roll(-1, 1)) for x in xs]


def _plain(model: GPTMoEModel, mbs: list[Microbatch]) -> list[Tensor]:
    losses = []
    for mb in mbs:
        assert mb.input_ids is not None
        loss = model(mb.input_ids, labels=mb.labels)
        loss.backward()
        finish_wgrad(model)
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("delay", [False, True])
@pytest.mark.parametrize("parts", PARTS)
def test_recomputed_schedule_is_bit_identical(parts: tuple[str, ...], delay: bool) -> None:
    mbs = _batches()
    scheduled = GPTMoEModel(_config(parts, delay))
    losses = combined_1f1b(scheduled, mbs, options=scheduled.schedule_options())
    plain = GPTMoEModel(_config(parts, delay))
    stored = GPTMoEModel(_config((), delay))  # nothing recomputed
    assert losses == _plain(plain, mbs) == _plain(stored, mbs)
    for a, b, c in zip(
        scheduled.parameters(), plain.parameters(), stored.parameters(), strict=True
    ):
        assert a.grad is not None and b.grad is not None and c.grad is not None
        assert torch.equal(a.grad, b.grad) and torch.equal(a.grad, c.grad)


def test_recompute_runs_again_in_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"norm": 0}
    original = RMSNorm._norm

    def counted(self: RMSNorm, x: Tensor) -> Tensor:
        calls["norm"] += 1
        return original(self, x)

    monkeypatch.setattr(RMSNorm, "_norm", counted)
    counts = {}
    for parts in ((), ("norm",)):
        calls["norm"] = 0
        model = GPTMoEModel(_config(parts, False))
        combined_1f1b(model, _batches())
        counts[parts] = calls["norm"]
    assert counts[("norm",)] == 2 * counts[()]  # every norm ran again in its backward


def test_recompute_of_an_input_free_input_releases_is_refused() -> None:
    """A freeing slot (mlp, 4 local experts) passing its input to a recomputed region."""
    model = GPTMoEModel(_config((), False))
    layer: Any = model.layer_list[1]
    layer.mlp_forward = lambda ctx, recv: recompute(swiglu, torch.cat([recv, recv], -1))
    combined_1f1b(model, _batches())  # a fresh tensor (cat) is recomputed on: fine
    model.zero_grad()
    layer.mlp_forward = lambda ctx, recv: recompute(torch.sin, recv)
    with pytest.raises(ScheduleError, match="a recomputed region .* holds one of them"):
        combined_1f1b(model, _batches())


@pytest.mark.parametrize(
    ("value", "match"),
    [(("norms",), r"expected recompute parts among .* received \['norms'\]"), ("norm", "string")],
)
def test_unknown_recompute_parts_are_refused(value: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _config(value, False)


def _saved(config: GPTMoEConfig, slots: Recomputed) -> SavedBytes:
    """What autograd keeps over one fill/drain step with the ``slots`` recomputed."""
    model = GPTMoEModel(config)
    options = dataclasses.replace(model.schedule_options(), recompute=slots)
    mbs = microbatches(3, vocab=config.vocab_size)
    return saved_bytes(
        lambda observer: combined_1f1b(
            model, mbs, options=options, fill_drain=True, observer=observer
        ),
        slots,
    )


@pytest.mark.parametrize(
    "config",
    [SMALL, dataclasses.replace(SMALL, moe_shared_expert_hidden_size=16, moe_aux_loss_coeff=0.01)],
    ids=["small", "shared_expert_aux_loss"],
)
def test_recomputed_slots_release_their_forward_graph(config: GPTMoEConfig) -> None:
    """Slots the schedule recomputes (``ScheduleOptions.recompute``) drop their forward graph
    as they end. Peak saved bytes of one fill/drain step against the same step storing
    everything, measured (pre_dispatch / mlp / both): 0.55x / 0.66x / 0.13x, with a shared
    expert and the aux loss 0.52x / 0.68x / 0.14x (overlapped: 0.58x / 0.73x / 0.17x and
    0.57x / 0.75x / 0.20x)."""
    kept = _saved(config, ()).peak
    for slots in RECOMPUTED:
        assert _saved(config, slots).held == 0, f"{slots}: a forward graph kept"
    assert _saved(config, ("pre_dispatch", "mlp")).peak < 0.3 * kept
