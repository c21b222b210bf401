"""Walk a list of :class:`~moe_overlap.steps.Step` s, threading each microbatch's values through.

The walker under :func:`~moe_overlap.engine.core._runner.run_step` (a macro step of chunk plans)
and :meth:`TransformerLayerSchedulePlan.run` (two layers).

The forward microbatch's value is the tuple of tensors flowing forward (its last node's
outputs); the backward microbatch's value is the tuple of grads flowing backward. A failing
step is re-raised as :class:`~moe_overlap.ScheduleError` naming the step, the microbatches
and the steps around it, after the caller's cleanup ran; a ``BaseException`` that is not an
``Exception`` (``KeyboardInterrupt``) runs the same cleanup and propagates unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Protocol, runtime_checkable

from torch import Tensor

from moe_overlap.errors import ScheduleError
from moe_overlap.protocols import StepObserver

from ._hooks import on_ahead_entered, on_ahead_left
from ._layer_node import TransformerLayerNode
from ._node import ScheduleNode
from ._steps import Direction, Role, Step, format_steps

__all__ = ["NodeSource", "Value", "ahead_forward_steps", "execute_roles"]


@runtime_checkable
class NodeSource(Protocol):
    """A plan, as the step walker sees it: the node behind a step and the microbatch it runs."""

    @property
    def microbatch_index(self) -> int | None: ...
    def node_for(self, step: Step) -> ScheduleNode: ...


_FREED_MEMORY_HINT = (
    "hint: a tensor released by the free-input policy was read again (a slot returned or "
    "kept its input, or autograd saved it for backward); rerun with MOE_OVERLAP_DEBUG=1 to "
    "find the slot at forward, see the free-input rules in docs/integrate.md, or pass "
    "ScheduleOptions(free_input=False)"
)

# What torch says when a kernel touches a storage that ``resize_(0)`` emptied.
_FREED_MESSAGES = ("data is not allocated yet", "setStorage", "out of bounds for storage")


def _freed_memory_hint(exc: BaseException) -> str:
    """:data:`_FREED_MEMORY_HINT` when ``exc`` looks like a read of freed input memory."""
    text = str(exc)
    return _FREED_MEMORY_HINT if any(m in text for m in _FREED_MESSAGES) else ""


Value = tuple["Tensor | None", ...]
# The maps below are keyed by a step's role (a macro step's node steps), or by its
# microbatch when it has none (a NodeSchedule's steps).


def execute_roles(
    steps: Sequence[Step],
    plans: Mapping[Role | int | None, NodeSource | None],
    values: dict[Role | int | None, Value],
    *,
    run_hook: Callable[[Step], None] | None = None,
    on_error: Callable[[], None] | None = None,
    observer: StepObserver | None = None,
    ahead: Collection[int] = (),
) -> None:
    """Run ``steps`` in order, each on the plan of its role (or, without one, of its
    microbatch), threading ``values[role]`` (the tensors flowing forward, or the grads
    flowing backward) through its nodes. ``plans`` may gain plans while the walk runs
    (a hook step builds one).

    With an ``observer``, each non-hook step's node holds the observer's timer for
    ``step`` while it runs (``node.timer``), and ``None`` again afterwards, also on failure.
    The forward steps at the indices ``ahead`` (:func:`ahead_forward_steps`) run between
    the guards' ``ahead_entered`` and ``ahead_left``.
    """
    for index, step in enumerate(steps):
        try:
            if step.direction is Direction.HOOK:
                assert run_hook is not None, "hook step without a hook runner"
                run_hook(step)
                continue
            key = step.role if step.role is not None else step.microbatch
            source = plans.get(key)
            assert source is not None, f"step {step} has no plan for its role"
            node = source.node_for(step)
            if observer is not None:
                node.timer = observer.timer(step, source.microbatch_index)
            try:
                if step.direction is Direction.FORWARD:
                    if index in ahead:
                        for guard in on_ahead_entered:
                            guard.ahead_entered(node)
                        values[key] = node.forward(*values[key])
                        for guard in on_ahead_left:
                            guard.ahead_left(node)
                    else:
                        values[key] = node.forward(*values[key])
                elif step.direction is Direction.BACKWARD:
                    values[key] = node.backward(*values[key])
                elif step.direction is Direction.WGRAD:
                    assert isinstance(node, TransformerLayerNode), f"wgrad step {step} on {node!r}"
                    node.backward_dw()
                else:
                    node.recompute()
            finally:
                if observer is not None:
                    node.timer = None
        except BaseException as exc:
            if on_error is not None:
                on_error()
            if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: unchanged
                raise
            raise _schedule_error(steps, index, plans, exc) from exc


def ahead_forward_steps(
    steps: Sequence[Step], rank: Callable[[Step], int | None]
) -> frozenset[int]:
    """The indices of the forward steps of ``steps`` that run ahead of an earlier
    microbatch's forward: a step of microbatch ``rank(step)`` with a forward step of a
    lower rank after it. Plain training runs each microbatch's forward whole, in order; a
    step order with none ahead runs the forward steps in that order too (its other steps
    are backward, weight-gradient and recompute steps)."""
    ahead: set[int] = set()
    earliest: int | None = None  # the lowest rank of the forward steps after this one
    for index in range(len(steps) - 1, -1, -1):
        step = steps[index]
        if step.direction is not Direction.FORWARD:
            continue
        rank_of = rank(step)
        if rank_of is None:
            continue
        if earliest is not None and earliest < rank_of:
            ahead.add(index)
        if earliest is None or rank_of < earliest:
            earliest = rank_of
    return frozenset(ahead)


_ROLE_NAMES: dict[Role | None, str] = {
    Role.F: "forward",
    Role.B: "backward",
    Role.F2: "second forward",
    Role.B2: "second backward",
}


def _schedule_error(
    steps: Sequence[Step],
    index: int,
    plans: Mapping[Role | int | None, NodeSource | None],
    exc: Exception,
) -> ScheduleError:
    step = steps[index]
    source = plans.get(step.role if step.role is not None else step.microbatch)
    mb = source.microbatch_index if source is not None else step.microbatch
    direction = {
        Direction.FORWARD: "forward",
        Direction.BACKWARD: "backward",
        Direction.WGRAD: "wgrad",
        Direction.RECOMPUTE: "recompute",
        Direction.HOOK: "hook",
    }[step.direction]
    layer = "-" if step.layer is None else str(step.layer)
    slot = "-" if step.slot is None else step.slot.value
    role = f"{_ROLE_NAMES[step.role]} " if step.role is not None else ""
    position = (
        f"step {index} '{step}': {role}microbatch {mb}, layer {layer}, slot {slot}, {direction}"
    )
    pair = ", ".join(
        f"{_ROLE_NAMES[key] if isinstance(key, Role) else 'live'} microbatch "
        f"{p.microbatch_index if p is not None else None}"
        for key, p in plans.items()
        if key in (Role.F, Role.B) or p is not None
    )
    hint = _freed_memory_hint(exc)
    message = (
        f"{position} ({pair}) failed with {type(exc).__name__}: {exc}\n"
        + (f"{hint}\n" if hint else "")
        + format_steps(steps, mark=index, context=6)
    )
    return ScheduleError(message, position=position)
