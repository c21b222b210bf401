"""Step observers: what the runner hands them, in which order, and that they change nothing."""

from __future__ import annotations

import copy
import itertools
import json
from pathlib import Path

import pytest
from torch import Tensor

from moe_overlap import (
    ConfigError,
    ModelChunkSchedulePlan,
    ScheduleError,
    ScheduleNode,
    ScheduleOptions,
    TransformerLayerSchedulePlan,
    combined_1f1b,
)
from moe_overlap.engine.core._streams import AnyStream
from moe_overlap.steps import Direction, NodeTimer, Role, Slot, Step, StepObserver, chunk_steps
from moe_overlap.streams import CpuStream
from moe_overlap.timeline import Timeline

from .test_failures import Boom, Trap, install, tag_microbatches
from .test_parity import assert_same
from .toy_model import ToyConfig, ToyModel, grads, make_microbatches

Seen = tuple[Step, "int | None"]


class Recorder:
    """A :class:`StepObserver` logging every ``timer`` request and every start/stop."""

    def __init__(self) -> None:
        self.seen: list[Seen] = []
        self.marks: list[tuple[str, Step, str]] = []

    def timer(self, step: Step, microbatch: int | None) -> NodeTimer:
        self.seen.append((step, microbatch))
        return _Timer(self.marks, step)


class _Timer:
    def __init__(self, marks: list[tuple[str, Step, str]], step: Step) -> None:
        self.marks = marks
        self.step = step

    def start(self, stream: AnyStream) -> None:
        assert isinstance(stream, CpuStream)
        self.marks.append(("start", self.step, stream.name))

    def stop(self, stream: AnyStream) -> None:
        assert isinstance(stream, CpuStream)
        self.marks.append(("stop", self.step, stream.name))


def _stream_name(step: Step) -> str:
    assert step.stream is not None, f"node step {step} without a stream"
    return step.stream.value


def plan_nodes(plan: ModelChunkSchedulePlan) -> list[ScheduleNode]:
    nodes: list[ScheduleNode] = [n for lp in plan.layers for n in lp.nodes.values()]
    nodes += [n for n in (plan.pre_process, plan.post_process) if n is not None]
    return nodes


def expected_steps(
    plans: list[ModelChunkSchedulePlan], runs: list[tuple[int | None, int | None]]
) -> list[Seen]:
    """The non-hook steps of ``chunk_steps`` for each chunk run, with their microbatches."""
    out: list[Seen] = []
    for f, b in runs:
        f_shape = plans[f].shape if f is not None else None
        b_shape = plans[b].shape if b is not None else None
        for step in chunk_steps(f_shape, b_shape):
            assert step.direction is not Direction.HOOK
            out.append((step, f if step.role is Role.F else b))
    return out


def test_protocols_are_runtime_checkable() -> None:
    recorder = Recorder()
    assert isinstance(recorder, StepObserver)
    assert isinstance(recorder.timer(Step.parse("f.L0.mlp.F@comp"), 0), NodeTimer)
    assert not isinstance(object(), StepObserver)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("delay", [False, True])
@pytest.mark.parametrize("stack", ["dmt", "mm"])
def test_observer_sees_the_step_lists_in_order(overlap: bool, delay: bool, stack: str) -> None:
    config = ToyConfig()
    ref = ToyModel(config, stack)
    ref.set_delay(delay)
    model = copy.deepcopy(ref)
    mbs = make_microbatches(3, config)
    options = ScheduleOptions(delay_wgrad_compute=delay)
    plans: list[ModelChunkSchedulePlan] = []
    nodes: list[ScheduleNode] = []

    def on_plan(plan: ModelChunkSchedulePlan) -> None:
        plans.append(plan)
        nodes.extend(plan_nodes(plan))

    recorder = Recorder()
    losses = combined_1f1b(
        model, mbs, options=options, overlap=overlap, on_plan=on_plan, observer=recorder
    )

    n = len(mbs)
    if overlap:
        runs: list[tuple[int | None, int | None]] = [(0, None)]
        runs += [(i, i - 1) for i in range(1, n)] + [(None, n - 1)]
    else:
        runs = [r for i in range(n) for r in ((i, None), (None, i))]
    assert recorder.seen == expected_steps(plans, runs)
    # every timer starts, then stops, on the stream its step names; none overlap
    pairs = [
        (("start", step, _stream_name(step)), ("stop", step, _stream_name(step)))
        for step, _ in recorder.seen
    ]
    assert recorder.marks == [m for pair in pairs for m in pair]
    assert nodes and all(node.timer is None for node in nodes)
    # observing changes nothing: same losses and gradients as an unobserved run
    ref_losses = combined_1f1b(ref, mbs, options=options, overlap=overlap)
    assert [float(x) for x in losses] == [float(x) for x in ref_losses]
    assert_same(grads(model), grads(ref))


