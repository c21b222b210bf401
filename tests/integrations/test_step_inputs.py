"""What a prepared schedule's ``step`` refuses, before anything runs: in one process (a
one-rank gloo group, two stages on the rank), for the reference model's stages and the
transformers adapter's; and a stage without layers between two, run exactly."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

from moe_overlap import ConfigError
from moe_overlap.integrations.pipelining import prepare_schedule
from moe_overlap.models import GPTMoEConfig, GPTMoEModel, GPTMoEStage, masked_cross_entropy

VOCAB, B, S, MICROBATCHES = 64, 2, 8, 2


def _gpt(*, empty: bool = False) -> tuple[nn.Module, list[nn.Module]]:
    config = GPTMoEConfig(
        num_layers=2,
        first_k_dense=1,
        hidden_size=16,
        ffn_hidden_size=32,
        num_experts=4,
        moe_ffn_hidden_size=8,
        moe_router_topk=2,
        vocab_size=VOCAB,
        seed=3,
    )
    model = GPTMoEModel(config)
    return model, [GPTMoEStage(model, r) for r in _ranges(2, empty)]


def _qwen3_moe(*, empty: bool = False) -> tuple[nn.Module, list[nn.Module]]:
    pytest.importorskip("transformers")
    from moe_overlap.adapters.transformers import TransformersMoEAdapter, TransformersMoEStage
    from tests.adapters._hf import qwen3_moe

    model = qwen3_moe(vocab_size=VOCAB)
    adapter = TransformersMoEAdapter(model)
    return model, [TransformersMoEStage(adapter, r) for r in _ranges(3, empty)]


def _ranges(n: int, empty: bool) -> list[range]:
    """Layer 0, then the rest; ``empty``: a stage without layers between them."""
    return [range(0, 1), *([range(1, 1)] if empty else []), range(1, n)]


MODELS: dict[str, Callable[..., tuple[nn.Module, list[nn.Module]]]] = {
    "gpt": _gpt,
    "qwen3_moe": _qwen3_moe,
}


@pytest.fixture
def one_rank() -> Iterator[None]:
    store = cast(Any, dist).HashStore()  # not in torch.distributed's __all__
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _loss(logits: Tensor, labels: Tensor) -> Tensor:
    return masked_cross_entropy(logits, labels, None)


def _prepared(name: str, *, empty: bool = False, prepare: bool = True) -> tuple[nn.Module, Any]:
    model, modules = MODELS[name](empty=empty)
    n = len(modules)
    stages: list[Any] = [PipelineStage(m, i, n, torch.device("cpu")) for i, m in enumerate(modules)]
    schedule = ScheduleInterleaved1F1B(stages, n_microbatches=MICROBATCHES, loss_fn=_loss)
    if prepare:
        prepare_schedule(schedule, pair=True)
    return model, schedule


def _batch() -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(7)
    n = B * MICROBATCHES
    return (
        torch.randint(0, VOCAB, (n, S), generator=gen),
        torch.randint(0, VOCAB, (n, S), generator=gen),
    )


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.usefixtures("one_rank")
def test_a_wrong_stage_input_is_refused_before_the_step_runs(name: str) -> None:
    """An unknown stage keyword (torch's own run: a bare TypeError from the stage module's
    forward) and float token ids (a bare RuntimeError from the embedding) are library
    errors naming them, raised before torch's shape inference or any action: no gradient
    is touched, and the same schedule's next step is exact."""
    model, schedule = _prepared(name)
    x, y = _batch()
    with pytest.raises(
        ConfigError,
        match=r"^pipeline stage 0 \(\w+Stage\): stage keyword argument 'foo' "
        r"\(schedule\.step\(\.\.\., foo=\.\.\.\)\): expected only the keyword arguments a plan "
        r"takes, \['position_ids', 'attention_mask', 'padding_mask'\], received also \['foo'\]",
    ):
        schedule.step(x, target=y, foo=torch.ones(B * MICROBATCHES, S))
    with pytest.raises(
        ConfigError,
        match=r"^pipeline stage 0 \(\w+Stage\): the first stage's input \(schedule\.step's "
        r"positional argument\): expected token ids as an integer tensor \(int64 or int32\), "
        r"received float32\[2, 8\]",
    ):
        schedule.step(x.float(), target=y)
    assert all(p.grad is None for p in model.parameters())

    losses: list[Tensor] = []
    schedule.step(x, target=y, losses=losses)
    reference, fresh = _prepared(name)
    want: list[Tensor] = []
    fresh.step(x, target=y, losses=want)
    assert [float(v.detach()) for v in losses] == [float(v.detach()) for v in want]
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None and q.grad is not None:
            assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_stage_without_layers_at_either_end_is_refused(name: str) -> None:
    """``range(0, 0)`` was a second ``pre_process`` stage beside the stage of layer 0 (the
    embedding owned twice, token ids expected from a stage that sends hidden states),
    ``range(n, n)`` a second ``post_process`` one (the output layer owned twice, the
    logits taken for hidden states)."""
    model, (first, last) = MODELS[name]()
    n: int = cast(Any, last).layers_range.stop
    source = getattr(first, "adapter", model)  # TransformersMoEStage takes the adapter
    for bad, flag in ((range(0, 0), "pre_process"), (range(n, n), "post_process")):
        with pytest.raises(ConfigError, match=r"with a < b at either end of the model") as e:
            type(first)(source, bad)
        assert f"received {bad!r}: a stage without layers there" in str(e.value)
        assert f"(both {flag}); give the stage at least one layer" in str(e.value)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.usefixtures("one_rank")
def test_a_stage_without_layers_between_two_passes_the_hidden_states_on_exactly(
    name: str,
) -> None:
    """A stage of no layers between two (``range(1, 1)``): the prepared schedule over the
    three stages computes torch's own schedule's losses and gradients over the two, bit
    for bit (a stage without layers at either end is refused, tests/adapters/test_hf_stage.py)."""
    x, y = _batch()
    runs = [_prepared(name, empty=True), _prepared(name, prepare=False)]
    losses: list[list[float]] = []
    for _, schedule in runs:
        got: list[Tensor] = []
        schedule.step(x, target=y, losses=got)
        losses.append([float(v.detach()) for v in got])
    assert losses[0] == losses[1]
    (model, _), (reference, _) = runs
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert torch.equal(p.grad, q.grad)
