"""On CUDA, with real compute and communication streams: the same bit-identity.

Skipped without a GPU. Run on the lent H200 with ``pytest tests/engine/test_gpu.py``.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from moe_overlap import Microbatch, ScheduleOptions, combined_1f1b, make_event, make_streams
from moe_overlap.steps import Direction, ScheduleOrder, microbatch_node_steps

from .test_order import sample_orders
from .test_parity import assert_same
from .toy_model import ToyConfig, ToyModel, grads, make_microbatches, plain_step

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def to_cuda(mbs: list[Microbatch]) -> list[Microbatch]:
    def mv(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.cuda()

    return [
        Microbatch(input_ids=mv(m.input_ids), position_ids=mv(m.position_ids), labels=mv(m.labels))
        for m in mbs
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("delay", [False, True])
@pytest.mark.parametrize("kinds", ["dd", "mm", "dmdm", "dmt"])
@pytest.mark.parametrize("high_priority", [False, True])
@pytest.mark.parametrize("fill_drain", [False, True])
@pytest.mark.parametrize("order_seed", [None, 0, 1])
def test_cuda_parity(
    dtype: torch.dtype,
    delay: bool,
    kinds: str,
    high_priority: bool,
    fill_drain: bool,
    order_seed: int | None,
) -> None:
    """``order_seed``: a random valid step order of each kind (issue 27), else Megatron's."""
    config = ToyConfig(hidden=64, shared_expert=True)
    ref = ToyModel(config, kinds).to(device="cuda", dtype=dtype)
    model = copy.deepcopy(ref)
    mbs = to_cuda(make_microbatches(4, config, batch=4, seq=64))
    ref_losses = plain_step(ref, mbs)
    model.set_delay(delay)
    streams = make_streams("cuda", high_priority_comm=high_priority)
    losses = combined_1f1b(
        model,
        mbs,
        options=ScheduleOptions(
            delay_wgrad_compute=delay,
            order=ScheduleOrder() if order_seed is None else sample_orders(order_seed),
        ),
        streams=streams,
        fill_drain=fill_drain,
    )
    torch.cuda.synchronize()
    for got, want in zip(losses, ref_losses, strict=True):
        assert torch.equal(got, want.float())
    assert_same(grads(model), grads(ref))


def test_cpu_streams_rejected_for_cuda_inputs() -> None:
    from moe_overlap import ModelChunkSchedulePlan, StreamError

    config = ToyConfig()
    model = ToyModel(config, "m").cuda()
    (mb,) = to_cuda(make_microbatches(1, config))
    with pytest.raises(StreamError, match="inputs are on cuda"):
        ModelChunkSchedulePlan(
            model,
            mb,
            streams=make_streams("cpu"),
        )


@pytest.mark.parametrize("delay", [False, True])
def test_cuda_timeline_observes_without_changing_anything(delay: bool) -> None:
    from moe_overlap.timeline import Timeline

    config = ToyConfig(hidden=64, shared_expert=True)
    ref = ToyModel(config, "dmt").cuda()
    model = copy.deepcopy(ref)
    ref.set_delay(delay)
    model.set_delay(delay)
    mbs = to_cuda(make_microbatches(3, config, batch=4, seq=64))
    options = ScheduleOptions(delay_wgrad_compute=delay)
    streams = make_streams("cuda")
    ref_losses = combined_1f1b(ref, mbs, options=options, streams=streams)
    timeline = Timeline()
    losses = combined_1f1b(model, mbs, options=options, streams=streams, observer=timeline)
    torch.cuda.synchronize()
    for got, want in zip(losses, ref_losses, strict=True):
        assert torch.equal(got, want)
    assert_same(grads(model), grads(ref))
    spans = timeline.spans()
    assert spans and all(0.0 <= s.start_ms <= s.end_ms for s in spans)
    kinds = {s.stream.value for s in spans}
    assert kinds == {"comp", "comm"}
    assert (Direction.WGRAD in {s.direction for s in spans}) == delay


def test_node_stream_switch_leaves_the_state_torch_cuda_stream_leaves() -> None:
    """A node on the current stream skips ``torch.cuda.stream``'s work (a compute node's
    usual case), one on another stream does not; both leave the caller's stream current
    after, also when the body switched streams without switching back."""
    from moe_overlap.engine.core._streams import _AlreadyCurrent, enter_stream, leave_stream

    main = torch.cuda.current_stream()
    side = make_streams("cuda").comm
    event = make_event("cuda")
    assert isinstance(side, torch.cuda.Stream)
    for stream, elided in ((main, True), (side, False)):
        switch = enter_stream(stream, event)
        assert isinstance(switch, _AlreadyCurrent) == elided
        assert torch.cuda.current_stream() == stream
        torch.cuda.set_stream(side if stream == main else main)  # a body that switches away
        leave_stream(stream, event, switch)
        assert torch.cuda.current_stream() == main
    torch.cuda.synchronize()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("delay", [False, True])
