"""The fill/drain variant: the first two forwards and the last two backwards overlapped.

Step lists as data (no tensors), then bit-identity to plain per-microbatch backward().
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from moe_overlap import ConfigError, ScheduleOptions, combined_1f1b
from moe_overlap.steps import (
    ChunkShape,
    Direction,
    LayerShape,
    Role,
    Slot,
    Step,
    StreamKind,
    backward_pair_steps,
    chunk_steps,
    forward_pair_steps,
)

from .test_parity import STACKS, assert_same
from .toy_model import ToyConfig, ToyModel, grads, make_microbatches, plain_step


def _shape(kinds: str, delay: bool) -> ChunkShape:
    return ChunkShape(
        layers=tuple(
            LayerShape(index=i, is_moe=k == "m", delay_wgrad=delay) for i, k in enumerate(kinds)
        )
    )


def _body(steps: list[Step], role: Role) -> list[tuple[int | None, Slot | None, Direction]]:
    return [(s.layer, s.slot, s.direction) for s in steps if s.role is role]


@pytest.mark.parametrize("kinds", ["m", "dm", "mdm", "dd"])
@pytest.mark.parametrize("delay", [False, True])
def test_each_microbatch_of_a_pair_walks_its_own_chunk_in_order(kinds: str, delay: bool) -> None:
    shape = _shape(kinds, delay)
    alone_f = _body(chunk_steps(shape, None), Role.F)
    alone_b = _body(chunk_steps(None, shape), Role.B)
    fwd = forward_pair_steps(shape, shape)
    bwd = backward_pair_steps(shape, shape)
    assert _body(fwd, Role.F) == _body(fwd, Role.F2) == alone_f
    assert {s.role for s in fwd} == {Role.F, Role.F2}
    assert _body(bwd, Role.B) == _body(bwd, Role.B2) == alone_b
    assert {s.role for s in bwd} == {Role.B, Role.B2}


@pytest.mark.parametrize("delay", [False, True])
def test_the_earlier_backward_accumulates_every_parameter_first(delay: bool) -> None:
    """Each (layer, slot, direction) of b runs before c's: gradients add in microbatch order;
    and b's weight gradient of a slot before c's backward of it (one owed at a time)."""
    steps = backward_pair_steps(_shape("dmm", delay), _shape("dmm", delay))
    where = {(s.role, s.layer, s.slot, s.direction): i for i, s in enumerate(steps)}
    for (role, layer, slot, direction), i in where.items():
        if role is Role.B:
            assert i < where[(Role.B2, layer, slot, direction)]
            if direction is Direction.WGRAD:
                assert i < where[(Role.B2, layer, slot, Direction.BACKWARD)]


def test_each_all_to_all_has_the_other_microbatch_s_compute_beside_it() -> None:
    for steps in (
        forward_pair_steps(_shape("mm", False), _shape("mm", False)),
        backward_pair_steps(_shape("mm", False), _shape("mm", False)),
    ):
        comp = [i for i, s in enumerate(steps) if s.stream is StreamKind.COMP]
        for i, s in enumerate(steps):
            if s.stream is not StreamKind.COMM:
                continue
            before = [steps[j] for j in comp if j < i][-1:]
            after = [steps[j] for j in comp if j > i][:1]
            beside = {t.role for t in before + after}
            assert beside - {s.role}, f"{s}: no compute of the other microbatch beside it"


def test_pairs_of_chunks_of_different_models_are_refused() -> None:
    with pytest.raises(ConfigError, match="two chunks of one model"):
        forward_pair_steps(_shape("mm", False), _shape("m", False))


@pytest.mark.parametrize("stack", sorted(STACKS))
@pytest.mark.parametrize("n_mb", [2, 3, 5])
@pytest.mark.parametrize("delay", [False, True])
@pytest.mark.parametrize("free_input", [True, False])
def test_fill_drain_is_bit_identical(stack: str, n_mb: int, delay: bool, free_input: bool) -> None:
    config = ToyConfig(shared_expert=True)
    ref = ToyModel(config, STACKS[stack])
    model = copy.deepcopy(ref)
    mbs = make_microbatches(n_mb, config)
    want = plain_step(ref, mbs)
    model.set_delay(delay)
    options = ScheduleOptions(delay_wgrad_compute=delay, free_input=free_input)
    got = combined_1f1b(model, mbs, options=options, fill_drain=True)
    assert model.pending_wgrad == 0
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert_same(grads(model), grads(ref))


def test_one_microbatch_runs_the_plain_overlapped_schedule() -> None:
    config = ToyConfig()
    ref = ToyModel(config, "dm")
    model = copy.deepcopy(ref)
    mbs = make_microbatches(1, config)
    assert combined_1f1b(model, mbs, fill_drain=True) == plain_step(ref, mbs)
    assert_same(grads(model), grads(ref))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"fill_drain": 1}, "fill_drain must be a bool, received int"),
        ({"fill_drain": True, "overlap": False}, "expected overlap=True with it"),
    ],
)
def test_fill_drain_arguments_are_checked(kwargs: dict[str, Any], match: str) -> None:
    config = ToyConfig()
    model = ToyModel(config, "m")
    with pytest.raises(ConfigError, match=match):
        combined_1f1b(model, make_microbatches(2, config), **kwargs)
