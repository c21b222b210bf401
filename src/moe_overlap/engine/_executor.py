"""Walk a list of :class:`~moe_overlap.Step` s, threading each microbatch's values through.

The forward microbatch's value is the tuple of tensors flowing forward (its last node's
outputs); the backward microbatch's value is the tuple of grads flowing backward. A failing
step is re-raised as :class:`~moe_overlap.ScheduleError` naming the step, the microbatches
and the steps around it, after the caller's cleanup ran; a ``BaseException`` that is not an
``Exception`` (``KeyboardInterrupt``) runs the same cleanup and propagates unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from torch import Tensor

from ._errors import ScheduleError
from ._layer_node import TransformerLayerNode
from ._node import ScheduleNode
from ._node_checks import freed_memory_hint
from ._protocols import StepObserver
from ._steps import Direction, Role, Step, format_steps

__all__ = ["NodeSource", "execute"]

FValue = tuple[Tensor, ...]
BValue = tuple["Tensor | None", ...]


@runtime_checkable
class NodeSource(Protocol):
    """A plan, as the executor sees it: the node behind a step and the microbatch it runs."""

    @property
    def microbatch(self) -> int | None: ...
    def node_for(self, step: Step) -> ScheduleNode: ...


HookRunner = Callable[[Step, FValue, BValue], None]


def execute(
    steps: Sequence[Step],
    f: NodeSource | None,
    b: NodeSource | None,
    f_value: FValue,
    b_value: BValue,
    *,
    run_hook: HookRunner | None = None,
    on_error: Callable[[], None] | None = None,
    observer: StepObserver | None = None,
) -> tuple[FValue, BValue]:
    """Run ``steps`` in order; return the final forward and backward values.

    With an ``observer``, each non-hook step's node holds the observer's timer for
    ``step`` while it runs (``node.timer``), and ``None`` again afterwards, also on failure.
    """
    for index, step in enumerate(steps):
        try:
            if step.direction is Direction.HOOK:
                assert run_hook is not None, "hook step without a hook runner"
                run_hook(step, f_value, b_value)
                continue
            source = f if step.role is Role.F else b
            assert source is not None, f"step {step} has no plan for its role"
            node = source.node_for(step)
            if observer is not None:
                node.timer = observer.timer(step, source.microbatch)
            try:
                if step.direction is Direction.FORWARD:
                    f_value = node.forward(*f_value)
                elif step.direction is Direction.BACKWARD:
                    b_value = node.backward(*b_value)
                else:
                    assert isinstance(node, TransformerLayerNode), f"wgrad step {step} on {node!r}"
                    node.backward_dw()
            finally:
                if observer is not None:
                    node.timer = None
        except BaseException as exc:
            if on_error is not None:
                on_error()
            if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: unchanged
                raise
            raise _schedule_error(steps, index, f, b, exc) from exc
    return f_value, b_value


def _schedule_error(
    steps: Sequence[Step],
    index: int,
    f: NodeSource | None,
    b: NodeSource | None,
    exc: Exception,
) -> ScheduleError:
    step = steps[index]
    f_mb = f.microbatch if f is not None else None
    b_mb = b.microbatch if b is not None else None
    role = "forward" if step.role is Role.F else "backward"
    mb = f_mb if step.role is Role.F else b_mb
    direction = {
        Direction.FORWARD: "forward",
        Direction.BACKWARD: "backward",
        Direction.WGRAD: "wgrad",
        Direction.HOOK: "hook",
    }[step.direction]
    layer = "-" if step.layer is None else str(step.layer)
    position = (
        f"step {index} '{step}': {role} microbatch {mb}, layer {layer}, "
        f"slot {step.slot.value}, {direction}"
    )
    pair = f"(forward microbatch {f_mb}, backward microbatch {b_mb})"
    hint = freed_memory_hint(exc)
    message = (
        f"{position} {pair} failed with {type(exc).__name__}: {exc}\n"
        + (f"{hint}\n" if hint else "")
        + format_steps(steps, mark=index, context=6)
    )
    return ScheduleError(message, position=position)
