"""Plans driven by hand are checked as ``combined_1f1b`` checks its step, per run.

A user driving :meth:`ModelChunkSchedulePlan.run` (or ``run_pair``) has no step the
library knows; the run that backs a plan is the unit. A parameter two nodes of one
microbatch accumulate (a tied output layer, a layer listed twice) is refused when that
run returns; a plan whose output needs no grad (a frozen model, a loss no trainable
parameter reaches) is refused before the run that would back it, as plain ``backward()``
refuses it. A clean model is counted at its first such run only.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import pytest
import torch
from torch import Tensor

from moe_overlap import (
    ConfigError,
    IntegrationError,
    Microbatch,
    ModelChunkSchedulePlan,
    ScheduleError,
    combined_1f1b,
)
from moe_overlap.engine import DEBUG, _shared_params
from moe_overlap.engine._torch_wrappers import has_grad_hooks
from moe_overlap.steps import run_pair

from .test_parity import assert_same
from .toy_model import ToyConfig, ToyLayer, ToyModel, grads, make_microbatches, plain_step

CONFIG = ToyConfig()
PLAIN_REFUSES = "element 0 of tensors does not require grad"
TWO_NODES = (
    r"ModelChunkSchedulePlan\.run: ToyModel: expected each parameter's gradient accumulated "
    r"into \.grad at most once per microbatch \(by one node's backward\), received more "
    r"accumulations than the 1 microbatch the run backs \(microbatch {mb}\) for "
    r"\['{names} \(2 accumulations\)'\]: two nodes use the parameter.*zero them"
)
TIED = "embedding.weight = output.weight"


def hand_step(model: ToyModel, mbs: Sequence[Microbatch], *, overlap: bool = True) -> list[Tensor]:
    """Megatron-Core's loop, by hand: ``F0 | F1+B0 | ... | B(N-1)`` (``overlap``), else
    ``F0 B0 F1 B1 ...``; each plan built at its forward. The losses."""
    losses: list[Tensor] = []
    back: ModelChunkSchedulePlan | None = None
    for i, mb in enumerate(mbs):
        plan = ModelChunkSchedulePlan(model, mb, index=i)
        if overlap:
            grad = torch.ones_like(losses[-1]) if back is not None else None
            out = ModelChunkSchedulePlan.run(plan, back, b_grad=grad)
        else:
            out = ModelChunkSchedulePlan.run(plan, None)
            assert out is not None
            ModelChunkSchedulePlan.run(None, plan, b_grad=torch.ones_like(out))
        assert out is not None
        losses.append(out.detach())
        back = plan
    if overlap:
        assert back is not None
        ModelChunkSchedulePlan.run(None, back, b_grad=torch.ones_like(losses[-1]))
    return losses


def tie(model: ToyModel) -> Callable[[], None]:
    """The output layer tied to the embedding; returns what unties it."""
    own = model.output.weight
    model.output.weight = model.embedding.weight
    return lambda: setattr(model.output, "weight", own)


def list_twice(model: ToyModel) -> Callable[[], None]:
    model.decoder.layers.append(model.decoder.layers[0])
    return lambda: model.decoder.layers.__delitem__(-1)


SHARES: dict[str, tuple[Callable[[ToyModel], Callable[[], None]], str]] = {
    "the output layer tied to the embedding": (tie, re.escape(TIED)),
    "a layer listed twice": (list_twice, r"decoder\.layers\.0\.attn\.weight = .*"),
}


@contextmanager
def hooks_registered() -> Iterator[list[int]]:
    """The post-accumulate-grad hooks the shared-parameter count registers in the block."""
    calls: list[int] = []
    register = _shared_params._register

    def counted(param: Tensor, hook: Callable[[Tensor], None]) -> object:
        calls.append(1)
        return register(param, hook)

    _shared_params._register = counted  # type: ignore[assignment]
    try:
        yield calls
    finally:
        _shared_params._register = register


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "serial"])
@pytest.mark.parametrize("change", list(SHARES))
def test_a_parameter_two_nodes_use_is_refused_by_hand(change: str, overlap: bool) -> None:
    """Refused when the run backing microbatch 0 returns, also after clean runs (by hand
    or through combined_1f1b: one memo); no hook is left, and undone, the model trains
    exactly by hand again."""
    model = ToyModel(CONFIG, "dm")
    hand_step(model, make_microbatches(2, CONFIG))  # clean: later runs count nothing ...
    combined_1f1b(model, make_microbatches(2, CONFIG))
    share, names = SHARES[change]
    undo = share(model)  # ... until the parameters change
    with pytest.raises(IntegrationError, match=TWO_NODES.format(mb=0, names=names)):
        hand_step(model, make_microbatches(3, CONFIG), overlap=overlap)
    assert not any(has_grad_hooks(p) for p in model.parameters())
    undo()
    model.zero_grad(set_to_none=True)
    ref = copy.deepcopy(model)
    mbs = make_microbatches(3, CONFIG, seed=4)
    want = plain_step(ref, mbs)
    got = hand_step(model, mbs, overlap=overlap)
    assert [float(v) for v in got] == [float(v) for v in want]
    assert_same(grads(model), grads(ref))


def test_a_drain_of_two_backwards_is_counted_against_both() -> None:
    """``run_pair``'s two backwards: once per plan is clean, twice per plan refused."""
    model = ToyModel(CONFIG, "dm")
    ref = copy.deepcopy(model)
    mbs = make_microbatches(2, CONFIG)

    plans: list[ModelChunkSchedulePlan] = []

    def drain() -> None:
        plans[:] = [ModelChunkSchedulePlan(model, mb, index=i) for i, mb in enumerate(mbs)]
        l0, l1 = run_pair(plans[0], plans[1])
        assert l0 is not None and l1 is not None
        run_pair(plans[0], plans[1], b_grads=(torch.ones_like(l0), torch.ones_like(l1)))

    drain()
    plain_step(ref, mbs)
    assert_same(grads(model), grads(ref))
    tie(model)
    with pytest.raises(
        IntegrationError,
        match=r"run_pair: ToyModel: .*received more accumulations than the 2 microbatches the "
        rf"run backs \(microbatches 0, 1\) for \['{re.escape(TIED)} \(4 accumulations\)'\]",
    ):
        drain()
    assert all(plan.released for plan in plans)


