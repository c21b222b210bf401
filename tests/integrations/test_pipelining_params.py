"""Frozen and shared parameters under a prepared schedule, against torch's own schedule.

In one process (a one-rank gloo group, both stages on the rank), the reference model's
two stages (stage 0: the embedding and the dense layer; stage 1: two MoE layers, the final
norm and the output layer), run by torch's own schedule and by the same schedule prepared.

- Frozen parameters: torch's own schedule runs a stage (or a model) whose parameters are
  all frozen, computing no gradient for it (unlike plain ``loss.backward()``, which refuses a
  loss that needs no grad: ``combined_1f1b`` refuses that, ``tests/engine/test_frozen.py``);
  the prepared schedule runs it too, with the same losses and gradients.
- A parameter two nodes of one stage use (a router shared by two layers, the final norm
  shared with a layer's norm): the prepared schedule adds each node's part to ``.grad`` on
  its own, where torch's one backward of the stage adds their sum: not bit-identical
  (checked here with the count off), so it is refused after the step, at the first step
  and whenever the parameters change. A parameter tied across the two stages of the rank
  (the embedding and the output layer) is added once per stage by torch's run too: exact.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    ScheduleDualPipeV,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from moe_overlap import IntegrationError
from moe_overlap.engine import StageAccumulations
from moe_overlap.integrations.pipelining import prepare_schedule
from moe_overlap.models import GPTMoEConfig, GPTMoEModel, GPTMoEStage, masked_cross_entropy

VOCAB, B, S, MICROBATCHES = 64, 2, 8, 4

ON_211 = torch.__version__.startswith("2.11")
SCHEDULES: dict[str, tuple[Any, bool]] = {  # the class, and whether to pair its F and B
    "interleaved": (ScheduleInterleaved1F1B, True),
    "zero-bubble": (ScheduleInterleavedZeroBubble, False),
    "dualpipev": (ScheduleDualPipeV, False),
}
SKIPPED_ON_211 = pytest.mark.skipif(
    ON_211,
    reason="torch 2.11: gloo refuses DualPipeV's same-rank warm-up send; its own "
    "BACKWARD_WEIGHT fails on custom autograd.Function nodes (tests/integrations/test_pipelining.py)",
)


def _names(*left_out: str) -> list[Any]:
    """The schedules' names (but ``left_out``), as parameters (skipped on torch 2.11 but
    the interleaved one)."""
    return [
        pytest.param(n, marks=SKIPPED_ON_211) if n != "interleaved" else n
        for n in sorted(SCHEDULES)
        if n not in left_out
    ]


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


Change = Callable[[GPTMoEModel, list[GPTMoEStage]], object]


class _Run:
    """The model, its two stage modules and a schedule over them (prepared or torch's own)."""

    def __init__(self, schedule: str, change: Change, *, prepared: bool) -> None:
        config = GPTMoEConfig(
            num_layers=3,
            first_k_dense=1,
            hidden_size=16,
            ffn_hidden_size=32,
            num_experts=4,
            moe_ffn_hidden_size=8,
            moe_router_topk=2,
            vocab_size=VOCAB,
            seed=3,
        )
        self.model = GPTMoEModel(config)
        self.stages = [GPTMoEStage(self.model, range(0, 1)), GPTMoEStage(self.model, range(1, 3))]
        change(self.model, self.stages)
        kind, pair = SCHEDULES[schedule]
        torch_stages = [
            PipelineStage(m, i, 2, torch.device("cpu")) for i, m in enumerate(self.stages)
        ]
        self.schedule = kind(torch_stages, n_microbatches=MICROBATCHES, loss_fn=_loss)
        if prepared:
            prepare_schedule(self.schedule, pair=pair)

    def step(self, seed: int) -> list[float]:
        gen = torch.Generator().manual_seed(seed)
        x = torch.randint(0, VOCAB, (B * MICROBATCHES, S), generator=gen)
        y = torch.randint(0, VOCAB, (B * MICROBATCHES, S), generator=gen)
        losses: list[Tensor] = []
        self.schedule.step(x, target=y, losses=losses)
        return [float(v.detach()) for v in losses]

    def grads(self) -> dict[str, Tensor | None]:
        return {n: p.grad for n, p in self.model.named_parameters()}


def _assert_same_grads(a: _Run, b: _Run) -> None:
    ga, gb = a.grads(), b.grads()
    assert ga.keys() == gb.keys()
    differ = [
        n
        for n in ga
        if (ga[n] is None) != (gb[n] is None)
        or (ga[n] is not None and not torch.equal(cast(Tensor, ga[n]), cast(Tensor, gb[n])))
    ]
    assert not differ, f"gradients differ from torch's own run: {differ}"


def _freeze_all(m: GPTMoEModel, stages: list[GPTMoEStage]) -> None:
    m.requires_grad_(False)


def _freeze_first_stage(m: GPTMoEModel, stages: list[GPTMoEStage]) -> None:
    stages[0].requires_grad_(False)


def _freeze_last_stage(m: GPTMoEModel, stages: list[GPTMoEStage]) -> None:
    stages[1].requires_grad_(False)


FREEZES: dict[str, Change] = {
    "every parameter": _freeze_all,
    "the first stage": _freeze_first_stage,
    "the last stage": _freeze_last_stage,
}


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize("frozen", sorted(FREEZES))
@pytest.mark.parametrize("schedule", _names())
def test_a_frozen_stage_runs_as_torchs_own_schedule(schedule: str, frozen: str) -> None:
    """torch's own schedule runs it: the prepared one too, with its losses and gradients
    (two steps: the first has torch's shape inference). The zero-bubble schedule is
    compared with torch's own interleaved 1F1B (one full backward per action): torch's own
    input/weight split computes no weight gradient for a stage whose input needs no grad
    (the last stage, with the first frozen), where the prepared one computes them all."""
    reference = "interleaved" if schedule == "zero-bubble" else schedule
    theirs = _Run(reference, FREEZES[frozen], prepared=False)
    mine = _Run(schedule, FREEZES[frozen], prepared=True)
    for seed in (0, 1):
        assert mine.step(seed) == theirs.step(seed)
    _assert_same_grads(mine, theirs)
    assert any(g is None for g in mine.grads().values())


@pytest.mark.usefixtures("one_rank")
@pytest.mark.skipif(not torch.__version__.startswith("2.13"), reason="torch 2.13's behaviour")
def test_torchs_own_zero_bubble_split_drops_a_stage_fed_no_grad() -> None:
    """What the comparison above works around (docs/pipelining.md): torch's own input /
    weight split leaves the last stage's weight gradients unset when its input needs no
    grad (the first stage frozen); its full backward, and the prepared schedule, set them."""
    own = _Run("zero-bubble", _freeze_first_stage, prepared=False)
    full = _Run("interleaved", _freeze_first_stage, prepared=False)
    assert own.step(0) == full.step(0)
    assert own.model.output_layer.weight.grad is None
    assert full.model.output_layer.weight.grad is not None


def _share_router(m: GPTMoEModel, stages: list[GPTMoEStage]) -> object:
    layers: list[Any] = list(m.layer_list)  # MoE layers (the first layer is dense)
    own = layers[2].router
    layers[2].router = layers[1].router
    return lambda: setattr(layers[2], "router", own)


def _share_final_norm(m: GPTMoEModel, stages: list[GPTMoEStage]) -> object:
    own = stages[1].final_norm
    setattr(stages[1], "final_norm", m.layer_list[2].pre_mlp_norm)  # noqa: B010 - not an RMSNorm to the types
    return lambda: setattr(stages[1], "final_norm", own)


SHARES: dict[str, Callable[[GPTMoEModel, list[GPTMoEStage]], object]] = {
    "a router shared by two layers of the stage": _share_router,
    "the final norm shared with a layer of the stage": _share_final_norm,
}


@contextlib.contextmanager
def _not_counted() -> Iterator[None]:
    """The prepared schedules' shared-parameter count off (what the check prevents)."""
    check = StageAccumulations.check
    StageAccumulations.check = lambda self, backwards, where: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        StageAccumulations.check = check  # type: ignore[method-assign]


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize("share", sorted(SHARES))
@pytest.mark.parametrize("schedule", _names("zero-bubble"))
def test_a_parameter_two_nodes_of_a_stage_use_is_inexact(schedule: str, share: str) -> None:
    """Why it is refused: uncounted, the shared parameter's gradient differs from torch's
    own run (every other gradient is the same). (torch's own zero-bubble split fails on
    such a stage: "backward through the graph a second time".)"""
    theirs = _Run(schedule, SHARES[share], prepared=False)
    with _not_counted():
        mine = _Run(schedule, SHARES[share], prepared=True)
        assert mine.step(0) == theirs.step(0)
    ga, gb = mine.grads(), theirs.grads()
    assert [n for n, g in ga.items() if g is None] == [n for n, g in gb.items() if g is None]
    differ = [n for n, g in ga.items() if g is not None and not torch.equal(g, cast(Tensor, gb[n]))]
    assert differ == [
        "decoder.layers.1.router.weight"
        if "router" in share
        else "decoder.layers.2.pre_mlp_norm.weight"
    ]


def _unchanged(m: GPTMoEModel, stages: list[GPTMoEStage]) -> None:
    pass


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize("share", sorted(SHARES))
@pytest.mark.parametrize("schedule", _names())
def test_a_parameter_two_nodes_of_a_stage_use_is_refused(schedule: str, share: str) -> None:
    """Refused when the step returns, also after clean steps (the count runs again when the
    parameters change); undone, the same schedule is exact again."""
    mine = _Run(schedule, _unchanged, prepared=True)
    mine.step(0)  # clean: later steps count nothing ...
    mine.step(1)
    undo = SHARES[share](mine.model, mine.stages)  # ... until the parameters change
    name = (
        "decoder.layers.1.router.weight = decoder.layers.2.router.weight"
        if "router" in share
        else "decoder.layers.2.pre_mlp_norm.weight = final_norm.weight"
    )
    with pytest.raises(
        IntegrationError,
        match=r"^pipeline rank 0: pipeline stage 1 \(GPTMoEStage\): expected each parameter's "
        r"gradient accumulated into \.grad at most once per backward of each stage holding it "
        r"\(torch's own schedule runs one backward per stage and microbatch\), received more "
        rf"accumulations than those backwards for \['{re.escape(name)} \(8 accumulations\)'\]: two "
        r"nodes of a stage use the parameter .*zero them .*untie the weights",
    ):
        mine.step(2)
    assert callable(undo)
    undo()
    mine.model.zero_grad(set_to_none=True)
    theirs = _Run(
        "interleaved" if schedule == "zero-bubble" else schedule, _unchanged, prepared=False
    )
    assert mine.step(3) == theirs.step(3)
    _assert_same_grads(mine, theirs)


def _tie(m: GPTMoEModel, stages: list[GPTMoEStage]) -> None:
    m.output_layer.weight = m.embedding.weight


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize("schedule", _names())
def test_a_parameter_tied_across_two_stages_of_the_rank_is_exact(schedule: str) -> None:
    """The output layer tied to the embedding, stages 1 and 0 on the one rank: torch's own
    schedule also adds it once per stage backward; the prepared one matches it."""
    theirs = _Run(schedule, _tie, prepared=False)
    mine = _Run(schedule, _tie, prepared=True)
    for seed in (0, 1):
        assert mine.step(seed) == theirs.step(seed)
    _assert_same_grads(mine, theirs)
    assert isinstance(mine.model.output_layer, nn.Linear)
    assert mine.model.output_layer.weight is mine.model.embedding.weight
