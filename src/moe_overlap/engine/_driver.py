"""The microbatch driver: combined 1F1B over N microbatches of one model chunk."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch
import torch.distributed as dist
from torch import Tensor

from moe_overlap.args import BOOL, CALLABLE, Instance, Opt, Real, check_arg
from moe_overlap.errors import ConfigError, IntegrationError
from moe_overlap.microbatch import Microbatch
from moe_overlap.protocols import PreprocessableModel, StepObserver

from ._attached_checks import inputs_checked
from ._bypass_check import check_bypassed
from ._conformance import check_model, checks_memoized
from ._consensus import Phase, VotedStep
from ._debug import DEBUG
from ._inputs import check_inputs
from ._macro_steps import backward_microbatches, forward_microbatches
from ._microbatch_order import ScheduleMode, macro_steps
from ._node_order_check import check_node_order
from ._owed_wgrad import check_wgrad_done, declared_wgrad, node_schedule_running
from ._plain_check import check_first_step
from ._shared_params import AccumulationCount, counted_step
from ._step_checks import check_grad_mode
from ._trainable import check_loss_grad, check_trainable
from .contracts import OPT_STEP_OBSERVER
from .core._chunk_plan import ModelChunkSchedulePlan, default_streams, device_of
from .core._node_schedule import NodeSchedule
from .core._options import ScheduleOptions
from .core._runner import run_schedule, run_step
from .core._state import ChunkState
from .core._steps import Slot
from .core._streams import StreamPair

__all__ = ["combined_1f1b"]

_DEFAULT_OPTIONS = ScheduleOptions()


PlanCallback = Callable[[ModelChunkSchedulePlan], None]


def combined_1f1b(
    model: PreprocessableModel,
    microbatches: Sequence[Microbatch],
    *,
    overlap: bool = True,
    options: ScheduleOptions = _DEFAULT_OPTIONS,
    streams: StreamPair | None = None,
    loss_scale: float = 1.0,
    on_plan: PlanCallback | None = None,
    observer: StepObserver | None = None,
    fill_drain: bool = False,
    consensus_group: dist.ProcessGroup | None = None,
    schedule: NodeSchedule | None = None,
) -> list[Tensor]:
    """Run forward and backward of every microbatch; return the (detached, fp32) losses.

    The order is :func:`~moe_overlap.steps.macro_steps` of ``ScheduleMode.of(overlap=...,
    fill_drain=...)``. With ``overlap`` (combined 1F1B)::

        F0 | F1+B0 | F2+B1 | ... | F(N-1)+B(N-2) | B(N-1)

    each ``Fi+Bj`` a :meth:`ModelChunkSchedulePlan.run` interleaving microbatch ``i``'s
    forward with ``j``'s backward. Without it, ``F0 B0 F1 B1 ...`` through the same nodes.
    With ``fill_drain`` (and at least two microbatches) the first two forwards and the
    last two backwards are overlapped with each other too (:func:`run_pair`)::

        F0+F1 | F2+B0 | F3+B1 | ... | F(N-1)+B(N-3) | B(N-2)+B(N-1)

    keeping one more microbatch's activations alive throughout. A forward that draws random
    numbers (dropout) then draws them in another order than plain training: a forward step
    that runs ahead of an earlier microbatch's forward (here or in a ``schedule``) and
    moves torch's default generator is refused at that step (a
    :class:`~moe_overlap.ScheduleError` from a :class:`~moe_overlap.ConfigError`).

    ``schedule`` (a :class:`~moe_overlap.steps.NodeSchedule`, what the planner's
    :func:`~moe_overlap.plan.search_schedules` returns) replaces those orders with any
    exact order of every microbatch's node steps, any number of microbatches in flight,
    ``W`` steps anywhere after their backward and ``R`` steps for the slots
    ``options.recompute`` recomputes (:func:`~moe_overlap.steps.check_node_order` refuses
    an order that would not be exact, naming the step and the rule); ``overlap`` and
    ``fill_drain`` keep their defaults then.
    Either way the losses and the gradients accumulated into the parameters are those of
    ``(loss_i * loss_scale).backward()`` per microbatch, in order.

    ``on_plan`` is called with each plan right after it is built (FSDP reshard hooks).
    ``observer`` (a :class:`~moe_overlap.steps.StepObserver`, e.g. a
    :class:`~moe_overlap.timeline.Timeline`) is asked for a timer for every node step of
    every :meth:`ModelChunkSchedulePlan.run`. Delayed weight gradients are all computed by
    the time this returns: modules that count them (:class:`~moe_overlap.PendingWgrad`)
    are checked to owe none before and after the step (:class:`~moe_overlap.WgradError`).
    A parameter two nodes of one microbatch accumulate into ``.grad`` (an output layer tied
    to the embedding, a module shared by two layers) would be summed in another order than
    plain ``backward()``: counted at the model's first step and whenever its parameters
    change, it is an :class:`~moe_overlap.IntegrationError` when the step returns.

    The arguments are checked once per call (:class:`~moe_overlap.ConfigError`):
    ``microbatches`` a non-empty sequence of :class:`Microbatch` (not a generator),
    ``overlap`` a bool, ``loss_scale`` a finite int or float, autograd enabled (not under
    ``torch.no_grad()`` / ``torch.inference_mode()``), something to differentiate (a model
    with every parameter frozen and no input that requires grad is refused, as plain
    ``loss.backward()`` refuses its loss; a loss that comes out without grad otherwise is
    an :class:`~moe_overlap.IntegrationError`).

    If a node fails, :class:`~moe_overlap.ScheduleError` says where; streams are
    synchronized and every plan released, so the model can run the next step. The
    gradients the failed step had accumulated are partial: zero them (and drop any weight
    gradients a delayed-wgrad model still holds) before that next step, as after an
    overflowed mixed-precision step.

    Under expert parallelism that holds only where no all-to-all message of the failed
    step is left in flight, which one rank cannot know: a failure on one rank leaves its
    peers in an all-to-all, and the next step's messages can fill it. ``consensus_group``
    (a process group holding every rank of the model's expert-parallel groups, used for
    nothing else, e.g. ``dist.new_group(backend="gloo", timeout=...)`` made once and passed
    to every step) makes the ranks vote after every step, failed or not: one all-reduce of
    a per-rank flag saying how far the step got, so a step that failed on any rank raises
    on every rank. Failed on some rank while it communicated: every rank raises a
    :class:`~moe_overlap.ScheduleError` naming the failed global ranks and the step (the
    steps voted on the group, counted from 0), and every later call with this model or
    this group is refused before it communicates; restore a checkpoint into a new model
    on new process groups. Failed on every rank before it communicated, or after its
    communication completed: the failing ranks' errors are raised as they are (the others
    raise a ``ScheduleError``) and the next step is exact after the recovery above. The
    group's timeout must outlast the expert-parallel groups' (a rank blocked in an
    all-to-all with a failed peer votes after that timeout). Without ``consensus_group``
    nothing is voted (a model refused earlier stays refused).
    """
    vote = VotedStep("combined_1f1b", model, consensus_group)  # refuses a poisoned step
    return vote.run(
        lambda: _step(
            model,
            microbatches,
            vote,
            overlap=overlap,
            options=options,
            streams=streams,
            loss_scale=loss_scale,
            on_plan=on_plan,
            observer=observer,
            fill_drain=fill_drain,
            schedule=schedule,
        )
    )


def _step(
    model: PreprocessableModel,
    microbatches: Sequence[Microbatch],
    vote: VotedStep,
    *,
    overlap: bool,
    options: ScheduleOptions,
    streams: StreamPair | None,
    loss_scale: float,
    on_plan: PlanCallback | None,
    observer: StepObserver | None,
    fill_drain: bool,
    schedule: NodeSchedule | None = None,
) -> list[Tensor]:
    """:func:`combined_1f1b`'s step: the checks, then the schedule; ``vote.phase`` says how
    far it got."""
    check_bypassed(model)  # before the Protocol checks: a wrapper's message wins
    with checks_memoized():  # the model and its layers are checked once, not per plan
        model = check_model(model)
        _check_arguments(microbatches, overlap, options, streams, loss_scale, on_plan, observer)
        mode = _schedule_mode(overlap, fill_drain, schedule, len(microbatches))
        _check_inputs(model, microbatches)
        check_grad_mode("combined_1f1b")
        check_trainable(model, microbatches, "combined_1f1b")  # plain backward() would refuse
        declared = declared_wgrad(model)
        check_wgrad_done(
            model, when="before the step (left from an earlier one)", declared=declared
        )
        vote.phase = Phase.DURING  # from here on, the step communicates
        with counted_step(model):  # its runs are the step's: counted and checked here
            if DEBUG:  # the model's first step: its schedule and its plain forward agree
                first = [microbatches[0]]
                alone = ScheduleMode.OVERLAPPED if isinstance(mode, NodeSchedule) else mode
                pair = streams if streams is not None else default_streams(device_of(first[0]))
                check_first_step(
                    model,
                    microbatches[0],
                    lambda: _run(model, first, alone, options, streams, loss_scale, None, None),
                    loss_scale,
                    compute=pair.comp,
                )
            counted = AccumulationCount(model)  # a parameter two nodes accumulate
            with inputs_checked(microbatches), counted:  # inputs: checked above, not per plan
                losses = _run(
                    model, microbatches, mode, options, streams, loss_scale, on_plan, observer
                )
    vote.phase = Phase.AFTER  # every all-to-all of the step completed
    check_wgrad_done(model, when="when combined_1f1b returns", declared=declared)
    counted.check(len(microbatches))
    return [loss.detach() for loss in losses]


def _run(
    model: PreprocessableModel,
    microbatches: Sequence[Microbatch],
    mode: ScheduleMode | NodeSchedule,
    options: ScheduleOptions,
    streams: StreamPair | None,
    loss_scale: float,
    on_plan: PlanCallback | None,
    observer: StepObserver | None,
) -> list[Tensor]:
    """The schedule itself: walk :func:`macro_steps`, building each microbatch's plan at
    its forward, running each step with the one runner (:func:`run_step`), which releases
    a plan after its backward; the losses, in order. A :class:`NodeSchedule` runs through
    :func:`run_schedule` instead."""
    if isinstance(mode, NodeSchedule):
        return _run_schedule(
            model, microbatches, mode, options, streams, loss_scale, on_plan, observer
        )
    losses: list[Tensor] = []
    live: dict[int, ModelChunkSchedulePlan] = {}
    try:
        for step in macro_steps(len(microbatches), mode):
            forward, backward = forward_microbatches(step), backward_microbatches(step)
            for i in forward:
                live[i] = _new_plan(model, microbatches, i, options, streams, on_plan)
            fs = [live[i] for i in forward]
            bs = [live[i] for i in backward]
            grads = [torch.full_like(losses[i], loss_scale) for i in backward]
            if len(fs) <= 1 and len(bs) <= 1:  # one public chunk run (benchmarks time that unit)
                out = ModelChunkSchedulePlan.run(
                    fs[0] if fs else None,
                    bs[0] if bs else None,
                    grads[0] if grads else None,
                    observer=observer,
                )
                outputs = [out] if fs else []
            else:  # the fill or the drain
                outputs = run_step(fs, bs, grads, where="combined_1f1b", observer=observer)
            losses += [_check_loss(model, out, i) for i, out in zip(forward, outputs, strict=True)]
            for i in backward:
                del live[i]
    finally:
        for plan in live.values():
            if not plan.released:
                plan.release_state()
    return losses


def _new_plan(
    model: PreprocessableModel,
    microbatches: Sequence[Microbatch],
    i: int,
    options: ScheduleOptions,
    streams: StreamPair | None,
    on_plan: PlanCallback | None,
) -> ModelChunkSchedulePlan:
    """Microbatch ``i``'s plan, handed to ``on_plan`` when given."""
    plan = ModelChunkSchedulePlan(model, microbatches[i], options=options, streams=streams, index=i)
    if on_plan is not None:
        on_plan(plan)
    return plan


