"""ScheduleNode, NoopScheduleNode, TransformerLayerNode, weak_method, streams on CPU."""

from __future__ import annotations

import gc
import weakref
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, cast

import pytest
import torch
from torch import Tensor

from moe_overlap import (
    ChunkState,
    ConfigError,
    IntegrationError,
    LayerArgs,
    LayerState,
    Microbatch,
    NodeStateError,
    NoopScheduleNode,
    ScheduleNode,
    SlotContext,
    StreamError,
    StreamPair,
    TransformerLayerNode,
    TypeHintError,
    WgradError,
    get_comm_stream,
    get_comp_stream,
    make_event,
    make_streams,
    set_streams,
    weak_method,
)
from moe_overlap.engine import DEBUG, wait_stream
from moe_overlap.engine._use_stream import use_stream
from moe_overlap.engine.core._streams import record_event, wait_event
from moe_overlap.megatron import layer_args, layer_schedule_plan
from moe_overlap.streams import CpuEvent, CpuStream, reset_streams

CPU = CpuStream("test")


def cpu_stream() -> CpuStream:
    return CPU


@dataclass(frozen=True)
class Cfg:
    moe_token_dispatcher_type: str = "alltoall"
    moe_flex_dispatcher_backend: str | None = None
    fp8: str | None = None
    fp4: str | None = None
    cuda_graph_modules: tuple[object, ...] = ()


def square(x: Tensor) -> Tensor:
    return x * x


def test_forward_detaches_and_keeps_requires_grad() -> None:
    x = torch.randn(3, requires_grad=True)
    c = torch.randn(3)
    node = ScheduleNode(lambda a, b: a * b, cpu_stream, CpuEvent(), name="mul")
    (y,) = node.forward(x, c)
    assert node.inputs[0] is not x
    assert node.inputs[0] is not None and node.inputs[0].requires_grad
    assert node.inputs[1] is not None and not node.inputs[1].requires_grad
    assert y.grad_fn is not None
    gx, gc_ = node.backward(torch.ones(3))
    assert gc_ is None
    assert gx is not None and torch.equal(gx, c)
    assert x.grad is None  # the graph was cut at the node's input


def test_node_is_one_shot() -> None:
    node = ScheduleNode(square, cpu_stream, CpuEvent(), name="sq")
    with pytest.raises(NodeStateError, match="backward must run after forward"):
        node.backward(torch.ones(2))
    node.forward(torch.ones(2, requires_grad=True))
    with pytest.raises(NodeStateError, match="forward expected a new node"):
        node.forward(torch.ones(2))
    with pytest.raises(NodeStateError, match="expected 1 output grads"):
        node.backward(torch.ones(2), torch.ones(2))
    node.backward(torch.ones(2))
    with pytest.raises(NodeStateError, match="backward must run once"):
        node.backward(torch.ones(2))
    assert node.inputs == () and node.outputs == ()


def test_forward_must_return_tensors() -> None:
    def bad(x: Tensor) -> object:
        return (x, 3)

    node = ScheduleNode(bad, cpu_stream, CpuEvent(), name="bad")  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    with pytest.raises(IntegrationError, match=r"'bad'.*tuple\(Tensor, int\)"):
        node.forward(torch.ones(1))


def test_free_input_releases_the_caller_storage() -> None:
    x = torch.randn(4, requires_grad=True) * 2  # non-leaf, as a previous node's output
    node = ScheduleNode(lambda a: a.exp(), cpu_stream, CpuEvent(), free_input=True, name="exp")
    (y,) = node.forward(x)
    assert x.untyped_storage().size() == 0
    assert y.untyped_storage().size() > 0
    (g,) = node.backward(torch.ones(4))
    assert g is not None and torch.equal(g, y.detach())  # exp saves its output, not its input


