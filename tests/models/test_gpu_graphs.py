"""On CUDA, bf16, real streams: CUDA-graphed scopes are bit-identical to eager, and refuse
what a captured graph cannot follow.

Skipped without a GPU (run on the lent H200).
"""

from __future__ import annotations

import copy
import dataclasses
import gc
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from moe_overlap import (
    ConfigError,
    CudaGraphModule,
    Microbatch,
    ScheduleError,
    combined_1f1b,
    make_streams,
)
from moe_overlap.blocks import GraphedBlock, discard_wgrad, finish_wgrad
from moe_overlap.models import GPTMoEModel, MoELayer
from moe_overlap.steps import Direction, NodeSchedule, Slot
from moe_overlap.wgrad import owed_wgrad
from tests.models._helpers import GPU_BF16, assert_same_grads, deterministic_cuda
from tests.models.test_graphs import RECOMPUTED, node_schedule_of

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

ALL = (CudaGraphModule.attn, CudaGraphModule.moe_router, CudaGraphModule.mlp)


@pytest.fixture(autouse=True)
def _deterministic() -> Iterator[None]:
    with deterministic_cuda():
        yield


@pytest.fixture(autouse=True, scope="module")
def _autograd_thread_has_a_context() -> None:
    """A capture's warm-up may run autograd's device thread's first kernel in cuBLAS, where
    torch warns that the thread has no current CUDA context (harmless; an error under the
    tests' warning filter): one eager backward first makes each test independent of order."""
    x = torch.ones(2, 2, device="cuda", requires_grad=True)
    torch.autograd.grad((x * 2).sum(), x)


def _model(
    graphs: tuple[CudaGraphModule, ...],
    *,
    delay: bool,
    dispatcher: str = "alltoall",
    aux: float = 0.0,
) -> GPTMoEModel:
    kind: Any = dispatcher
    config = dataclasses.replace(
        GPU_BF16,
        moe_aux_loss_coeff=aux,
        delay_wgrad_compute=delay,
        dispatcher=kind,
        cuda_graph_modules=graphs,
    )
    return GPTMoEModel(config, device="cuda")


def _microbatches(n: int, seq: int = 64, seed: int = 0) -> list[Microbatch]:
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randint(0, 128, (2, seq), generator=g).cuda() for _ in range(n)]
    return [Microbatch(input_ids=x, labels=x.roll(-1, 1)) for x in xs]


def _step(model: GPTMoEModel, mbs: list[Microbatch], how: str) -> list[torch.Tensor]:
    if how == "plain":
        losses: list[torch.Tensor] = []
        for mb in mbs:
            assert mb.input_ids is not None
            loss = model(mb.input_ids, labels=mb.labels)
            loss.backward()
            finish_wgrad(model)
            losses.append(loss.detach().float())
        return losses
    return combined_1f1b(
        model,
        mbs,
        options=model.schedule_options(),
        streams=make_streams("cuda"),
        fill_drain=how == "fill_drain",
    )


def _refused(model: GPTMoEModel, mbs: list[Microbatch], match: str) -> None:
    """The step fails with the graph's ConfigError (chained by the schedule's ScheduleError)."""
    with pytest.raises(ScheduleError, match=match) as info:
        _step(model, mbs, "1f1b")
    assert isinstance(info.value.__cause__, ConfigError)
    del info
    discard_wgrad(model)  # the documented recovery after a failed step
    model.zero_grad(set_to_none=True)


def _refused_until_reset(graphed: GPTMoEModel, eager: GPTMoEModel) -> None:
    """The next step is refused (the graphs would read what was replaced); after
    ``reset_graphs()`` the graphed model's step equals the eager one's, bit for bit."""
    _refused(graphed, _microbatches(2, seed=1), "reset_graphs")
    eager.zero_grad(set_to_none=True)
    graphed.reset_graphs()
    mbs = _microbatches(2, seed=2)
    for g, w in zip(_step(graphed, mbs, "1f1b"), _step(eager, mbs, "1f1b"), strict=True):
        assert torch.equal(g, w)
    assert_same_grads(graphed, eager)