@pytest.mark.skipif(DEBUG, reason="debug mode counts every run")
def test_a_clean_model_is_counted_at_its_first_backward_run_only() -> None:
    """The host cost: hooks at the first run that backs a plan, none after while nothing
    is registered and no parameter then frozen is unfrozen (one frozen since accumulates
    nothing); other parameters are counted again, at one run."""
    model = ToyModel(CONFIG, "dm")
    mbs = make_microbatches(3, CONFIG)
    with hooks_registered() as calls:
        hand_step(model, mbs)
    trainable = sum(1 for p in model.parameters() if p.requires_grad)
    assert len(calls) == trainable  # one run counted: each trainable parameter hooked once
    with hooks_registered() as calls:
        hand_step(model, mbs)
        model.embedding.weight.requires_grad_(False)  # a frozen trainable one: nothing new
        hand_step(model, mbs)
        model.embedding.weight.requires_grad_(True)
        hand_step(model, mbs)
    assert calls == []
    model.extra = torch.nn.Parameter(torch.zeros(1))  # other parameters: counted again
    with hooks_registered() as calls:
        hand_step(model, mbs)
        hand_step(model, mbs)
    assert len(calls) == trainable + 1


def test_a_tied_parameter_unfrozen_after_clean_runs_is_refused() -> None:
    """Frozen when counted, the tied parameter was not; unfreezing it counts again."""
    model = ToyModel(CONFIG, "dm")
    tie(model)
    model.embedding.weight.requires_grad_(False)
    hand_step(model, make_microbatches(2, CONFIG))
    hand_step(model, make_microbatches(2, CONFIG))
    model.embedding.weight.requires_grad_(True)
    with pytest.raises(IntegrationError, match=TWO_NODES.format(mb=0, names=re.escape(TIED))):
        hand_step(model, make_microbatches(2, CONFIG))


def test_a_failed_run_leaves_no_hook() -> None:
    """A run that fails counts nothing further: its hooks go, nothing is refused."""
    model = ToyModel(CONFIG, "dm")
    tie(model)
    plan = ModelChunkSchedulePlan(model, make_microbatches(1, CONFIG)[0], index=0)
    loss = ModelChunkSchedulePlan.run(plan, None)
    assert loss is not None

    def boom(grad: Tensor) -> None:
        raise RuntimeError("a gradient hook failed")

    layer = model.decoder.layers[0]
    assert isinstance(layer, ToyLayer)
    handle = layer.attn.weight.register_hook(boom)  # type: ignore[no-untyped-call]
    with pytest.raises(ScheduleError, match="a gradient hook failed"):
        ModelChunkSchedulePlan.run(None, plan, b_grad=torch.ones_like(loss))
    handle.remove()
    assert not any(has_grad_hooks(p) for p in model.parameters())


FROZEN = (
    r"ModelChunkSchedulePlan\.run: ToyModel: expected a step with something to differentiate "
    r"\(a parameter or an input that requires grad\), received a model whose \d+ parameters "
    r"are all frozen.*plain loss\.backward\(\) refuses"
)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "serial"])
def test_a_frozen_model_is_refused_at_its_first_backward_run(overlap: bool) -> None:
    """Its forward alone is plain forward's; backing it is what plain backward refuses."""
    model = ToyModel(CONFIG, "dm")
    model.requires_grad_(False)
    mbs = make_microbatches(2, CONFIG)
    with pytest.raises(RuntimeError, match=PLAIN_REFUSES):
        plain_step(copy.deepcopy(model), mbs)
    with pytest.raises(ConfigError, match=FROZEN):
        hand_step(model, mbs, overlap=overlap)
    model.requires_grad_(True)
    ref = copy.deepcopy(model)
    want = plain_step(ref, mbs)
    got = hand_step(model, mbs, overlap=overlap)
    assert [float(v) for v in got] == [float(v) for v in want]
    assert_same(grads(model), grads(ref))