def test_none_grads_and_non_grad_outputs_are_skipped() -> None:
    x = torch.randn(3, requires_grad=True)
    node = ScheduleNode(lambda a: (a * 2, a.argmax().unsqueeze(0)), cpu_stream, CpuEvent())
    node.forward(x)
    (g,) = node.backward(None, None)
    assert g is None


def test_noop_node_passes_through() -> None:
    node = NoopScheduleNode()
    t = torch.ones(1)
    assert node.forward(t) == (t,)
    assert node.backward(t, None) == (t, None)


def test_layer_node_detach_flows_backward() -> None:
    state, chunk = LayerState(), ChunkState(Microbatch())
    args = LayerArgs(config=Cfg())

    def first(node: SlotContext, inputs: tuple[Tensor, ...]) -> Tensor:
        (x,) = inputs
        h = x * 3
        node.layer_state.residual = node.detach(h)
        return h * 2

    def second(node: SlotContext, inputs: tuple[Tensor, ...]) -> Tensor:
        (y,) = inputs
        assert node.layer_state.residual is not None
        return y + node.layer_state.residual

    a = TransformerLayerNode(
        cpu_stream, CpuEvent(), state, chunk, first, "pre_dispatch_computation", extra_args=args
    )
    b = TransformerLayerNode(cpu_stream, CpuEvent(), state, chunk, second, "mlp", extra_args=args)
    x = torch.ones(2, requires_grad=True)
    (h,) = a.forward(x)
    (_out,) = b.forward(h)
    (gh,) = b.backward(torch.ones(2))
    (gx,) = a.backward(gh)
    # d(out)/dx = d(6x + 3x)/dx = 9
    assert gx is not None and torch.equal(gx, torch.full((2,), 9.0))


def test_layer_args_from_mapping() -> None:
    args = layer_args({"config": Cfg(), "is_moe": True, "num_local_experts": 4})
    assert args.is_moe and args.num_local_experts == 4
    with pytest.raises(ConfigError, match=r"unknown extra_args keys \['bogus'\]"):
        layer_args({"config": Cfg(), "bogus": 1})
    with pytest.raises(ConfigError, match="'is_moe'.*must be a bool"):
        layer_args({"config": Cfg(), "is_moe": "yes"})
    with pytest.raises(ConfigError, match="config"):
        layer_args({"is_moe": True})
    with pytest.raises(ConfigError, match="num_local_experts"):
        layer_args({"config": Cfg(), "num_local_experts": 0})
    with pytest.raises(ConfigError, match="received None"):
        layer_args(None)


class Wgrad(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))
        self.calls = 0
        hooked: list[int] = []
        self.hooked = hooked
        self.w.post_wgrad_grad_acc_hook = lambda: hooked.append(1)  # type: ignore[attr-defined]  # pyright: ignore[reportAttributeAccessIssue]

    def backward_dw(self) -> None:
        self.calls += 1
        self.w.grad = torch.ones(1)


def test_backward_dw_runs_once_with_hooks_and_post_backward_hook() -> None:
    wg = Wgrad()
    args = LayerArgs(config=Cfg(), delay_wgrad_compute=True)
    node = TransformerLayerNode(
        cpu_stream,
        CpuEvent(),
        LayerState(),
        ChunkState(Microbatch()),
        lambda n, i: i[0] * 1,
        "mlp",
        [wg],
        args,
    )
    fired: list[str] = []
    node.set_post_backward_hook(lambda: fired.append("post_backward"))
    node.forward(torch.ones(1, requires_grad=True))
    node.backward(torch.ones(1))
    assert fired == []  # with delayed wgrad the hook waits for backward_dw
    node.backward_dw()
    assert wg.calls == 1 and wg.hooked == [1] and fired == ["post_backward"]
    with pytest.raises(WgradError, match="called twice"):
        node.backward_dw()


def test_backward_dw_is_a_noop_without_delay() -> None:
    wg = Wgrad()
    node = TransformerLayerNode(
        cpu_stream,
        CpuEvent(),
        LayerState(),
        ChunkState(Microbatch()),
        lambda n, i: i[0],
        "mlp",
        wg,
        {"config": Cfg()},
    )
    node.backward_dw()
    node.backward_dw()
    assert wg.calls == 0