@pytest.mark.parametrize("how", ["plain", "1f1b", "fill_drain"])
@pytest.mark.parametrize("delay", [False, True])
@pytest.mark.parametrize(
    ("graphs", "dispatcher"), [(ALL, "alltoall"), ((CudaGraphModule.attn,), "loopback")]
)
def test_graphed_scopes_are_bit_identical_to_eager(
    how: str, delay: bool, graphs: tuple[CudaGraphModule, ...], dispatcher: str
) -> None:
    eager = _model((), delay=delay, dispatcher=dispatcher)
    graphed = _model(graphs, delay=delay, dispatcher=dispatcher)
    for step in range(2):  # the first captures, the second replays the same copies
        mbs = _microbatches(4, seed=step)
        want = _step(eager, mbs, how)
        got = _step(graphed, mbs, how)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)
        assert_same_grads(graphed, eager)
    blocks = graphed.graphed_blocks()
    assert blocks and all(b.stats.eager_calls == 0 for b in blocks)
    # A copy per microbatch of a layer alive at once: one plainly, two in 1F1B, three when
    # the fill is overlapped (the second forward starts before the first backward).
    assert max(b.copies for b in blocks) == {"plain": 1, "1f1b": 2, "fill_drain": 3}[how]
    # Delayed: the schedule replays the wgrad graph in backward_dw; a plain backward (no
    # schedule claims the modules) replays it at once, in backward.
    replays = sum(b.stats.wgrad_replays for b in blocks)
    assert (replays > 0) == delay


def test_copies_captured_by_a_schedule_replay_exactly_in_a_plain_backward() -> None:
    """The same graphed, delayed model trained by the schedule, then by a plain backward
    (its captured copies replayed unclaimed: weight gradients at once), then by the
    schedule again: bit-identical to the eager model without delay, nothing owed."""
    eager = _model((), delay=False)
    graphed = _model(ALL, delay=True)
    for step, how in enumerate(("1f1b", "plain", "1f1b", "plain")):
        mbs = _microbatches(2, seed=step)
        want = _step(eager, mbs, how)
        got = _step(graphed, mbs, how)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), (step, how)
        assert not owed_wgrad(graphed), (step, how)
        assert_same_grads(graphed, eager)
    assert all(b.stats.eager_calls == 0 for b in graphed.graphed_blocks())


def test_a_shape_change_is_refused() -> None:
    model = _model(ALL, delay=True)
    _step(model, _microbatches(2), "1f1b")
    _refused(model, _microbatches(2, seq=32), "same shapes every microbatch")


def test_moved_parameters_are_refused_until_reset() -> None:
    eager = _model((), delay=True)
    graphed = _model(ALL, delay=True)
    _step(eager, _microbatches(2), "1f1b")
    _step(graphed, _microbatches(2), "1f1b")
    weight = graphed.layer_list[1].attn_block.attention.qkv.weight
    weight.data = weight.data.clone()  # new storage: the graph would read the old one
    _refused_until_reset(graphed, eager)


@pytest.mark.parametrize("part", ["qkv", "attention", "router", "shared_expert", "pre_mlp_norm"])
def test_a_submodule_replaced_after_the_capture_is_refused_until_reset(part: str) -> None:
    """Outside debug mode too: a replaced module's parameters are other objects, found by
    the walk that any registration since the last one triggers."""
    eager = _model((), delay=True)
    graphed = _model(ALL, delay=True)
    _step(eager, _microbatches(2), "1f1b")
    _step(graphed, _microbatches(2), "1f1b")
    for model in (eager, graphed):  # a copy of the module, as a new object, in both
        moe: Any = model.layer_list[1]
        if part == "qkv":
            old = moe.attn_block.attention.qkv
            moe.attn_block.attention.qkv = copy.deepcopy(old)
        elif part == "attention":
            moe.attn_block.attention = copy.deepcopy(moe.attn_block.attention)
        elif part == "router":
            moe.router = copy.deepcopy(moe.router)
        elif part == "shared_expert":
            moe.shared_expert = copy.deepcopy(moe.shared_expert)
        else:
            moe.pre_mlp_norm = copy.deepcopy(moe.pre_mlp_norm)
    _refused_until_reset(graphed, eager)


def test_a_changed_aux_loss_scale_is_refused() -> None:
    model = _model(ALL, delay=False, aux=0.01)
    _step(model, _microbatches(2), "1f1b")
    model.set_aux_loss_scale(0.5)
    _refused(model, _microbatches(2), "frozen values")


def _scheduled(
    model: GPTMoEModel,
    mbs: list[Microbatch],
    *,
    recompute: bool,
    schedule: NodeSchedule | None = None,
    fill_drain: bool = False,
) -> list[torch.Tensor]:
    """The step on CUDA streams, with the pre-dispatch and mlp recomputed or not."""
    options = dataclasses.replace(
        model.schedule_options(), recompute=RECOMPUTED if recompute else ()
    )
    streams = make_streams("cuda")
    if schedule is not None:
        return combined_1f1b(model, mbs, options=options, streams=streams, schedule=schedule)
    return combined_1f1b(model, mbs, options=options, streams=streams, fill_drain=fill_drain)


