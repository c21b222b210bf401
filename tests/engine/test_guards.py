"""Guards: checks attached to the schedule core from outside, at the core's hooks."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from torch import Tensor

from moe_overlap import ConfigError, combined_1f1b
from moe_overlap.engine import DEBUG
from moe_overlap.engine._guards import GUARD, BaseGuard, Guard, attach, by_hook
from moe_overlap.engine.core import _hooks

from .toy_model import ToyConfig, ToyModel, grads, make_microbatches, plain_step

CONFIG = ToyConfig()


class _Recorder(BaseGuard):
    def __init__(self) -> None:
        self.calls: list[str] = []

    def plan_started(self, model: object, microbatch: object, where: str) -> None:
        self.calls.append(f"plan_started {where}")

    def inputs_read(self, model: object, microbatch: object, state: object, where: str) -> None:
        self.calls.append("inputs_read")

    def plan_built(self, model: object, plan: object) -> None:
        self.calls.append("plan_built")

    def node_entered(self, node: object, direction: str) -> None:
        self.calls.append(f"enter {direction}")

    def node_left(self, node: object) -> None:
        self.calls.append("left")

    def node_forwarded(
        self, node: object, detached: tuple[Tensor | None, ...], outputs: tuple[Tensor, ...]
    ) -> None:
        self.calls.append("forwarded")

    def before_release(
        self,
        node: object,
        inputs: tuple[Tensor | None, ...],
        detached: tuple[Tensor | None, ...],
        outputs: tuple[Tensor, ...],
    ) -> None:
        self.calls.append("before_release")


@pytest.fixture
def recorder() -> Iterator[_Recorder]:
    guard = _Recorder()
    detach = attach(guard, debug=False)
    try:
        yield guard
    finally:
        detach()
    assert all(guard not in hooks for hooks in by_hook.values())


def test_a_guard_is_a_guard() -> None:
    assert isinstance(_Recorder(), Guard)
    assert isinstance(BaseGuard(), Guard)


def test_hooks_run_in_the_core_order_and_the_step_stays_exact(recorder: _Recorder) -> None:
    model = ToyModel(CONFIG, "mm")
    ref = ToyModel(CONFIG, "mm")
    ref.load_state_dict(model.state_dict())
    mbs = make_microbatches(3, CONFIG)
    combined_1f1b(model, mbs)
    plain_step(ref, mbs)
    expected = grads(ref)
    for name, a in grads(model).items():
        b = expected[name]
        assert a is not None and b is not None and a.equal(b), name
    calls = recorder.calls
    plans = [c for c in calls if c.startswith("plan_started")]
    # Debug mode's first-step check runs microbatch 0 through the schedule first.
    checked = [0] if DEBUG else []
    assert plans == [
        f"plan_started ModelChunkSchedulePlan (microbatch {i})" for i in [*checked, 0, 1, 2]
    ]
    first = calls.index("plan_built")
    assert calls[:first] == [plans[0], "inputs_read"]  # before any node of it exists
    nodes = calls[first + 1 :]
    assert nodes.count("enter forward") == nodes.count("forwarded") > 0
    assert nodes.count("enter forward") + nodes.count("enter backward") == nodes.count("left")
    assert "before_release" in nodes  # the freeing slots (free_input on by default)


def test_a_guard_refusing_a_plan_stops_the_step_before_any_node() -> None:
    class Refuse(BaseGuard):
        def plan_built(self, model: object, plan: object) -> None:
            raise ConfigError("refused by the test's guard")

    model = ToyModel(CONFIG, "mm")
    detach = attach(Refuse(), debug=False)
    try:
        with pytest.raises(ConfigError, match="refused by the test's guard"):
            combined_1f1b(model, make_microbatches(2, CONFIG))
    finally:
        detach()
    assert all(p.grad is None for p in model.parameters())
    combined_1f1b(model, make_microbatches(2, CONFIG))  # detached: the next step runs


def test_the_registry_names_each_hook_list_of_the_core() -> None:
    """``by_hook`` has one entry per hook of the Guard Protocol, each the core's own list."""
    assert list(by_hook) == [name for name in GUARD.names if name != "debug_only"]
    assert sorted(f"on_{name}" for name in by_hook) == sorted(_hooks.__all__)
    for name, hooks in by_hook.items():
        assert hooks is getattr(_hooks, f"on_{name}"), name


def test_only_overridden_hooks_are_attached_and_debug_only_is_chosen_once() -> None:
    class Release(BaseGuard):
        debug_only = True

        def before_release(
            self,
            node: object,
            inputs: tuple[Tensor | None, ...],
            detached: tuple[Tensor | None, ...],
            outputs: tuple[Tensor, ...],
        ) -> None:
            pass

    guard = Release()
    attach(guard, debug=False)()  # not attached outside debug mode: detaching is a no-op
    assert all(guard not in hooks for hooks in by_hook.values())
    detach = attach(guard, debug=True)
    try:
        assert [n for n, hooks in by_hook.items() if guard in hooks] == ["before_release"]
    finally:
        detach()
    assert guard not in _hooks.on_before_release


def test_without_guards_detaches_every_guard_for_the_block_only() -> None:
    from moe_overlap.engine import without_guards

    before = {name: list(hooks) for name, hooks in by_hook.items()}
    assert _hooks.on_before_release  # the library's checks are attached at import
    seen: list[bool] = []

    def fail_inside() -> None:
        with without_guards():
            seen.append(all(not hooks for hooks in by_hook.values()))
            raise RuntimeError("inside")

    with pytest.raises(RuntimeError, match="inside"):
        fail_inside()
    assert seen == [True]
    assert {name: list(hooks) for name, hooks in by_hook.items()} == before