def _run_schedule(
    model: PreprocessableModel,
    microbatches: Sequence[Microbatch],
    schedule: NodeSchedule,
    options: ScheduleOptions,
    streams: StreamPair | None,
    loss_scale: float,
    on_plan: PlanCallback | None,
    observer: StepObserver | None,
) -> list[Tensor]:
    """:func:`_run` for a :class:`NodeSchedule`: the first microbatch's plan is built first,
    its shape checks the order (:func:`check_node_order`), then :func:`run_schedule`."""
    losses: dict[int, Tensor] = {}
    first = cast(int, schedule.steps[0].microbatch)

    def build(mb: int) -> ModelChunkSchedulePlan:
        return _new_plan(model, microbatches, mb, options, streams, on_plan)

    ahead = [build(first)]  # built before the walk; handed to it at its first step
    try:
        check_node_order(
            schedule, [ahead[0].shape] * len(microbatches), recompute=map(Slot, options.recompute)
        )
    except BaseException:
        ahead.pop().release_state()
        raise

    def plan_of(mb: int) -> ModelChunkSchedulePlan:
        return ahead.pop() if ahead and mb == first else build(mb)

    def output_grad(mb: int, out: Tensor | None) -> Tensor:
        loss = _check_loss(model, out, mb)
        losses[mb] = loss
        return torch.full_like(loss, loss_scale)

    try:
        with node_schedule_running():  # a W step may be owed when another microbatch starts
            run_schedule(schedule, plan_of, output_grad, observer=observer)
    finally:
        for plan in ahead:  # failed before its first step
            plan.release_state()
    return [losses[i] for i in range(len(microbatches))]


