"""combined_1f1b is bit-identical to plain per-microbatch ``loss.backward()``."""

from __future__ import annotations

import copy

import pytest
import torch

from moe_overlap import ModelChunkSchedulePlan, ScheduleOptions, combined_1f1b

from .toy_model import ToyConfig, ToyModel, grads, make_microbatches, plain_step

STACKS = {
    "dense": "dd",
    "moe": "mm",
    "mixed": "dmdm",
    "mtp": "dmt",
}


def assert_same(a: dict[str, torch.Tensor | None], b: dict[str, torch.Tensor | None]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        x, y = a[name], b[name]
        assert (x is None) == (y is None), name
        if x is not None and y is not None:
            assert torch.equal(x, y), f"{name}: max diff {(x - y).abs().max().item()}"


def run_both(
    kinds: str,
    n_mb: int,
    *,
    delay: bool = False,
    free_input: bool = True,
    overlap: bool = True,
    early: bool = False,
    shared: bool = False,
) -> None:
    config = ToyConfig(shared_expert=shared)
    ref = ToyModel(config, kinds)
    model = copy.deepcopy(ref)
    mbs = make_microbatches(n_mb, config)
    ref_losses = plain_step(ref, mbs)
    model.set_delay(delay)
    options = ScheduleOptions(
        delay_wgrad_compute=delay,
        free_input=free_input,
        ep_overlap_early_attn_memory_release=early,
    )
    losses = combined_1f1b(model, mbs, overlap=overlap, options=options)
    assert model.pending_wgrad == 0
    assert len(losses) == n_mb
    for got, want in zip(losses, ref_losses, strict=True):
        assert torch.equal(got, want)
    assert_same(grads(model), grads(ref))


@pytest.mark.parametrize("stack", sorted(STACKS))
@pytest.mark.parametrize("n_mb", [1, 2, 3, 6])
@pytest.mark.parametrize("delay", [False, True], ids=["eager-wgrad", "delayed-wgrad"])
def test_combined_matches_plain(stack: str, n_mb: int, delay: bool) -> None:
    run_both(STACKS[stack], n_mb, delay=delay)


@pytest.mark.parametrize("n_mb", [4, 5])
def test_shared_expert(n_mb: int) -> None:
    run_both("dmm", n_mb, shared=True, delay=True)


@pytest.mark.parametrize("free_input", [False, True])
@pytest.mark.parametrize("early", [False, True])
def test_options(free_input: bool, early: bool) -> None:
    run_both("mdm", 3, free_input=free_input, early=early, delay=True)


@pytest.mark.parametrize("delay", [False, True])
def test_plain_mode_matches(delay: bool) -> None:
    run_both("dmm", 3, overlap=False, delay=delay)


@pytest.mark.parametrize("layers", [(2, 1), (1, 2), (1, 1), (3, 1), (0, 2)])
@pytest.mark.parametrize("delay", [False, True])
def test_chunks_with_different_layer_counts(layers: tuple[int, int], delay: bool) -> None:
    """As Megatron-Core's chunk test: model 1's forward overlaps model 0's backward."""
    config = ToyConfig()
    refs = [ToyModel(config, "m" * n, seed=i) for i, n in enumerate(layers)]
    models = [copy.deepcopy(r) for r in refs]
    mbs = make_microbatches(2, config)
    ref_losses = [plain_step(r, [mb])[0] for r, mb in zip(refs, mbs, strict=True)]
    options = ScheduleOptions(delay_wgrad_compute=delay)
    plans = []
    for m, mb, i in zip(models, mbs, range(2), strict=True):
        m.set_delay(delay)
        plans.append(
            ModelChunkSchedulePlan(
                m,
                mb,
                options=options,
                index=i,
            )
        )
    out0 = ModelChunkSchedulePlan.run(plans[0], None)
    assert out0 is not None
    out1 = ModelChunkSchedulePlan.run(plans[1], plans[0], b_grad=torch.ones_like(out0))
    assert out1 is not None
    assert ModelChunkSchedulePlan.run(None, plans[1], b_grad=torch.ones_like(out1)) is None
    assert torch.equal(out0, ref_losses[0])
    assert torch.equal(out1, ref_losses[1])
    for m, r in zip(models, refs, strict=True):
        assert m.pending_wgrad == 0
        assert_same(grads(m), grads(r))


def test_loss_scale() -> None:
    config = ToyConfig()
    ref = ToyModel(config, "dm")
    model = copy.deepcopy(ref)
    mbs = make_microbatches(3, config)
    for mb in mbs:
        (ref(mb) * 0.25).backward()
    combined_1f1b(model, mbs, loss_scale=0.25)
    assert_same(grads(model), grads(ref))


def test_repeated_steps_accumulate_like_plain() -> None:
    config = ToyConfig()
    ref = ToyModel(config, "mdm")
    model = copy.deepcopy(ref)
    for step in range(2):
        mbs = make_microbatches(3, config, seed=step)
        plain_step(ref, mbs)
        combined_1f1b(model, mbs)
    assert_same(grads(model), grads(ref))