def test_run_with_hooks_shows_only_node_steps() -> None:
    config = ToyConfig()
    model = ToyModel(config, "mm")
    mbs = make_microbatches(2, config)

    def plan(i: int) -> ModelChunkSchedulePlan:
        mb = mbs[i]
        return ModelChunkSchedulePlan(
            model,
            mb,
            index=i,
        )

    def pre(stage: int | None) -> None:
        pass

    def post_forward(out: Tensor, stage: int | None) -> None:
        pass

    def post_backward(grad: Tensor | None, stage: int | None) -> None:
        pass

    first = plan(0)
    loss = ModelChunkSchedulePlan.run(first, None)
    assert loss is not None
    second = plan(1)
    recorder = Recorder()
    ModelChunkSchedulePlan.run(
        second,
        first,
        b_grad=loss.new_ones(()),
        pre_forward=pre,
        pre_backward=pre,
        post_forward=post_forward,
        post_backward=post_backward,
        observer=recorder,
    )
    hooked = chunk_steps(
        second.shape,
        first.shape,
        pre_forward=True,
        pre_backward=True,
        post_forward=True,
        post_backward=True,
    )
    assert any(s.direction is Direction.HOOK for s in hooked)
    expected = [
        (s, 1 if s.role is Role.F else 0) for s in hooked if s.direction is not Direction.HOOK
    ]
    assert recorder.seen == expected
    assert len(recorder.marks) == 2 * len(expected)


def test_layer_plan_run_passes_the_observer() -> None:
    config = ToyConfig()
    model = ToyModel(config, "m")
    mb = make_microbatches(1, config)[0]
    plan = ModelChunkSchedulePlan(
        model,
        mb,
        index=4,
    )
    assert plan.pre_process is not None
    hidden = plan.pre_process.forward()
    recorder = Recorder()
    layer = plan.layers[0]
    TransformerLayerSchedulePlan.run(layer, None, hidden, observer=recorder)
    assert [str(s) for s, _ in recorder.seen] == [
        "f.L0.pre_dispatch.F@comp",
        "f.L0.dispatch.F@comm",
        "f.L0.mlp.F@comp",
        "f.L0.combine.F@comm",
    ]
    assert {mb for _, mb in recorder.seen} == {4}
    assert all(n.timer is None for n in layer.nodes.values())
    plan.release_state()


@pytest.mark.parametrize(
    ("slot", "direction", "mb"),
    [(Slot.MLP, "forward", 1), (Slot.DISPATCH, "backward", 0), (Slot.MLP, "wgrad", 0)],
)
def test_failing_run_leaves_no_timer_behind(slot: Slot, direction: str, mb: int) -> None:
    config = ToyConfig()
    model = ToyModel(config, "mm")
    model.set_delay(True)
    install(model, Trap(slot, direction, mb), layer_index=1)
    nodes: list[ScheduleNode] = []

    def on_plan(plan: ModelChunkSchedulePlan) -> None:
        tag_microbatches(plan)
        nodes.extend(plan_nodes(plan))

    recorder = Recorder()
    options = ScheduleOptions(delay_wgrad_compute=True)
    with pytest.raises(ScheduleError) as info:
        combined_1f1b(
            model, make_microbatches(3, config), options=options, on_plan=on_plan, observer=recorder
        )
    assert isinstance(info.value.__cause__, Boom)
    assert nodes and all(node.timer is None for node in nodes)
    # the failing step's timer was asked for and started; its body raised before stop
    failed, _ = recorder.seen[-1]
    assert str(failed) in info.value.position
    assert recorder.marks[-1][:2] == ("start", failed)


@pytest.mark.parametrize("rank", [True, "0", -1, 1.5, None])
def test_timeline_rank_is_an_int(rank: object) -> None:
    # It is the Chrome trace's pid: these were written into the trace as they were.
    with pytest.raises(ConfigError, match=r"Timeline: rank must be an int >= 0, received"):
        Timeline(rank=rank)  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]


def test_timeline_rank_is_normalised(tmp_path: Path) -> None:
    numpy = pytest.importorskip("numpy")
    timeline = Timeline(rank=numpy.int64(2))
    path = tmp_path / "trace.json"
    timeline.to_chrome_trace(path)  # json.dumps refused NumPy's int64 before
    assert type(timeline.rank) is int
    assert json.loads(path.read_text())["traceEvents"][0]["pid"] == 2


def test_timeline_spans_are_the_steps_that_ran(tmp_path: Path) -> None:
    config = ToyConfig()
    model = ToyModel(config, "dm")
    model.set_delay(True)
    plans: list[ModelChunkSchedulePlan] = []
    timeline = Timeline(rank=3)
    observer: StepObserver = timeline  # statically a StepObserver too
    combined_1f1b(
        model,
        make_microbatches(2, config),
        options=ScheduleOptions(delay_wgrad_compute=True),
        on_plan=plans.append,
        observer=observer,
    )
    spans = timeline.spans()
    expected = expected_steps(plans, [(0, None), (1, 0), (None, 1)])
    assert [(s.step, s.microbatch) for s in spans] == expected
    assert all(s.stream is s.step.stream and s.slot is s.step.slot for s in spans)
    assert all(0.0 <= s.start_ms <= s.end_ms for s in spans)
    assert all(a.end_ms <= b.start_ms for a, b in itertools.pairwise(spans))  # CPU: in order
    path = tmp_path / "trace.json"
    timeline.to_chrome_trace(path)
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert [e["args"]["step"] for e in events] == [str(s) for s, _ in expected]
    assert {e["pid"] for e in events} == {3}
    assert {e["tid"] for e in events if "@comm" in e["args"]["step"]} == {1}
    timeline.clear()
    assert timeline.spans() == []
