"""The halves of torch's ``FORWARD`` / ``FULL_BACKWARD`` branches, run through chunk plans.

:class:`PlanRunner` begins an action (waits its receive, builds or takes its plan), runs one
or two plans as one :meth:`~moe_overlap.ModelChunkSchedulePlan.run`, and ends it as torch's
branch does (caches, loss, hand-offs between local stages). It keeps what passes between
actions (the forwarded plans, the weight gradients held aside) and checks the step's
delayed weight gradients at its begin and end.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from moe_overlap import IntegrationError, ModelChunkSchedulePlan, NodeStateError, ScheduleOptions
from moe_overlap.engine import (
    StageAccumulations,
    check_model,
    check_wgrad_done,
    owed_wgrad,
    pending_count,
)
from moe_overlap.integrations.pipelining import _torch
from moe_overlap.integrations.pipelining._stage_checks import stage_microbatch, stage_name
from moe_overlap.integrations.pipelining._torch import Action, Context, Stage
from moe_overlap.steps import StepObserver

__all__ = ["BackwardCall", "ForwardCall", "Key", "PlanRunner"]

Key = tuple[int, int]
"""(stage index, microbatch index)."""


@dataclass(slots=True)
class _Forwarded:
    """What a forward leaves for its backward."""

    plan: ModelChunkSchedulePlan
    inputs: list[object]  # the stage's flat inputs, as torch caches them (their grads go back)
    leaf: Tensor | None  # last stage: the output handed to loss_fn (a leaf)
    needs_grad: bool  # the stage output requires grad (else its backward computes nothing)


@dataclass(slots=True)
class ForwardCall:
    stage: Stage
    key: Key
    args: tuple[object, ...]
    kwargs: dict[str, object]
    plan: ModelChunkSchedulePlan | None  # None: the plain path (no autograd / no backward)


@dataclass(slots=True)
class BackwardCall:
    stage: Stage
    key: Key
    forwarded: _Forwarded | None  # None: the stage has no backward
    grad: Tensor | None  # None: nothing to run (nothing of the stage needs a gradient)


class PlanRunner:
    """The plans of one prepared schedule's stages on this rank, between its actions.

    ``return_outputs`` / ``loss_kwargs`` are the current step's (set by the wrapped step,
    as the custom functions' context lacks them); ``observer`` times every plan step.
    """

    def __init__(
        self,
        schedule: Any,
        stages: dict[int, Stage],
        options: dict[int, ScheduleOptions],
        observer: StepObserver | None,
    ) -> None:
        self.schedule = schedule
        self.stages = stages
        self.observer = observer
        self._options = options
        self.live: dict[Key, _Forwarded] = {}
        self.held: dict[Key, list[tuple[nn.Parameter, Tensor | None]]] = {}
        self.return_outputs = True
        self.loss_kwargs: dict[str, Any] | None = None
        self._first_action = True
        self._order = sorted(stages)  # the stages' positions in the count below
        self._counted: StageAccumulations | None = None  # a parameter two nodes accumulate
        self._backwards = [0] * len(self._order)  # per stage: backwards run this step

    @property
    def rank(self) -> int:
        rank: int = self.schedule.rank
        return rank

    # -- the step's begin and end -------------------------------------------------------

    def begin_step(self) -> None:
        for index, stage in self.stages.items():
            check_wgrad_done(
                stage.submod,
                when=f"before a pipeline step (stage {index}, left from an earlier step)",
            )
        self._first_action = True
        self._backwards = [0] * len(self._order)
        if torch.is_grad_enabled() and any(s.has_backward for s in self.stages.values()):
            # Counted at the first step and whenever the parameters change (as combined_1f1b).
            stages = [(stage_name(self.stages[i]), self.stages[i].submod) for i in self._order]
            self._counted = StageAccumulations(self, stages).__enter__()

    def _after_shape_inference(self) -> None:
        """torch's shape inference (first step, 2.13) runs the plain backward: weight
        gradients a delayed-wgrad stage queued there (a module that delays whoever calls;
        no plan claims the library's there) are not the step's; drop them."""
        self._first_action = False
        for index, stage in self.stages.items():
            if not owed_wgrad(stage.submod):
                continue
            for module in stage.submod.modules():
                drop: object = getattr(module, "discard_wgrad", None)
                if pending_count(module) and callable(drop):
                    drop()
            check_wgrad_done(
                stage.submod,
                when=(
                    f"after torch's shape inference of stage {index} (its plain backward "
                    "queued them); give PipelineStage input_args/output_args to skip it"
                ),
            )

    def end_step(self) -> None:
        counted, self._counted = self._counted, None
        if counted is not None:
            counted.__exit__(None, None, None)
        left = sorted(self.live) + sorted(self.held)
        if left:
            self.release()
            raise NodeStateError(
                f"pipeline rank {self.rank}: expected every forward backed and every "
                f"weight gradient added by the end of the step, received (stage, "
                f"microbatch) {left} left; the schedule misses their B / W actions"
            )
        for index, stage in self.stages.items():
            check_wgrad_done(stage.submod, when=f"at the end of a pipeline step (stage {index})")
        if counted is not None:
            counted.check(self._backwards, f"pipeline rank {self.rank}")

    def abort_step(self) -> None:
        """After a failed step: release the plans and torch's per-step state (the loss
        list is indexed by microbatch; stale entries would be read as the next step's)."""
        counted, self._counted = self._counted, None
        if counted is not None:
            counted.__exit__(None, None, None)
        self.release()
        _torch.clear_step_state(self.schedule)

    def release(self) -> None:
        """Release every plan kept between actions and the weight gradients held aside."""
        for forwarded in self.live.values():
            if not forwarded.plan.released:
                forwarded.plan.release_state()
        self.live.clear()
        self.held.clear()

    # -- the halves of torch's FORWARD / FULL_BACKWARD branches --------------------------

    def stage_of(self, action: Action) -> tuple[Stage, Key]:
        index, mb = action.stage_index, action.microbatch_index
        if mb is None or index not in self.stages:
            raise NodeStateError(
                f"pipeline rank {self.rank}: {action} names no (stage, microbatch) of this "
                f"rank (its stages: {sorted(self.stages)})"
            )
        return self.stages[index], (index, mb)

    def forward_begin(self, action: Action, ctx: Context) -> ForwardCall:
        if self._first_action:
            self._after_shape_inference()
        sched = self.schedule
        stage, key = self.stage_of(action)
        _torch.assert_unsharded(sched, stage)
        index, mb = key
        if (
            not stage.is_first
            and index - 1 not in self.stages
            and not _torch.wait_received(sched, key, forward=True)
        ):
            raise NodeStateError(
                f"pipeline rank {self.rank}: {action} computed before receiving its input"
            )
        args = (
            _torch.microbatch_args(ctx, mb)
            if stage.is_first
            else _torch.received_activations(stage, mb)
        )
        kwargs = _torch.microbatch_kwargs(ctx, mb)
        _torch.validate_inputs(stage, args)
        stale = self.live.pop(key, None)
        if stale is not None:
            stale.plan.release_state()
        plan = None
        if stage.has_backward and torch.is_grad_enabled():
            plan = self.plan(stage, mb, args, kwargs)
        return ForwardCall(stage, key, args, kwargs, plan)

    def plan(
        self,
        stage: Stage,
        mb: int,
        args: tuple[object, ...],
        kwargs: Mapping[str, object],
    ) -> ModelChunkSchedulePlan:
        where = stage_name(stage)
        microbatch = stage_microbatch(stage, args, kwargs, where)
        plan = ModelChunkSchedulePlan(
            check_model(stage.submod),
            microbatch,
            options=self._options[stage.stage_index],
            index=mb,
            vp_stage=stage.stage_index,
            float32_output=False,
        )
        return plan

    def run(self, f: ForwardCall | None, b: BackwardCall | None) -> Tensor | None:
        """One :meth:`ModelChunkSchedulePlan.run`; a later stage's input goes in as
        ``decoder.input_tensor`` (read by the pre-process node, first step of the run)."""
        f_plan = f.plan if f is not None else None
        b_plan = None
        if b is not None and b.forwarded is not None and b.grad is not None:
            b_plan = b.forwarded.plan
        if f_plan is None and b_plan is None:
            return None
        decoder = None
        if f is not None and f_plan is not None and not f.stage.is_first:
            decoder = check_model(f.stage.submod).decoder
            # Megatron's set_input_tensor: the Protocol declares the member read-only.
            setattr(decoder, "input_tensor", f.args[0])  # noqa: B010
        try:
            return ModelChunkSchedulePlan.run(
                f_plan, b_plan, b_grad=b.grad if b is not None else None, observer=self.observer
            )
        finally:
            if decoder is not None:
                setattr(decoder, "input_tensor", None)  # noqa: B010

    def forward_end(self, call: ForwardCall, out: Tensor | None, ctx: Context) -> None:
        sched, stage = self.schedule, call.stage
        targets = _torch.targets(ctx)
        index, mb = call.key
        if call.plan is None:  # the plain path: torch's own forward of the stage module
            output = _torch.forward_one_chunk(
                stage, mb, call.args, call.kwargs, save_forward_output=self.return_outputs
            )
        else:
            assert out is not None
            leaf = out.detach().requires_grad_(out.requires_grad) if stage.is_last else None
            result = leaf if leaf is not None else out
            output = result
            if stage.is_last and self.return_outputs:
                _torch.keep_output(stage, result)
            inputs = _torch.flatten_args(call.args) + _torch.flatten_args(call.kwargs)
            _torch.cache_forward(stage, mb, result, inputs)
            _torch.validate_outputs(stage, (result,))
            self.live[call.key] = _Forwarded(call.plan, inputs, leaf, out.requires_grad)
        _torch.compute_loss(sched, stage, output, targets, mb, self.loss_kwargs)
        if index + 1 in self.stages:  # torch's V-schedule hand-off between local stages
            _torch.hand_forward(self.stages[index + 1], output, mb)

    def backward_begin(self, action: Action, *, full: bool) -> BackwardCall:
        if self._first_action:
            self._after_shape_inference()
        sched = self.schedule
        stage, key = self.stage_of(action)
        index, mb = key
        _torch.assert_unsharded(sched, stage)
        if (
            not stage.is_last
            and index + 1 not in self.stages
            and not _torch.wait_received(sched, key, forward=False)
        ):
            raise NodeStateError(
                f"pipeline rank {self.rank}: {action} computed before receiving its output gradient"
            )
        loss = _torch.stage_loss(sched, stage, mb)
        if full:
            _torch.count_backward(sched, index)
        if not stage.has_backward:
            return BackwardCall(stage, key, None, None)
        forwarded = self.live.pop(key, None)
        if forwarded is None:
            raise NodeStateError(
                f"pipeline rank {self.rank}: {action} (backward of stage {index}, "
                f"microbatch {mb}) without its forward through moe_overlap"
            )
        self._backwards[self._order.index(index)] += 1
        _torch.drop_forward(stage, mb)
        grad: object
        if stage.is_last:
            grad = _loss_grad(stage, forwarded, loss, full=full)
        else:
            grads = _torch.received_grads(stage, mb)
            _torch.validate_output_grads(stage, grads)
            grad = grads[0] if len(grads) == 1 else None
        if grad is None and (stage.is_last or not forwarded.needs_grad):
            # Nothing of the stage needs a gradient (frozen, its input needs none) or the
            # loss reaches none of it: torch's backward skips such an output and computes
            # nothing; no plan backward either (the stage's input gradients stay None).
            forwarded.plan.release_state()
            return BackwardCall(stage, key, forwarded, None)
        if not isinstance(grad, Tensor):
            forwarded.plan.release_state()
            raise IntegrationError(
                f"pipeline stage {index}: expected one gradient tensor for the stage output "
                f"of microbatch {mb}, received {type(grad).__name__}; the stage output must "
                "require grad"
            )
        return BackwardCall(stage, key, forwarded, grad)

    def backward_end(self, call: BackwardCall) -> None:
        stage = call.stage
        index, mb = call.key
        if call.forwarded is None:
            return
        inputs = call.forwarded.inputs
        grads_input = tuple(t.grad if isinstance(t, Tensor) else None for t in inputs)
        _torch.cache_input_grads(stage, mb, grads_input)
        if stage.is_last and not stage.is_first and call.forwarded.leaf is not None:
            call.forwarded.leaf.detach_()
        if index - 1 in self.stages:  # torch's V-schedule hand-off between local stages
            grads = _torch.local_input_grads(stage, mb)
            _torch.hand_backward(self.stages[index - 1], grads, mb)


def _loss_grad(stage: Stage, forwarded: _Forwarded, loss: object, *, full: bool) -> Tensor | None:
    """The last stage's output gradient: the loss's backward into the leaf handed to
    ``loss_fn`` (a full backward also reaches ``loss_fn``'s own parameters, as torch's
    does; an input backward computes the output gradient only, as torch's does). ``None``
    where the loss reaches no gradient of the stage: a loss that needs no grad (torch's
    backward skips it) or a leaf that needs none (a frozen stage fed no grad)."""
    leaf = forwarded.leaf
    assert leaf is not None
    if not isinstance(loss, Tensor):
        raise IntegrationError(
            f"pipeline stage {stage.stage_index}: the last stage's backward needs the "
            f"schedule's loss, received {type(loss).__name__}; build the schedule with a "
            "loss_fn"
        )
    if not loss.requires_grad:
        return None
    if full:
        torch.autograd.backward(loss)
        return leaf.grad
    grad = None
    if leaf.requires_grad:
        (grad,) = torch.autograd.grad(loss, leaf, allow_unused=True)
    loss.detach_()  # torch's input backward detaches the loss it started from
    return grad
