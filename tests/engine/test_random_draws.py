"""A random draw in a forward step that runs ahead of an earlier microbatch's forward.

Plain training draws each microbatch's forward whole, in order. The overlapped schedule runs
the forwards in that order too (dropout there is plain's, bit for bit); orders that
interleave two forwards (fill_drain, run_pair of two forwards, a node schedule with several
forwards in flight) would draw in another order, and are refused at the step that draws.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

from moe_overlap import ConfigError, ModelChunkSchedulePlan, ScheduleError, combined_1f1b
from moe_overlap.engine.core._executor import ahead_forward_steps
from moe_overlap.steps import (
    NodeSchedule,
    Role,
    forward_pair_steps,
    microbatch_node_steps,
    run_pair,
)
from tests.torch_state import seeded

from .test_node_schedule import _shape, random_order
from .test_parity import assert_same
from .test_recompute_slots import dropout_model
from .toy_model import ToyConfig, ToyModel, grads, make_microbatches, plain_step

CONFIG = ToyConfig()
DRAWS = (
    r"node 'pre_dispatch_computation': expected no random draw in a forward step that runs "
    r"ahead of an earlier microbatch's forward .*received a forward that moved the CPU's "
    r"random generator .*fill_drain=False\), or turn the draws off"
)


def _refused(error: pytest.ExceptionInfo[ScheduleError]) -> None:
    assert isinstance(error.value.__cause__, ConfigError)
    assert re.search(DRAWS, str(error.value), re.DOTALL)


def test_dropout_under_the_overlapped_schedule_is_plain_s() -> None:
    """Forwards in microbatch order (overlapped or not): the draws are plain's."""
    ref = dropout_model(CONFIG, "mdm")
    mbs = make_microbatches(3, CONFIG)
    with seeded():
        want = plain_step(ref, mbs)
    for overlap in (True, False):
        model = copy.deepcopy(ref)
        model.zero_grad(set_to_none=True)
        with seeded():
            got = combined_1f1b(model, mbs, overlap=overlap)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        assert_same(grads(model), grads(ref))


def test_dropout_with_fill_drain_is_refused_before_any_gradient() -> None:
    """The fill runs microbatch 1's forward steps ahead of microbatch 0's: refused at the
    first one that draws, before any backward; the next step without fill_drain is exact."""
    ref = dropout_model(CONFIG, "mdm")
    model = copy.deepcopy(ref)
    mbs = make_microbatches(3, CONFIG)
    with seeded(), pytest.raises(ScheduleError) as error:
        combined_1f1b(model, mbs, fill_drain=True)
    _refused(error)
    assert "second forward microbatch 1, layer 0, slot pre_dispatch" in str(error.value)
    assert all(p.grad is None for p in model.parameters())
    with seeded():
        got = combined_1f1b(model, mbs)
    with seeded():
        want = plain_step(ref, mbs)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert_same(grads(model), grads(ref))


def test_dropout_in_run_pair_of_two_forwards_is_refused() -> None:
    model = dropout_model(CONFIG, "mdm")
    mbs = make_microbatches(2, CONFIG)
    first, second = (ModelChunkSchedulePlan(model, mb, index=i) for i, mb in enumerate(mbs))
    with pytest.raises(ScheduleError) as error:
        run_pair(first, second)
    _refused(error)
    assert first.released and second.released


def test_a_node_schedule_interleaving_forwards_is_refused_one_running_them_in_order_is_exact() -> (
    None
):
    ref = dropout_model(CONFIG, "mdm")
    mbs = make_microbatches(3, CONFIG)
    interleaved = random_order(_shape("mdm"), 3, seed=3)
    assert ahead_forward_steps(interleaved.steps, lambda s: s.microbatch)
    model = copy.deepcopy(ref)
    with seeded(), pytest.raises(ScheduleError) as error:
        combined_1f1b(model, mbs, schedule=interleaved)
    _refused(error)
    model.zero_grad(set_to_none=True)
    in_order = NodeSchedule(
        [s for mb in range(3) for s in microbatch_node_steps(_shape("mdm"), mb)[0]]
    )
    with seeded():
        got = combined_1f1b(model, mbs, schedule=in_order)
    with seeded():
        want = plain_step(ref, mbs)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert_same(grads(model), grads(ref))


def test_a_fill_drain_without_draws_is_exact() -> None:
    """A model that draws nothing: the watched steps pass, the fill is exact."""
    ref = ToyModel(CONFIG, "mdm")
    model = copy.deepcopy(ref)
    mbs = make_microbatches(4, CONFIG)
    got = combined_1f1b(model, mbs, fill_drain=True)
    want = plain_step(ref, mbs)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert_same(grads(model), grads(ref))


def test_the_steps_that_run_ahead() -> None:
    """In the fill, the second forward's steps with a step of the first after them; none in
    an order running each microbatch's forward whole."""
    shape = _shape("dm")
    steps = forward_pair_steps(shape, shape)
    ranks: dict[Role | None, int] = {Role.F: 0, Role.F2: 1}
    ahead = ahead_forward_steps(steps, lambda s: ranks.get(s.role))
    assert ahead and all(steps[i].role is Role.F2 for i in ahead)
    last_first = max(i for i, s in enumerate(steps) if s.role is Role.F)
    assert all(i < last_first for i in ahead)
    plain = [s for mb in range(3) for s in microbatch_node_steps(shape, mb)[0]]
    assert ahead_forward_steps(plain, lambda s: s.microbatch) == frozenset()