def copies_needed(schedule: NodeSchedule, model: GPTMoEModel, *, recompute: bool) -> int:
    """The most microbatches holding a graph copy of one block at once in ``schedule``: a
    graphed pre-dispatch (a dense layer's mlp too) holds one from its forward to its
    backward (with delayed weight gradients, to its ``W``); recomputed, only during the
    forward, then from its recompute (``R``, else its backward) on."""
    delay = model.config.delay_wgrad_compute
    at = {(s.direction, s.microbatch, s.layer, s.slot): k for k, s in enumerate(schedule.steps)}
    keys = [(i, Slot.PRE_DISPATCH) for i in range(len(model.layer_list))]
    keys += [(i, Slot.MLP) for i, x in enumerate(model.layer_list) if not isinstance(x, MoELayer)]
    most = 0
    for layer, slot in keys:
        spans: list[tuple[int, int]] = []
        for mb in range(schedule.microbatches):
            f = at[(Direction.FORWARD, mb, layer, slot)]
            b = at[(Direction.BACKWARD, mb, layer, slot)]
            end = at[(Direction.WGRAD, mb, layer, slot)] if delay else b
            if recompute:
                r = at.get((Direction.RECOMPUTE, mb, layer, slot), b)
                spans += [(f, f + 1), (r, max(end, r + 1))]
            else:
                spans.append((f, end))
        most = max(most, *(sum(a <= k < z for a, z in spans) for k in range(len(schedule))))
    return most


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("delay", [False, True])
def test_a_node_schedule_with_graphs_is_bit_identical_to_eager(
    delay: bool, recompute: bool
) -> None:
    """Three microbatches in flight (``W`` steps when delayed; ``R`` steps, recomputed): each
    graphed forward takes a copy no other microbatch holds, so nothing is overwritten; a
    recomputed slot's forward gives its copy back at once, its recompute takes one."""
    eager = _model((), delay=delay)
    graphed = _model(ALL, delay=delay)
    schedule = node_schedule_of(graphed, 4, recompute=recompute)
    for step in range(2):  # the first captures, the second replays the same copies
        mbs = _microbatches(4, seed=step)
        want = _scheduled(eager, mbs, recompute=recompute, schedule=schedule)
        got = _scheduled(graphed, mbs, recompute=recompute, schedule=schedule)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), step
        assert_same_grads(graphed, eager)
        assert not owed_wgrad(graphed)
    blocks = graphed.graphed_blocks()
    assert blocks and all(b.stats.eager_calls == 0 for b in blocks)
    assert max(b.copies for b in blocks) == copies_needed(schedule, graphed, recompute=recompute)


@pytest.mark.parametrize("fill_drain", [False, True])
@pytest.mark.parametrize("delay", [False, True])
def test_the_schedule_s_recompute_with_graphs_is_bit_identical_to_eager(
    delay: bool, fill_drain: bool
) -> None:
    """Pre-dispatch and mlp recomputed by the schedule (at their backward): the graphed
    scopes replay twice per microbatch, the same bits as eager, with no more copies than
    without recompute."""
    eager = _model((), delay=delay)
    graphed = _model(ALL, delay=delay)
    for step in range(2):
        mbs = _microbatches(4, seed=step)
        want = _scheduled(eager, mbs, recompute=True, fill_drain=fill_drain)
        got = _scheduled(graphed, mbs, recompute=True, fill_drain=fill_drain)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), step
        assert_same_grads(graphed, eager)
    blocks = graphed.graphed_blocks()
    assert blocks and all(b.stats.eager_calls == 0 for b in blocks)
    assert all(b.stats.forward_replays == 2 * 2 * 4 for b in blocks)  # 2 steps, 4 mbs, twice
    assert 1 <= max(b.copies for b in blocks) <= (3 if fill_drain else 2)