class Owner:
    def method(self, x: int) -> int:
        return x + 1


def test_weak_method_lets_the_owner_die() -> None:
    owner = Owner()
    call = weak_method(owner.method)
    assert call(1) == 2
    ref = weakref.ref(owner)
    del owner
    assert ref() is None
    with pytest.raises(NodeStateError, match="garbage-collected"):
        call(1)
    with pytest.raises(IntegrationError, match="expected a bound method"):
        weak_method(square)


def test_node_dies_by_refcount() -> None:
    gc.disable()
    try:
        node = ScheduleNode(square, cpu_stream, CpuEvent())
        node.forward(torch.ones(1, requires_grad=True))
        node.backward(torch.ones(1))
        ref = weakref.ref(node)
        del node
        assert ref() is None
    finally:
        gc.enable()


def test_layer_state_is_weakrefable_and_slotted() -> None:
    state = LayerState()
    assert weakref.ref(state)() is state
    with pytest.raises(AttributeError):
        state.typo = 1  # type: ignore[attr-defined]  # pyright: ignore[reportAttributeAccessIssue]
    state.stash("k", 3)
    assert state.take("k", int) == 3
    with pytest.raises(IntegrationError, match="holds a int, expected a str"):
        state.take("k", str)
    with pytest.raises(IntegrationError, match="nothing stashed under 'x'"):
        state.take("x", int)


def test_cpu_streams_and_events() -> None:
    pair = make_streams("cpu")
    assert isinstance(pair.comp, CpuStream) and isinstance(pair.comm, CpuStream)
    assert pair.device == torch.device("cpu")
    event = make_event("cpu")
    assert isinstance(event, CpuEvent)
    start, end = CpuEvent(), CpuEvent()
    with pytest.raises(StreamError, match="recorded first"):
        start.elapsed_time(end)
    start.record()
    end.record()
    assert start.elapsed_time(end) >= 0.0
    assert pair.comp.record_event().query()
    with pytest.raises(StreamError, match="expected a 'cpu' or 'cuda' device"):
        make_streams("meta")


def test_refusals_of_a_stream_and_event_of_different_devices_say_what_to_do() -> None:
    """A CPU event with a CUDA stream (or the reverse): the refusal names both, says what
    was expected and how to make a matching pair."""
    fake: Any = object()  # not a CpuStream: the CUDA side, as far as the check goes
    fix = r"make .*for the model's device \(make_"
    with pytest.raises(
        StreamError,
        match=r"record_event: .*expected an event and a stream "
        r"of one device kind.*" + fix,
    ):
        record_event(CpuEvent(), fake)
    with pytest.raises(
        StreamError,
        match=r"wait_event: .*expected a stream and an event "
        r"of one device kind.*" + fix,
    ):
        wait_event(CpuEvent(), fake)
    with pytest.raises(
        StreamError,
        match=r"wait_stream: .*expected two streams of one "
        r"device kind.*" + fix,
    ):
        wait_stream(CpuStream(), fake)


def test_global_streams_first_call_wins() -> None:
    reset_streams()
    first = set_streams(device="cpu")
    assert set_streams(device="cpu") is first
    assert get_comp_stream() is first.comp and get_comm_stream() is first.comm
    mine = CpuStream("mine")
    replaced = set_streams(comm_stream=mine, device="cpu")  # on a GPU box the default is CUDA
    assert replaced.comm is mine
    reset_streams()


