"""FSDP-style layer hooks and pipeline (p2p) hooks fire where Megatron-Core fires them."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from moe_overlap import (
    ModelChunkSchedulePlan,
    SchedulableLayer,
    ScheduleOptions,
    combined_1f1b,
)

from .toy_model import DelayedLinear, ToyConfig, ToyModel, make_microbatches


@pytest.mark.parametrize("delay", [False, True])
def test_reshard_hooks_fire_once_per_layer_and_microbatch(delay: bool) -> None:
    config = ToyConfig()
    model = ToyModel(config, "dmm")
    model.set_delay(delay)
    events: list[tuple[str, int]] = []
    index = {id(layer): i for i, layer in enumerate(model.decoder.layers)}

    def pending(layer: SchedulableLayer) -> int:
        assert isinstance(layer, torch.nn.Module)
        return sum(len(m.pending) for m in layer.modules() if isinstance(m, DelayedLinear))

    def post_forward(layer: SchedulableLayer) -> None:
        events.append(("fwd", index[id(layer)]))

    def post_backward(layer: SchedulableLayer) -> None:
        # With delayed wgrad the hook waits until the layer's weight grads are computed.
        assert pending(layer) == 0
        events.append(("bwd", index[id(layer)]))

    def on_plan(plan: ModelChunkSchedulePlan) -> None:
        for lp in plan.layers:
            lp.set_fsdp_reshard_hooks(post_forward, post_backward)

    n_mb = 3
    combined_1f1b(
        model,
        make_microbatches(n_mb, config),
        options=ScheduleOptions(delay_wgrad_compute=delay),
        on_plan=on_plan,
    )
    for kind in ("fwd", "bwd"):
        for layer in range(3):
            assert events.count((kind, layer)) == n_mb
    # within one microbatch, forward hooks run first to last layer, backward last to first
    assert [e for e in events if e[0] == "fwd"][:3] == [("fwd", 0), ("fwd", 1), ("fwd", 2)]
    first_bwd = [e for e in events if e[0] == "bwd"][:3]
    assert first_bwd == [("bwd", 2), ("bwd", 1), ("bwd", 0)]


def test_p2p_hooks_get_the_chunk_boundary_values() -> None:
    config = ToyConfig()
    model = ToyModel(config, "mm")
    mbs = make_microbatches(2, config)
    calls: list[tuple[str, object]] = []

    def plan(i: int) -> ModelChunkSchedulePlan:
        mb = mbs[i]
        return ModelChunkSchedulePlan(model, mb, index=i, vp_stage=7)

    def pre_forward(stage: int | None) -> None:
        calls.append(("pre_forward", stage))

    def pre_backward(stage: int | None) -> None:
        calls.append(("pre_backward", stage))

    def post_forward(out: Tensor, stage: int | None) -> None:
        calls.append(("post_forward", tuple(out.shape)))

    def post_backward(grad: Tensor | None, stage: int | None) -> None:
        assert grad is not None
        calls.append(("post_backward", tuple(grad.shape)))

    p0, p1 = plan(0), plan(1)
    loss0 = ModelChunkSchedulePlan.run(p0, None, pre_forward=pre_forward, post_forward=post_forward)
    assert loss0 is not None
    ModelChunkSchedulePlan.run(
        p1,
        p0,
        b_grad=torch.ones_like(loss0),
        pre_forward=pre_forward,
        pre_backward=pre_backward,
        post_forward=post_forward,
        post_backward=post_backward,
    )
    hidden = (2, 8, config.hidden)
    assert calls == [
        ("pre_forward", 7),
        ("post_forward", hidden),  # the last layer's output, before post-process
        ("pre_forward", 7),
        ("pre_backward", 7),
        ("post_forward", hidden),
        ("post_backward", hidden),  # the grad of the chunk input, before pre-process backward
    ]
