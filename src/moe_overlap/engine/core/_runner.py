"""The one runner: any macro step (F, B, F+B, F+F, B+B) of model-chunk plans, from its
steps; or a whole :class:`~moe_overlap.steps.NodeSchedule` (:func:`run_schedule`).

:func:`run_step` is what :func:`~moe_overlap.combined_1f1b`, :meth:`ModelChunkSchedulePlan.run
<moe_overlap.ModelChunkSchedulePlan.run>` and :func:`~moe_overlap.steps.run_pair` run::

    1. the guards' step_started (the library's refuse released plans, misshaped output
       gradients, a step outside autograd recording; without guards nothing is checked)
    2. list the steps of the macro step        (chunk_steps, forward/backward_pair_steps)
    3. every plan waits for the caller's stream
    4. walk the steps, each on its role's plan  (execute_roles)
    5. the caller's stream waits for every plan
    6. release the backward plans; the guards' backward_ended; hand the forward outputs
       to the caller

On failure (step 4, or a guard refusing in step 6) every plan is released after the
device is synchronized.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, cast, runtime_checkable

from torch import Tensor

from moe_overlap.protocols import StepObserver

from ._executor import NodeSource, Value, ahead_forward_steps, execute_roles
from ._hooks import on_backward_ended, on_step_started
from ._node import ScheduleNode
from ._node_schedule import NodeSchedule
from ._options import ChunkHooks
from ._steps import ChunkShape, Direction, Role, Slot, Step, StreamKind, macro_node_steps
from ._streams import StreamPair, stream_context, synchronize

__all__ = ["ChunkRun", "run_schedule", "run_step"]


@runtime_checkable
class ChunkRun(Protocol):
    """A model-chunk plan of one microbatch, as the runner uses it
    (:class:`~moe_overlap.ModelChunkSchedulePlan`)."""

    @property
    def microbatch_index(self) -> int | None: ...
    @property
    def released(self) -> bool: ...
    @property
    def shape(self) -> ChunkShape: ...
    @property
    def streams(self) -> StreamPair: ...
    @property
    def vp_stage(self) -> int | None: ...
    def node_for(self, step: Step) -> ScheduleNode: ...
    def record_current_stream(self) -> None: ...
    def wait_current_stream(self) -> None: ...
    def hand_to_caller(self, output: Tensor | None) -> None: ...
    def release_state(self) -> None: ...


_NO_HOOKS = ChunkHooks()
_FORWARD_ROLES = (Role.F, Role.F2)
_BACKWARD_ROLES = (Role.B, Role.B2)


def run_step(
    forward: Sequence[ChunkRun],
    backward: Sequence[ChunkRun],
    grads: Sequence[object],
    *,
    where: str,
    hooks: ChunkHooks = _NO_HOOKS,
    observer: StepObserver | None = None,
) -> list[Tensor | None]:
    """Run one macro step: ``forward`` plans' forwards with ``backward`` plans' backwards.

    At most two plans in all (one of each, or two of one kind); ``grads[i]`` is the
    gradient of ``backward[i]``'s output (a tensor of that output's shape, dtype and
    device: the guards check it). Returns the forward plans' outputs (the losses
    when they have a post-process), in order. ``hooks`` (the p2p hooks of a pipeline
    stage) apply to a one-forward/one-backward step. ``where`` names the caller in errors.
    """
    plans = (*forward, *backward)
    # 1. the guards (moe_overlap.engine._guards): its arguments, hand-driven runs' checks
    for guard in on_step_started:
        guard.step_started(forward, backward, grads, where)
    # 2. the steps
    steps = macro_node_steps(
        [p.shape for p in forward],
        [p.shape for p in backward],
        pre_forward=hooks.pre_forward is not None,
        pre_backward=hooks.pre_backward is not None,
        post_forward=hooks.post_forward is not None,
        post_backward=hooks.post_backward is not None,
    )
    roles: dict[Role | int | None, ChunkRun] = {
        **dict(zip(_FORWARD_ROLES[: len(forward)], forward, strict=True)),
        **dict(zip(_BACKWARD_ROLES[: len(backward)], backward, strict=True)),
    }
    values: dict[Role | int | None, Value] = {role: () for role in roles}
    for role, grad in zip(_BACKWARD_ROLES[: len(grads)], grads, strict=True):
        values[role] = (cast(Tensor, grad),)  # the guards checked it in 1.
    # 3. every plan waits for the caller's stream
    for plan in plans:
        plan.record_current_stream()

    def on_error() -> None:
        for plan in plans:
            synchronize(plan.streams.comp)  # the whole device: both streams
            plan.release_state()

    def run_hook(step: Step) -> None:
        _run_hook(hooks, step, roles[step.role], values)

    # 4. walk the steps (the second of two forwards watched where it runs ahead)
    ahead = ahead_forward_steps(steps, _forward_rank) if len(forward) > 1 else ()
    try:
        execute_roles(
            steps,
            roles,
            values,
            run_hook=run_hook,
            on_error=on_error,
            observer=observer,
            ahead=ahead,
        )
    except BaseException:
        if backward:
            for guard in on_backward_ended:
                guard.backward_ended(backward, where, True)
        raise
    # 5. the caller's stream waits for every plan
    for plan in plans:
        plan.wait_current_stream()
    # 6. release the backwards; hand the forwards' outputs to the caller
    for plan in backward:
        plan.release_state()
    if backward and on_backward_ended:
        try:
            for guard in on_backward_ended:
                guard.backward_ended(backward, where, False)
        except BaseException:
            on_error()  # refused: the forward plans go too
            raise
    outputs: list[Tensor | None] = []
    for role, plan in zip(_FORWARD_ROLES[: len(forward)], forward, strict=True):
        value = values[role]
        out = value[0] if value else None
        plan.hand_to_caller(out)
        outputs.append(out)
    return outputs


def _run_hook(
    hooks: ChunkHooks, step: Step, plan: ChunkRun, values: dict[Role | int | None, Value]
) -> None:
    """A p2p hook step of a one-forward/one-backward step, on the plan of its role."""
    if step.slot is Slot.PRE_FORWARD and hooks.pre_forward is not None:
        hooks.pre_forward(plan.vp_stage)
    elif step.slot is Slot.PRE_BACKWARD and hooks.pre_backward is not None:
        hooks.pre_backward(plan.vp_stage)
        plan.record_current_stream()
    elif step.slot is Slot.POST_FORWARD and hooks.post_forward is not None:
        # On the comm stream, so the send overlaps the last pre-dispatch backward.
        with stream_context(plan.streams.comm):
            plan.wait_current_stream()
            out = values[Role.F][0]
            assert out is not None
            hooks.post_forward(out, plan.vp_stage)
    elif step.slot is Slot.POST_BACKWARD and hooks.post_backward is not None:
        plan.wait_current_stream()
        grads = values[Role.B]
        hooks.post_backward(grads[0] if grads else None, plan.vp_stage)


def run_schedule(
    schedule: NodeSchedule,
    build: Callable[[int], ChunkRun],
    output_grad: Callable[[int, Tensor | None], Tensor],
    *,
    observer: StepObserver | None = None,
) -> None:
    """Run a whole :class:`~moe_overlap.steps.NodeSchedule` (checked against the model
    by the caller: :func:`~moe_overlap.steps.check_node_order`), any number of microbatches in flight::

        1. before a microbatch's first step: build its plan, which waits for the caller's
           stream                                         (hook step  pre_forward.H<mb>)
        2. after its last forward step: its output goes to the caller, and
           ``output_grad(mb, output)`` (on the caller's stream) becomes the value its
           backward starts from                           (hook step  post_forward.H<mb>)
        3. after its last step: its event is recorded on the compute stream (so it covers
           a last W step too) and its plan released       (hook step  post_backward.H<mb>)
        4. at the end, the caller's stream waits for every microbatch

    Each step runs on its microbatch's plan (:func:`execute_roles`). On failure every
    live plan is released after the device is synchronized.
    """
    steps = _with_lifecycle(schedule.steps)
    plans: dict[Role | int | None, NodeSource | None] = {}
    values: dict[Role | int | None, Value] = {}
    live: dict[int, ChunkRun] = {}
    done: list[ChunkRun] = []

    def run_hook(step: Step) -> None:
        mb = cast(int, step.microbatch)
        if step.slot is Slot.PRE_FORWARD:  # 1.
            plan = build(mb)
            plan.record_current_stream()
            live[mb] = plan
            plans[mb] = plan
            values[mb] = ()
        elif step.slot is Slot.POST_FORWARD:  # 2.
            plan = live[mb]
            value = values[mb]
            out = value[0] if value else None
            plan.hand_to_caller(out)
            values[mb] = (output_grad(mb, out),)
            plan.record_current_stream()
        else:  # 3.
            plan = live.pop(mb)
            del plans[mb]
            del values[mb]
            # Its event then also covers a W step that ended the microbatch (weight-gradient
            # work records no event): the compute stream runs in issue order.
            with stream_context(plan.streams.comp):
                plan.record_current_stream()
            plan.release_state()
            done.append(plan)

    def on_error() -> None:
        for plan in live.values():
            synchronize(plan.streams.comp)  # the whole device: both streams
            plan.release_state()

    ahead = ahead_forward_steps(steps, _microbatch_rank)  # forwards interleaved
    execute_roles(
        steps,
        plans,
        values,
        run_hook=run_hook,
        on_error=on_error,
        observer=observer,
        ahead=ahead,
    )
    for plan in done:  # 4.
        plan.wait_current_stream()


def _forward_rank(step: Step) -> int | None:
    """A macro step's forward roles in microbatch order: the first forward is the earlier."""
    return _FORWARD_RANKS.get(step.role)


_FORWARD_RANKS: dict[Role | None, int] = {Role.F: 0, Role.F2: 1}


def _microbatch_rank(step: Step) -> int | None:
    return step.microbatch


def _with_lifecycle(steps: Sequence[Step]) -> list[Step]:
    """``steps`` with each microbatch's three lifecycle hook steps (see :func:`run_schedule`)."""
    first: dict[int, int] = {}
    last_forward: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, step in enumerate(steps):
        mb = cast(int, step.microbatch)
        first.setdefault(mb, i)
        if step.direction is Direction.FORWARD:
            last_forward[mb] = i
        last[mb] = i
    before: dict[int, list[Step]] = {}
    after: dict[int, list[Step]] = {}
    for mb, i in first.items():
        before.setdefault(i, []).append(_hook(Slot.PRE_FORWARD, mb))
    for mb, i in last_forward.items():
        after.setdefault(i, []).append(_hook(Slot.POST_FORWARD, mb))
    for mb, i in last.items():
        after.setdefault(i, []).append(_hook(Slot.POST_BACKWARD, mb))
    out: list[Step] = []
    for i, step in enumerate(steps):
        out += before.get(i, ())
        out.append(step)
        out += after.get(i, ())
    return out


def _hook(slot: Slot, mb: int) -> Step:
    return Step(Direction.HOOK, mb, None, None, slot, StreamKind.HOST)