_OBSERVER = OPT_STEP_OBSERVER
_STREAMS = Opt(Instance(StreamPair, "a StreamPair (make_streams(device))"))


def _check_arguments(
    microbatches: object,
    overlap: object,
    options: object,
    streams: object,
    loss_scale: object,
    on_plan: object,
    observer: object,
) -> None:
    """combined_1f1b's arguments, once per call (what types cannot promise at run time)."""
    where = "combined_1f1b"
    if not isinstance(microbatches, Sequence) or isinstance(microbatches, (str, bytes)):
        raise ConfigError(
            f"{where}: microbatches must be a sequence (list or tuple) of Microbatch, "
            f"received {type(microbatches).__name__}; pass list(...) for a generator"
        )
    items = cast("Sequence[object]", microbatches)
    if len(items) == 0:
        raise ConfigError(f"{where}: expected at least one microbatch, received none")
    for i, mb in enumerate(items):
        check_arg(where, f"microbatches[{i}]", mb, _MICROBATCH_ITEM)
    check_arg(where, "overlap", overlap, BOOL)
    check_arg(where, "options", options, _SCHEDULE_OPTIONS)
    check_arg(where, "streams", streams, _STREAMS)
    check_arg(where, "loss_scale", loss_scale, _LOSS_SCALE)
    check_arg(where, "on_plan", on_plan, Opt(CALLABLE))
    check_arg(where, "observer", observer, _OBSERVER)