@pytest.mark.parametrize("fill_drain", [False, True])
@pytest.mark.parametrize("where", [None, "early", "random"])
def test_cuda_recompute_parity(
    dtype: torch.dtype, delay: bool, fill_drain: bool, where: str | None
) -> None:
    """Recomputed pre-dispatch and mlp (``ScheduleOptions.recompute``) on CUDA streams, R
    steps at the backward, first, or at random places: plain backward()'s bits; a timeline
    sees the R steps."""
    from moe_overlap.timeline import Timeline

    from .test_recompute_slots import recompute_order

    config = ToyConfig(hidden=64, shared_expert=True)
    ref = ToyModel(config, "mdt").to(device="cuda", dtype=dtype)
    model = copy.deepcopy(ref)
    mbs = to_cuda(make_microbatches(4, config, batch=4, seq=64))
    ref_losses = plain_step(ref, mbs)
    model.set_delay(delay)
    options = ScheduleOptions(
        delay_wgrad_compute=delay,
        recompute=("pre_dispatch", "mlp"),
        order=recompute_order(where, seed=int(delay) + 2 * int(fill_drain)),
    )
    timeline = Timeline()
    losses = combined_1f1b(
        model,
        mbs,
        options=options,
        streams=make_streams("cuda"),
        fill_drain=fill_drain,
        observer=timeline,
    )
    torch.cuda.synchronize()
    for got, want in zip(losses, ref_losses, strict=True):
        assert torch.equal(got, want.float())
    assert_same(grads(model), grads(ref))
    assert (Direction.RECOMPUTE in {s.direction for s in timeline.spans()}) == (where is not None)


@pytest.mark.parametrize("where", [None, "early"])
def test_cuda_recompute_draws_the_same_dropout_mask(where: str | None) -> None:
    """Dropout in recomputed slots: the CUDA generator is restored for the recompute and the
    caller's state put back after, so the run equals the one that keeps its activations."""
    from .test_recompute_slots import Name, dropout_model, recompute_order

    config = ToyConfig(hidden=64)
    ref = dropout_model(config, "mdm").cuda()
    mbs = to_cuda(make_microbatches(3, config, batch=4, seq=64))
    runs = []
    both: tuple[Name, ...] = ("pre_dispatch", "mlp")
    for recompute in ((), both):
        model = copy.deepcopy(ref)
        options = ScheduleOptions(recompute=recompute, order=recompute_order(where))
        torch.manual_seed(0)
        losses = combined_1f1b(model, mbs, options=options, streams=make_streams("cuda"))
        torch.cuda.synchronize()
        runs.append((model, losses, torch.cuda.get_rng_state()))
    (kept, kept_losses, kept_rng), (model, losses, rng) = runs
    assert all(torch.equal(a, b) for a, b in zip(losses, kept_losses, strict=True))
    assert_same(grads(model), grads(kept))
    assert torch.equal(rng, kept_rng)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("delay", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cuda_node_schedule_parity(dtype: torch.dtype, delay: bool, seed: int) -> None:
    """A random exact node schedule, 2 to 4 microbatches in flight, on CUDA streams."""
    from .test_node_schedule import _shape, random_order, run_both

    kinds = ["mdm", "mm", "dm"][seed]
    schedule = random_order(_shape(kinds, delay=delay), 5, seed, in_flight=2 + seed)
    run_both(kinds, schedule, delay=delay, device="cuda", dtype=dtype)


def test_cuda_node_schedule_ending_in_a_weight_gradient_is_awaited_by_the_caller() -> None:
    """A schedule whose last step is a slow W on the compute stream, called from another
    stream: the gradients the caller reads right after are the finished ones."""
    from moe_overlap.engine._torch_private import cuda_sleep
    from moe_overlap.steps import NodeSchedule

    from .test_node_schedule import _shape
    from .toy_model import DelayedLinear

    config = ToyConfig(hidden=64)
    ref = ToyModel(config, "m").cuda()
    model = copy.deepcopy(ref)
    mbs = to_cuda(make_microbatches(2, config, batch=4, seq=64))
    plain_step(ref, mbs)
    want = grads(ref)
    model.set_delay(True)
    steps = [s for mb in range(2) for s in microbatch_node_steps(_shape("m", delay=True), mb)[0]]
    last_w = max(i for i, s in enumerate(steps) if str(s) == "L0.pre_dispatch.W1@comp")
    steps.append(steps.pop(last_w))  # the schedule ends with a weight gradient
    for module in model.modules():
        if isinstance(module, DelayedLinear):
            slow = module.backward_dw

            def backward_dw(slow: Any = slow) -> None:
                cuda_sleep(200_000_000)  # about 0.1 s of GPU cycles
                slow()

            module.backward_dw = backward_dw  # type: ignore[method-assign]
    streams = make_streams("cuda")
    caller = make_streams("cuda").comm  # a new stream, not the compute one
    assert isinstance(caller, torch.cuda.Stream)
    with torch.cuda.stream(caller):
        combined_1f1b(
            model,
            mbs,
            streams=streams,
            options=ScheduleOptions(delay_wgrad_compute=True),
            schedule=NodeSchedule(steps),
        )
        got = grads(model)  # cloned on the caller's stream, right away
    torch.cuda.synchronize()
    assert_same(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_the_planner_s_best_schedules_are_bit_identical(dtype: torch.dtype) -> None:
    """Every committed frontier's best orders (up to four in flight, delayed W, early R) on
    CUDA streams, each against plain backward()."""
    from moe_overlap.steps import NodeSchedule

    from .test_node_schedule import _frontier_orders, frontier_options, run_both

    for _, order in _frontier_orders():
        schedule = NodeSchedule.parse(order)
        run_both("mmmm", schedule, **frontier_options(schedule), device="cuda", dtype=dtype)
