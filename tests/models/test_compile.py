"""torch.compile'd slot modules under the schedule: no graph break in them, exact against
the same compiled model trained with plain backward()."""

from __future__ import annotations

import gc
import shutil
from collections.abc import Iterator

import pytest
import torch
import torch._dynamo

from moe_overlap import Microbatch, combined_1f1b
from moe_overlap.blocks import finish_wgrad
from moe_overlap.models import GPTMoEConfig, GPTMoEModel

COMPILED = ("attn_block", "pre_mlp_norm", "router", "mlp", "shared_expert")
"""Each layer's modules the slots call, but the routed experts and the dispatcher (their
row counts change every microbatch: each new count would be a recompile)."""

HAS_CXX = any(shutil.which(c) for c in ("g++", "c++", "clang++"))


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    # Compilation leaves cyclic garbage that takes several passes to collect; later tests
    # (the no-reference-cycles check of the timeline) must not see it.
    for _ in range(10):
        if not gc.collect():
            break


def _build(delay: bool, backend: str, fullgraph: bool) -> GPTMoEModel:
    config = GPTMoEConfig(
        hidden_size=32,
        num_layers=3,
        num_experts=4,
        moe_shared_expert_hidden_size=16,
        delay_wgrad_compute=delay,
    )
    model = GPTMoEModel(config)
    for layer in model.layer_list:
        for name in COMPILED:
            module = getattr(layer, name, None)
            if isinstance(module, torch.nn.Module):
                module.compile(backend=backend, fullgraph=fullgraph)
    return model


def _batches() -> list[Microbatch]:
    g = torch.Generator().manual_seed(0)
    xs = [torch.randint(0, 128, (2, 8), generator=g) for _ in range(3)]
    return [Microbatch(input_ids=x, labels=x.roll(-1, 1)) for x in xs]


def _compare(delay: bool, backend: str, fullgraph: bool) -> None:
    mbs = _batches()
    scheduled = _build(delay, backend, fullgraph)
    losses = combined_1f1b(scheduled, mbs, options=scheduled.schedule_options())
    plain = _build(delay, backend, fullgraph)
    want = []
    for mb in mbs:
        assert mb.input_ids is not None
        loss = plain(mb.input_ids, labels=mb.labels)
        loss.backward()
        finish_wgrad(plain)
        want.append(loss.detach())
    assert losses == want
    for a, b in zip(scheduled.parameters(), plain.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None
        assert torch.equal(a.grad, b.grad)


def test_compiled_modules_run_fullgraph_under_the_schedule() -> None:
    """fullgraph=True: any graph break inside these modules would raise at their first call."""
    _compare(delay=False, backend="aot_eager", fullgraph=True)


@pytest.mark.skipif(not HAS_CXX, reason="inductor needs a C++ compiler")
def test_inductor_compiled_modules_are_exact_under_the_schedule() -> None:
    _compare(delay=False, backend="inductor", fullgraph=True)


def test_delayed_wgrad_compiles_with_a_graph_break_and_stays_exact() -> None:
    """The delayable linears queue their weight-gradient inputs in backward, a Python side
    effect Dynamo does not trace: fullgraph=True refuses them, fullgraph=False breaks the
    graph around them and runs them eagerly."""
    _compare(delay=True, backend="aot_eager", fullgraph=False)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="side effect"):
        _compare(delay=True, backend="aot_eager", fullgraph=True)