def test_default_streams_belong_to_a_device() -> None:
    reset_streams()
    cpu = set_streams(device="cpu")
    assert set_streams(device=torch.device("cpu")) is cpu
    if torch.cuda.is_available():  # a bare "cuda" is the current device
        cuda = set_streams(device="cuda")
        assert cuda is not cpu and set_streams(device="cpu") is cpu
        assert set_streams(device=f"cuda:{torch.cuda.current_device()}") is cuda
        with pytest.raises(StreamError, match="expected streams of cuda"):
            set_streams(comp_stream=CpuStream(), device="cuda")
    mine = set_streams(CpuStream("a"), CpuStream("b"))  # keyed by the streams' device
    assert set_streams(device="cpu") is mine
    reset_streams()
    assert set_streams(device="cpu") is not mine
    reset_streams()


def test_stream_event_device_mismatch() -> None:
    class FakeCudaEvent:
        pass

    fake: Any = FakeCudaEvent()  # deliberately the wrong type
    # Debug mode: beartype refuses the event's type first (the library's TypeHintError).
    error, match = (
        (TypeHintError, r"use_stream\.__init__\(\) parameter event=")
        if DEBUG
        else (StreamError, "paired with a CUDA event")
    )
    with pytest.raises(error, match=match), use_stream(CPU, fake):
        pass


def test_stream_pair_providers() -> None:
    pair = StreamPair(comp=CpuStream("a"), comm=CpuStream("b"))
    assert pair.comp_provider() is pair.comp
    assert pair.comm_provider() is pair.comm


def test_layer_plan_reads_the_position_from_megatron_style_extra_args() -> None:

    from .toy_model import ToyConfig, ToyLayer

    layer = ToyLayer(ToyConfig(), moe=True)
    plan = layer_schedule_plan(
        layer, CpuEvent(), ChunkState(Microbatch()), cpu_stream, cpu_stream, {"is_last_layer": True}
    )
    node = plan.nodes[next(iter(plan.nodes))]
    assert isinstance(node, TransformerLayerNode)
    assert node.is_last_layer
    assert not node.is_first_layer
    assert node.args.is_moe  # taken from the layer, not the mapping
    with pytest.raises(ConfigError, match=r"unknown extra_args keys \['bogus'\]"):
        layer_schedule_plan(
            layer, CpuEvent(), ChunkState(Microbatch()), cpu_stream, cpu_stream, {"bogus": 1}
        )


@dataclass
class _FakeCudaStream:
    stream_id: int
    device_index: int = 0
    device_type: int = 1


@pytest.mark.skipif(
    DEBUG,
    reason="fakes torch.cuda.Stream, whose annotation debug mode's beartype checks at "
    "_cuda_switch (the real streams run in test_gpu.py)",
)
def test_cuda_switch_skips_only_a_stream_already_current(monkeypatch: pytest.MonkeyPatch) -> None:
    """The branch logic of a node's CUDA stream switch, with torch's calls faked (the real
    ones run in ``test_gpu.py``): a stream current on the current device is not switched
    to, and leaving sets it current again, as ``torch.cuda.stream``'s exit does; any other
    stream goes through ``torch.cuda.stream``."""
    from moe_overlap.engine.core import _streams

    set_calls: list[tuple[int, int, int]] = []
    made: list[object] = []

    def set_stream(stream_id: int, device_index: int, device_type: int) -> None:
        set_calls.append((stream_id, device_index, device_type))

    def cuda_stream(stream: object) -> Any:
        made.append(stream)
        return nullcontext()

    monkeypatch.setattr(_streams, "_cuda_current_device", lambda: 0)
    monkeypatch.setattr(_streams, "_cuda_current_stream", lambda device: (7, device, 1))
    monkeypatch.setattr(_streams, "_cuda_set_stream", set_stream)
    monkeypatch.setattr(torch.cuda, "stream", cuda_stream)
    current: Any = _FakeCudaStream(7)
    with _streams._cuda_switch(current):
        assert set_calls == []
    assert set_calls == [(7, 0, 1)] and made == []
    for other in (_FakeCudaStream(8), _FakeCudaStream(7, device_index=1), _FakeCudaStream(7, 0, 2)):
        _streams._cuda_switch(cast(Any, other))
    assert len(made) == 3 and set_calls == [(7, 0, 1)]
