"""Frozen parameters: combined_1f1b refuses the step plain ``loss.backward()`` refuses.

Plain per-microbatch backward raises torch's "element 0 of tensors does not require grad"
when the loss needs no grad (every parameter frozen, no input that requires grad, or a loss
cut from the graph); the schedule refuses the same steps with the library's errors, and
runs exactly what plain backward runs (a partly frozen model, a frozen model whose input
requires grad).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

from moe_overlap import ConfigError, IntegrationError, Microbatch, combined_1f1b
from moe_overlap.engine import DEBUG
from tests.conftest import DebugPython

from .test_parity import assert_same
from .toy_model import ToyConfig, ToyModel, grads, make_microbatches, plain_step

CONFIG = ToyConfig()
MODES: dict[str, dict[str, Any]] = {
    "overlapped": {},
    "sequential": {"overlap": False},
    "fill-drain": {"fill_drain": True},
}
PLAIN_REFUSES = "element 0 of tensors does not require grad"


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_frozen_model_is_refused_before_the_step_runs(mode: str) -> None:
    model = ToyModel(CONFIG, "dmd")
    model.requires_grad_(False)
    mbs = make_microbatches(3, CONFIG)
    with pytest.raises(RuntimeError, match=PLAIN_REFUSES):
        plain_step(copy.deepcopy(model), mbs)
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "combined_1f1b: ToyModel: expected a step with something to differentiate (a "
            "parameter or an input that requires grad), received a model whose 18 parameters "
            "are all frozen (requires_grad=False) and inputs that need no grad"
        )
        + r".*plain loss\.backward\(\) refuses.*model\.requires_grad_\(True\).*"
        r"torch\.no_grad\(\)",
    ):
        combined_1f1b(model, mbs, **MODES[mode])
    model.requires_grad_(True)  # unfrozen, the same model trains exactly
    ref = copy.deepcopy(model)
    losses = combined_1f1b(model, mbs, **MODES[mode])
    assert [float(v) for v in losses] == [float(v) for v in plain_step(ref, mbs)]
    assert_same(grads(model), grads(ref))


FREEZES: dict[str, Callable[[ToyModel], object]] = {
    "the embedding": lambda m: m.embedding.requires_grad_(False),
    "the first layer": lambda m: m.decoder.layers[0].requires_grad_(False),
    "all but the embedding": lambda m: (
        m.requires_grad_(False),
        m.embedding.requires_grad_(True),
    ),
    "all but the output layer": lambda m: (m.requires_grad_(False), m.output.requires_grad_(True)),
}


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("frozen", sorted(FREEZES))
def test_a_partly_frozen_model_trains_exactly(frozen: str, mode: str) -> None:
    ref = ToyModel(CONFIG, "dmd")
    FREEZES[frozen](ref)
    model = copy.deepcopy(ref)
    mbs = make_microbatches(3, CONFIG)
    want = plain_step(ref, mbs)
    got = combined_1f1b(model, mbs, **MODES[mode])
    assert [float(v) for v in got] == [float(v) for v in want]
    assert_same(grads(model), grads(ref))


class _FromHidden(ToyModel):
    """Takes hidden states (``decoder_input``) instead of token ids, on its plain path too."""

    def forward(self, mb: Microbatch) -> Tensor:
        assert mb.decoder_input is not None
        h, rot = mb.decoder_input, self._rotary(mb.position_ids)
        for layer in self.decoder.layers:
            h = layer(h, rot)
        return self._postprocess(h, None, mb.position_ids, mb.labels, rot, None, None)


def test_a_frozen_model_whose_input_requires_grad_runs_as_plain_backward() -> None:
    """Plain backward runs it (the gradient reaches the input): so does the schedule."""
    input_grads_as_plain_backward()


def input_grads_as_plain_backward() -> ToyModel:
    """The test above; the model it trained."""
    ref = _FromHidden(CONFIG, "dm")
    ref.requires_grad_(False)
    model = copy.deepcopy(ref)
    base = make_microbatches(2, CONFIG)
    gen = torch.Generator().manual_seed(5)
    x = [torch.randn(2, 8, CONFIG.hidden, generator=gen) for _ in base]

    def inputs() -> tuple[list[Microbatch], list[Tensor]]:
        leaves = [t.clone().requires_grad_() for t in x]
        mbs = [
            Microbatch(decoder_input=t, position_ids=mb.position_ids, labels=mb.labels)
            for t, mb in zip(leaves, base, strict=True)
        ]
        return mbs, leaves

    ref_mbs, ref_leaves = inputs()
    want = plain_step(ref, ref_mbs)
    mbs, leaves = inputs()
    got = combined_1f1b(model, mbs)
    assert [float(v) for v in got] == [float(v) for v in want]
    for a, b in zip(leaves, ref_leaves, strict=True):
        assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad)
    assert all(p.grad is None for p in model.parameters())
    return model


@pytest.mark.skipif(DEBUG, reason="this session runs the test above in debug mode")
def test_in_debug_mode_the_first_step_check_skips_an_input_that_requires_grad(
    debug_python: DebugPython,
) -> None:
    """Debug mode's first-step check runs microbatch 0's backward twice more: with an input
    that requires grad it would add to that input's gradient (or its producer's), so it
    skips; the step is then as without debug mode."""
    out = debug_python(
        """
        from moe_overlap.engine import DEBUG
        from moe_overlap.engine._plain_check import first_step_outcome
        from tests.engine import test_frozen
        assert DEBUG
        print(first_step_outcome(test_frozen.input_grads_as_plain_backward()))
        """
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip() == "skipped: an input of the microbatch requires grad"


def test_a_loss_no_trainable_parameter_reaches_is_refused() -> None:
    """Every parameter on the loss's path frozen, one trainable elsewhere (unused): plain
    backward refuses the loss; the schedule refuses it when it comes out. (A loss cut from
    the graph in ``_postprocess`` is refused earlier, by the node's own check.)"""
    model = ToyModel(CONFIG, "dm")
    model.requires_grad_(False)
    model.unused = torch.nn.Parameter(torch.zeros(1))
    mbs = make_microbatches(2, CONFIG)
    with pytest.raises(RuntimeError, match=PLAIN_REFUSES):
        plain_step(copy.deepcopy(model), mbs)
    with pytest.raises(
        IntegrationError,
        match=re.escape(
            "combined_1f1b: ToyModel._postprocess: expected the loss of microbatches[0] to "
            "require grad (plain loss.backward() refuses one that does not"
        )
        + r".*or no trainable parameter on its path\)\. Return the loss autograd recorded",
    ):
        combined_1f1b(model, mbs)
    assert all(p.grad is None for p in model.parameters())