def _unused_trainable(model: ToyModel) -> None:
    """Every parameter on the output's path frozen, one trainable elsewhere (unused)."""
    model.requires_grad_(False)
    model.unused = torch.nn.Parameter(torch.zeros(1))


def test_a_loss_no_trainable_parameter_reaches_is_refused_by_hand() -> None:
    model = ToyModel(CONFIG, "dm")
    _unused_trainable(model)
    mbs = make_microbatches(2, CONFIG)
    plans = [ModelChunkSchedulePlan(model, mb, index=i) for i, mb in enumerate(mbs)]
    l0 = ModelChunkSchedulePlan.run(plans[0], None)
    assert l0 is not None and not l0.requires_grad
    loss = r"expected the loss of microbatch {} \(the backward plan's output\) to require grad"
    with pytest.raises(
        IntegrationError,
        match=r"ModelChunkSchedulePlan\.run: ToyModel\._postprocess: "
        + loss.format(0)
        + r" \(plain loss\.backward\(\) refuses one that does not.*received a loss without "
        r"grad.*autograd recorded; to evaluate.*no_grad\(\)\.$",
    ):
        ModelChunkSchedulePlan.run(plans[1], plans[0], b_grad=torch.ones_like(l0))
    assert not plans[0].released and not plans[1].released  # refused before anything ran
    ModelChunkSchedulePlan.run(plans[1], None)
    with pytest.raises(IntegrationError, match=loss.format(1) + r".*are partial: zero them"):
        ModelChunkSchedulePlan.run(None, plans[1], b_grad=torch.ones_like(l0))


def _stage(model: ToyModel) -> ToyModel:
    """The model as a first pipeline stage: its output the last layer's hidden states."""
    model.post_process = False
    return model


def test_a_stage_output_without_grad_is_refused_by_hand() -> None:
    """A stage's output (no post-process): refused as ``output.backward(grad)`` refuses it."""
    mb = make_microbatches(1, CONFIG)[0]
    frozen = _stage(ToyModel(CONFIG, "dm"))
    frozen.requires_grad_(False)
    plan = ModelChunkSchedulePlan(frozen, mb, index=0)
    out = ModelChunkSchedulePlan.run(plan, None)
    assert out is not None
    with pytest.raises(RuntimeError, match=PLAIN_REFUSES):
        torch.autograd.backward(out, torch.ones_like(out))
    with pytest.raises(ConfigError, match=FROZEN):
        ModelChunkSchedulePlan.run(None, plan, b_grad=torch.ones_like(out))
    cut = _stage(ToyModel(CONFIG, "dm"))
    _unused_trainable(cut)
    plan = ModelChunkSchedulePlan(cut, mb, index=0)
    out = ModelChunkSchedulePlan.run(plan, None)
    assert out is not None
    with pytest.raises(
        IntegrationError,
        match=r"ModelChunkSchedulePlan\.run: ToyModel: expected the output of microbatch 0 "
        r"\(the backward plan's, which b_grad is the gradient of\) to require grad .*release "
        r"its plan \(plan\.release_state\(\)\) instead\.$",
    ):
        ModelChunkSchedulePlan.run(None, plan, b_grad=torch.ones_like(out))


def test_a_frozen_model_whose_input_requires_grad_runs_by_hand() -> None:
    """Plain backward runs it (the gradient reaches the input): so does the run."""
    model = _stage(ToyModel(CONFIG, "dm"))
    model.requires_grad_(False)
    model.pre_process = False  # a later stage: its input is decoder.input_tensor
    x = torch.randn(2, 8, CONFIG.hidden, requires_grad=True)
    mb = make_microbatches(1, CONFIG)[0]
    mb = Microbatch(position_ids=mb.position_ids)
    model.decoder.input_tensor = x
    plan = ModelChunkSchedulePlan(model, mb, index=0)
    out = ModelChunkSchedulePlan.run(plan, None)
    assert out is not None and out.requires_grad
    grad = torch.randn_like(out)
    ModelChunkSchedulePlan.run(None, plan, b_grad=grad)
    assert x.grad is not None
    got = x.grad.clone()
    x.grad = None
    h, rot = x, model._rotary(mb.position_ids)
    for layer in model.decoder.layers:
        assert isinstance(layer, ToyLayer)
        h = layer(h, rot)
    torch.autograd.backward(h, grad)
    assert x.grad is not None and torch.equal(got, x.grad)