_MICROBATCH_ITEM = Instance(Microbatch, "a Microbatch")
_SCHEDULE_OPTIONS = Instance(ScheduleOptions, "a ScheduleOptions")
_LOSS_SCALE = Real()
_NODE_SCHEDULE = Instance(NodeSchedule, "a NodeSchedule (moe_overlap.steps.NodeSchedule)")


def _check_inputs(model: PreprocessableModel, microbatches: Sequence[Microbatch]) -> None:
    """Every microbatch's inputs, before the first plan: an input the model does not read
    (or its own ``validate_inputs`` refuses) fails here, not after earlier microbatches
    accumulated gradients."""
    for i, mb in enumerate(microbatches):
        state = ChunkState(mb)
        check_inputs(
            model, state, where=f"combined_1f1b: microbatches[{i}]", what="Microbatch field"
        )


def _schedule_mode(
    overlap: bool, fill_drain: object, schedule: object, n: int
) -> ScheduleMode | NodeSchedule:
    """The mode of ``overlap`` (checked already) and ``fill_drain``, which needs it; or
    ``schedule``, which replaces them."""
    fill_drain = check_arg("combined_1f1b", "fill_drain", fill_drain, BOOL)
    if schedule is not None:
        schedule = check_arg("combined_1f1b", "schedule", schedule, _NODE_SCHEDULE)
        if not overlap or fill_drain:
            raise ConfigError(
                "combined_1f1b: schedule gives the whole order; expected overlap and "
                f"fill_drain left at their defaults with it, received overlap={overlap}, "
                f"fill_drain={fill_drain}"
            )
        if schedule.microbatches != n or not schedule.steps:
            raise ConfigError(
                f"combined_1f1b: expected a schedule of the {n} microbatches given, received "
                f"one of {schedule.microbatches}"
            )
        return schedule
    if fill_drain and not overlap:
        raise ConfigError(
            "combined_1f1b: fill_drain overlaps the first two forwards and the last two "
            "backwards of the overlapped schedule; expected overlap=True with it, received "
            "overlap=False"
        )
    return ScheduleMode.of(overlap=overlap, fill_drain=fill_drain)


def _check_loss(model: PreprocessableModel, out: Tensor | None, index: int) -> Tensor:
    """Microbatch ``index``'s loss: a scalar that requires grad."""
    if out is None or out.numel() != 1:
        got = "nothing" if out is None else f"a tensor of shape {tuple(out.shape)}"
        raise IntegrationError(
            f"combined_1f1b: {type(model).__name__}._postprocess must return a scalar loss "
            f"(model.post_process true, labels given), received {got}"
        )
    check_loss_grad(model, out, index, "combined_1f1b")
    return out