def test_a_graphed_function_draws_the_random_numbers_eager_draws() -> None:
    """Dropout inside a graphed block: the capture's warm-up draws are undone, so each call
    (the capturing one too) draws the mask an eager call at the same random state draws and
    leaves the generator where eager leaves it; a second forward at the state of a first
    whose copy is still busy (a recompute) captures a copy and draws the first one's mask."""
    linear = torch.nn.Linear(64, 64, device="cuda")

    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(linear(x), 0.5)

    block = GraphedBlock(fn, [linear], CudaGraphModule.attn, label="dropout")
    x = torch.randn(8, 64, device="cuda", requires_grad=True)
    for call in range(3):  # the first captures, the others replay
        torch.manual_seed(call)
        want = fn(x)
        (want_grad,) = torch.autograd.grad(want.sum(), x)
        want = want.detach()  # its graph would hold the parameters' accumulators (below)
        after = torch.cuda.get_rng_state()
        torch.manual_seed(call)
        (got,) = block(x)
        (got_grad,) = torch.autograd.grad(got.sum(), x)
        assert torch.equal(got, want) and torch.equal(got_grad, want_grad), call
        assert torch.equal(torch.cuda.get_rng_state(), after), call
    torch.manual_seed(7)
    (first,) = block(x)  # holds the one copy until its graph goes
    torch.manual_seed(7)
    (again,) = block(x)
    assert block.copies == 2 and torch.equal(again, first)
    assert block.stats.captures == 2 and block.stats.eager_calls == 0


def test_a_capture_while_an_eager_graph_holds_the_parameters_is_refused_clearly() -> None:
    """An eager output kept alive across the first graphed call keeps its parameters'
    gradient accumulators on the default stream, which a captured backward cannot wait on:
    the library's error names the scope, the cause and the fix (not CUDA's invalidated
    capture alone); with the output dropped, the next call captures and is exact."""
    linear = torch.nn.Linear(64, 64, device="cuda")

    def fn(x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = linear(x)
        return out

    block = GraphedBlock(fn, [linear], CudaGraphModule.attn, label="kept")
    x = torch.randn(8, 64, device="cuda", requires_grad=True)
    kept = fn(x)
    with pytest.raises(ConfigError, match=r"kept: capturing the CUDA graph of scope 'attn'.*Drop"):
        block(x)
    want = kept.detach()
    del kept
    (got,) = block(x)
    assert torch.equal(got, want) and block.copies == 1


def test_a_graphed_model_collected_inside_a_later_capture_does_not_break_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A dropped graphed model that a reference cycle holds is freed when Python's collector
    next runs; inside another block's capture, destroying its graphs would invalidate that
    capture. Here the collector runs right after every capture begins whenever it is enabled
    (as an automatic collection could), and never otherwise: the block pauses it while it
    captures, so the later model captures and its step equals the eager one, bit for bit."""
    old = _model(ALL, delay=True)
    _step(old, _microbatches(2), "1f1b")
    cycle: list[object] = [old]
    cycle.append(cycle)
    del old, cycle
    begin = torch.cuda.CUDAGraph.capture_begin

    def begin_then_collect(self: torch.cuda.CUDAGraph, *args: Any, **kwargs: Any) -> None:
        begin(self, *args, **kwargs)
        if gc.isenabled():
            gc.collect()

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", begin_then_collect)
    threshold = gc.get_threshold()
    gc.set_threshold(10**9)  # no automatic collection frees the cycle before a capture
    try:
        eager = _model((), delay=True)
        graphed = _model(ALL, delay=True)
        mbs = _microbatches(2, seed=3)
        for g, w in zip(_step(graphed, mbs, "1f1b"), _step(eager, mbs, "1f1b"), strict=True):
            assert torch.equal(g, w)
        assert_same_grads(graphed, eager)
    finally:
        gc.set_threshold(*threshold)
        monkeypatch.undo()
        gc.collect()


def test_a_refused_capture_leaves_the_device_s_random_numbers_as_they_were() -> None:
    """A capture CUDA invalidated (here by a host synchronisation inside the scope) leaves
    torch's generator in capture mode, its epilogue skipped, after which every draw on the
    device fails: the refusal restores it, at the same random state."""
    linear = torch.nn.Linear(64, 64, device="cuda")

    def fn(x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = linear(x) * (x.sum().item() > 0)
        return out

    block = GraphedBlock(fn, [linear], CudaGraphModule.attn, label="synced")
    x = torch.randn(8, 64, device="cuda", requires_grad=True)
    torch.manual_seed(5)
    want = torch.rand(16, device="cuda")
    torch.manual_seed(5)
    with pytest.raises(ConfigError, match="synced: capturing the CUDA graph"):
        block(x)
    got = torch.rand(16, device="cuda")
    assert torch.equal(got, want)
