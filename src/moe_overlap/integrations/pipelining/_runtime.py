"""The pipelining runtime: torch's compute actions through ``moe_overlap`` chunk plans.

:class:`PipelineOverlap` registers a custom function for each compute action of a prepared
schedule and runs each through chunk plans; after every step the ranks agree on its
outcome (``integrations/_consensus.py``). torch's internals only through ``_torch``.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Generator, Iterable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe_overlap import (
    ChunkState,
    ConfigError,
    IntegrationError,
    Microbatch,
    ModelChunkSchedulePlan,
    MoeOverlapError,
    NodeStateError,
    ScheduleError,
    ScheduleOptions,
)
from moe_overlap.engine import (
    check_bypassed,
    check_model,
    check_wgrad_done,
    owed_wgrad,
    pending_count,
)
from moe_overlap.engine.args import BOOL, Instance, Opt, check_arg
from moe_overlap.engine.contracts import OPT_STEP_OBSERVER
from moe_overlap.inputs import check_inputs
from moe_overlap.integrations._consensus import Phase, StepConsensus, Verdict, verdict_error
from moe_overlap.integrations.pipelining import _torch
from moe_overlap.integrations.pipelining._lowering import check_actions, describe, pair_overlap_f_b
from moe_overlap.integrations.pipelining._torch import Action, Context, Stage, check_torch
from moe_overlap.steps import StepObserver

__all__ = ["PipelineOverlap", "prepare_schedule"]

_PLAN_KWARGS = ("position_ids", "attention_mask", "padding_mask")
"""Stage-module keyword arguments (``schedule.step(..., **kwargs)``) a plan takes by name."""

Key = tuple[int, int]
"""(stage index, microbatch index)."""

_PREPARED: weakref.WeakSet[object] = weakref.WeakSet()
"""The schedules :func:`prepare_schedule` has prepared (each only once)."""

_TAINTED: weakref.WeakSet[object] = weakref.WeakSet()
"""Process groups of a schedule whose step failed mid-communication: messages of that step
may still be in flight on them, so no new schedule may use them."""

_RECOVER = (
    "To go on: restore the last checkpoint, create new process groups for the pipeline and "
    "for expert parallelism (dist.new_group, or destroy_process_group and "
    "init_process_group), build new stages and a new schedule, and prepare_schedule it"
)


def prepare_schedule(
    schedule: object,
    *,
    pair: bool = False,
    overlap: bool = True,
    options: ScheduleOptions | None = None,
    observer: StepObserver | None = None,
    consensus_group: dist.ProcessGroup | None = None,
    consensus_timeout: timedelta | None = None,
) -> PipelineOverlap:
    """Make ``schedule`` run its compute actions through ``moe_overlap`` chunk plans.

    ``schedule`` is a multi-stage ``torch.distributed.pipelining`` schedule run by torch's
    action runtime (``ScheduleDualPipeV``, ``ScheduleInterleaved1F1B``,
    ``ScheduleLoopedBFS``, ``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``)
    built from ``PipelineStage`` s whose modules are :class:`~moe_overlap.PreprocessableModel`
    chunks: ``pre_process`` on the first stage only (it takes the token ids), ``post_process``
    on the last only (its output goes to the schedule's ``loss_fn``), every other stage
    taking one hidden-states tensor; ``forward`` of each is its plain path, which torch's
    shape inference and an unprepared schedule run. The user then calls
    ``schedule.step(...)`` as before.

    - ``FORWARD`` runs a plan's forward, ``FULL_BACKWARD`` its backward (from the received
      output gradient, or from the loss on the last stage); ``OVERLAP_F_B`` runs the two
      plans as one :meth:`~moe_overlap.ModelChunkSchedulePlan.run` (``overlap=False``: one
      after the other, for comparison).
    - ``BACKWARD_INPUT`` runs the whole backward and keeps the weight gradients aside;
      ``BACKWARD_WEIGHT`` adds them to ``.grad`` as torch's split does (values as torch's
      zero-bubble split, without its compute saving).
    - ``pair=True`` first lowers the schedule's compute actions with
      :func:`pair_overlap_f_b` (for schedules that emit no ``OVERLAP_F_B`` of their own).
    - ``options``: the plans' :class:`~moe_overlap.ScheduleOptions`; by default each stage
      module's ``schedule_options()`` when it has one, else the defaults.
    - ``observer`` (e.g. a :class:`~moe_overlap.timeline.Timeline`) times every plan step.

    Refused with :class:`~moe_overlap.ConfigError` / :class:`~moe_overlap.IntegrationError`:
    a torch release not in :data:`TESTED_TORCH`, a single-stage schedule (``Schedule1F1B``,
    ``ScheduleGPipe``: no action runtime), a schedule prepared twice, a stage module that is
    not a ``PreprocessableModel`` or whose ``pre_process`` / ``post_process`` disagree with
    the stage's place, one wrapped by DDP or FSDP, a stage with a ``dw_builder``, and an
    ``OVERLAP_F_B`` whose parts are not one ``FORWARD`` and one ``FULL_BACKWARD``. Each
    ``step`` checks every microbatch's inputs of this rank's stages before anything runs
    (torch's shape inference included): the first stage's one tensor of token ids (int64 or
    int32), and only the stage keywords a plan takes (``position_ids``, ``attention_mask``,
    ``padding_mask``), each a tensor or ``None`` that the stage module's ``forward`` takes
    and the model reads.

    A failure inside a plan raises :class:`~moe_overlap.ScheduleError` naming the pipeline
    rank, the action (stage, microbatch) and the plan step. After every step, failed or
    not, the ranks agree on its outcome (one all-reduce of a per-rank flag over
    ``consensus_group``), so a step that failed on any rank raises on every rank:

    - failed on some rank while the step communicated: every rank raises a
      :class:`~moe_overlap.ScheduleError` (the failing rank its own, the others one naming
      the failed ranks), and the schedule refuses every later step, on every rank, before
      any communication; its process groups are refused by a later ``prepare_schedule``.
      Recover by restoring a checkpoint on new process groups, stages and schedule.
    - failed before the step communicated on every rank (the checks ``step`` runs before
      the microbatches, the library's check for pending delayed weight gradients), or
      after its communication completed: the errors are raised as they are
      (ranks that did not fail raise a ``ScheduleError``); zero the gradients and drop
      pending delayed weight gradients (:func:`~moe_overlap.blocks.discard_wgrad`), and the
      next step is exact. With one process (world size 1) this holds for every failure.

    ``consensus_group``: by default a new gloo group over every rank of the default group,
    made here (a collective: every rank prepares its schedule, in the same order as its
    other group creations), whose timeout is ``consensus_timeout`` (default: twice the
    longest timeout of the default group and the stages' groups, plus 30 seconds: a rank
    blocked in a receive from a failed peer reports after its group's timeout). Or a group
    of yours holding every rank of the stages' groups, on which every rank runs the same
    collectives between steps (gloo: a CPU flag; else a CUDA flag, a device sync per step).
    A ``KeyboardInterrupt`` (any ``BaseException`` not an ``Exception``) propagates at once,
    without the consensus; the peers' consensus then times out and raises.
    """
    check_torch()
    return PipelineOverlap(
        schedule,
        pair=pair,
        overlap=overlap,
        options=options,
        observer=observer,
        consensus_group=consensus_group,
        consensus_timeout=consensus_timeout,
    )


@dataclass(slots=True)
class _Forwarded:
    """What a forward leaves for its backward."""

    plan: ModelChunkSchedulePlan
    inputs: list[object]  # the stage's flat inputs, as torch caches them (their grads go back)
    leaf: Tensor | None  # last stage: the output handed to loss_fn (a leaf)


@dataclass(slots=True)
class _ForwardCall:
    stage: Stage
    key: Key
    args: tuple[object, ...]
    kwargs: dict[str, object]
    plan: ModelChunkSchedulePlan | None  # None: the plain path (no autograd / no backward)


@dataclass(slots=True)
class _BackwardCall:
    stage: Stage
    key: Key
    forwarded: _Forwarded | None  # None: the stage has no backward
    grad: Tensor | None


_OPTIONS = Opt(Instance(ScheduleOptions, "a ScheduleOptions"))
_OBSERVER = OPT_STEP_OBSERVER


class PipelineOverlap:
    """A schedule prepared by :func:`prepare_schedule` (keeps the plans between actions).

    Attributes:
        schedule: the torch schedule.
        paired: how many ``OVERLAP_F_B`` actions this rank runs per step.
    """

    def __init__(
        self,
        schedule: object,
        *,
        pair: bool,
        overlap: bool,
        options: ScheduleOptions | None,
        observer: StepObserver | None,
        consensus_group: dist.ProcessGroup | None = None,
        consensus_timeout: timedelta | None = None,
    ) -> None:
        if not _torch.is_action_runtime(schedule):
            raise ConfigError(
                "prepare_schedule: expected a multi-stage torch.distributed.pipelining "
                "schedule run by torch's action runtime (ScheduleDualPipeV, "
                "ScheduleInterleaved1F1B, ScheduleLoopedBFS, ...), received "
                f"{type(schedule).__name__}; a single-stage schedule (Schedule1F1B, "
                "ScheduleGPipe) has no actions to overlap: use ScheduleInterleaved1F1B"
            )
        if schedule in _PREPARED:
            raise ConfigError(
                f"prepare_schedule: this {type(schedule).__name__} is already prepared; "
                "prepare a schedule once"
            )
        w = "prepare_schedule"
        check_arg(w, "pair", pair, BOOL)
        check_arg(w, "overlap", overlap, BOOL)
        check_arg(w, "options", options, _OPTIONS)
        check_arg(w, "observer", observer, _OBSERVER)
        self.schedule: Any = schedule  # torch's schedules are untyped
        self.overlap = overlap
        self.observer = observer
        self._stages: dict[int, Stage] = {
            s.stage_index: s for s in _torch.schedule_stages(self.schedule)
        }
        for stage in self._stages.values():
            _check_stage(stage)
        _check_untainted(self._stages.values(), consensus_group)
        _check_consensus(self._stages.values(), consensus_group, consensus_timeout)
        self._options = {i: _stage_options(st, options) for i, st in self._stages.items()}
        if pair:
            self._pair()
        self.paired = check_actions(_torch.rank_actions(self.schedule))
        self._live: dict[Key, _Forwarded] = {}
        self._held: dict[Key, list[tuple[nn.Parameter, Tensor | None]]] = {}
        self._return_outputs = True
        self._loss_kwargs: dict[str, Any] | None = None
        self._first_action = True
        self._poisoned: str | None = None  # why every later step is refused
        self._stepping = False  # inside the outermost wrapped step
        self._phase = Phase.BEFORE  # how far the current step got
        self._consensus_group = consensus_group
        # Last: a collective over every rank, after every local check passed.
        self._consensus = _make_consensus(self._stages.values(), consensus_group, consensus_timeout)
        kinds = _torch.kinds()
        for kind, fn in (
            (kinds.forward, self._on_forward),
            (kinds.full_backward, self._on_full_backward),
            (kinds.backward_input, self._on_backward_input),
            (kinds.backward_weight, self._on_backward_weight),
            (kinds.overlap_f_b, self._on_overlap),
        ):
            _torch.register_action(self.schedule, kind, fn)
        self._wrap_step()
        _PREPARED.add(schedule)

    @property
    def rank(self) -> int:
        rank: int = self.schedule.rank
        return rank

    # -- set-up -------------------------------------------------------------------------

    def _pair(self) -> None:
        sched = self.schedule
        to_rank = _torch.stage_to_rank(sched)
        lowered = pair_overlap_f_b(
            _torch.pipeline_order(sched),
            num_stages=_torch.num_stages(sched),
            stage_to_rank=to_rank.__getitem__,
        )
        _torch.set_pipeline_order(sched, lowered)

    def _wrap_step(self) -> None:
        """Wrap the schedule's ``step`` (the consensus after it) and the runtime's per-step
        entry (read ``return_outputs`` / ``loss_kwargs``, which the custom functions'
        context lacks; clean up after a failed step; called alone, the consensus too)."""
        original_step, original = _torch.step_functions(self.schedule)
        signature = inspect.signature(original)

        def run(args: tuple[object, ...], kwargs: dict[str, object]) -> object:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            self._return_outputs = bool(bound.arguments.get("return_outputs", True))
            loss_kwargs = bound.arguments.get("loss_kwargs")
            self._loss_kwargs = cast("dict[str, Any] | None", loss_kwargs)
            self._check_step_inputs(
                bound.arguments.get("arg_mbs"), bound.arguments.get("kwarg_mbs")
            )
            self._begin_step()
            self._phase = Phase.DURING
            try:
                result = original(*args, **kwargs)
            except BaseException:
                self._abort_step()
                raise
            self._phase = Phase.AFTER  # every receive waited, every send completed
            self._end_step()
            return result

        def step_microbatches(*args: object, **kwargs: object) -> object:
            if self._stepping:
                return run(args, kwargs)
            return self._agreed(lambda: run(args, kwargs))

        def step(*args: object, **kwargs: object) -> object:
            return self._agreed(lambda: original_step(*args, **kwargs))

        _torch.wrap_step_functions(self.schedule, step, step_microbatches)

    # -- the consensus after every step -------------------------------------------------

    def _agreed(self, run: Callable[[], object]) -> object:
        """``run()`` (one step), then the consensus: return only when it succeeded on every
        rank; otherwise raise on every rank, and poison the schedule when messages of the
        step may be in flight."""
        self._refuse_if_poisoned()
        self._stepping, self._phase = True, Phase.BEFORE
        failure: Exception | None = None
        result: object = None
        try:
            result = run()
        except Exception as e:
            failure = e
        except BaseException as e:  # KeyboardInterrupt, SystemExit: leave at once
            if self._consensus is not None:
                self._poison(f"global rank {_global_rank()} was interrupted: {type(e).__name__}")
            raise
        finally:
            self._stepping = False
        verdict = self._agree(Phase.OK if failure is None else self._phase, failure)
        if not verdict.failed:
            return result
        me = self._me()
        if not verdict.consistent:
            self._poison(f"it failed on {verdict.describe()}")
        consequence = (
            f"The step failed on {verdict.describe()}; messages of the failed step may "
            "still be in flight between the ranks, so every rank refuses this schedule's "
            f"later steps. {_RECOVER}"
        )
        raise verdict_error(
            verdict,
            failure,
            me,
            consequence=consequence,
            incomplete=f"{me}: this rank's step completed, but not the pipeline's. {consequence}",
        )

    def _agree(self, phase: Phase, failure: Exception | None) -> Verdict:
        if self._consensus is None:
            return Verdict({_global_rank(): phase}, single_process=True)
        try:
            return self._consensus.agree(phase)
        except Exception as e:  # torch's timeout or a lost peer
            within = self._consensus.timeout
            reason = (
                "the ranks did not all report this step's outcome"
                + (f" within {within}" if within is not None else "")
                + f" ({type(e).__name__}: {e})"
            )
            self._poison(reason)
            mine = "" if failure is None else f"; on this rank it failed: {failure}"
            raise ScheduleError(
                f"{self._me()}: {reason}{mine}. Messages of the step may still be in flight, "
                f"so every rank refuses this schedule's later steps. {_RECOVER}",
                position=self._me(),
            ) from e

    def _poison(self, reason: str) -> None:
        self._poisoned = reason
        for group in _groups(self._stages.values()):
            _TAINTED.add(group)
        if self._consensus_group is not None:
            _TAINTED.add(self._consensus_group)

    def _refuse_if_poisoned(self) -> None:
        if self._poisoned is None:
            return
        raise ScheduleError(
            f"{self._me()}: this {type(self.schedule).__name__} refuses to step: an earlier "
            f"step did not complete on every rank ({self._poisoned}), and its messages may "
            f"still be in flight. {_RECOVER}",
            position=f"{self._me()}, refused",
        )

    def _me(self) -> str:
        return f"pipeline rank {self.rank} (global rank {_global_rank()})"

    def _check_step_inputs(self, arg_mbs: object, kwarg_mbs: object) -> None:
        """Every microbatch's inputs of every stage of this rank, before the step runs or
        communicates anything (torch's shape inference included, which runs the stage
        modules' plain forward): what a plan of the stage would refuse, the first stage's
        token ids and every stage keyword (the same on every rank that is given the same
        keywords, so every rank fails before communicating)."""
        args_mbs = cast("list[object]", arg_mbs) if isinstance(arg_mbs, list) else []
        kwargs_mbs = cast("list[object]", kwarg_mbs) if isinstance(kwarg_mbs, list) else []
        for stage in self._stages.values():
            where = _where(stage)
            checked: set[frozenset[str]] = set()  # torch gives every microbatch the same names
            for mb in range(max(len(args_mbs), len(kwargs_mbs))):
                args: tuple[object, ...] | None = None
                if stage.is_first and mb < len(args_mbs):
                    args = tuple(cast("tuple[object, ...]", args_mbs[mb]))
                given = kwargs_mbs[mb] if mb < len(kwargs_mbs) else None
                kwargs = dict(cast("Mapping[str, object]", given or {}))
                names = frozenset(kwargs)
                microbatch = _stage_microbatch(
                    stage, args, kwargs, where, names_checked=names in checked
                )
                checked.add(names)
                check_inputs(stage.submod, ChunkState(microbatch), where=where, what="stage input")

    def _begin_step(self) -> None:
        for index, stage in self._stages.items():
            check_wgrad_done(
                stage.submod,
                when=f"before a pipeline step (stage {index}, left from an earlier step)",
            )
        self._first_action = True

    def _after_shape_inference(self) -> None:
        """torch's shape inference (first step, 2.13) runs the plain backward: weight
        gradients a delayed-wgrad stage queued there (a module that delays whoever calls;
        no plan claims the library's there) are not the step's; drop them."""
        self._first_action = False
        for index, stage in self._stages.items():
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

    def _end_step(self) -> None:
        left = sorted(self._live) + sorted(self._held)
        if left:
            self.release()
            raise NodeStateError(
                f"pipeline rank {self.rank}: expected every forward backed and every "
                f"weight gradient added by the end of the step, received (stage, "
                f"microbatch) {left} left; the schedule misses their B / W actions"
            )
        for index, stage in self._stages.items():
            check_wgrad_done(stage.submod, when=f"at the end of a pipeline step (stage {index})")

    def _abort_step(self) -> None:
        """After a failed step: release the plans and torch's per-step state (the loss
        list is indexed by microbatch; stale entries would be read as the next step's)."""
        self.release()
        _torch.clear_step_state(self.schedule)

    def release(self) -> None:
        """Release every plan kept between actions and the weight gradients held aside."""
        for forwarded in self._live.values():
            if not forwarded.plan.released:
                forwarded.plan.release_state()
        self._live.clear()
        self._held.clear()

    # -- the custom functions -----------------------------------------------------------

    def _on_forward(self, action: Action, ctx: Context) -> None:
        with self._at(action, "forward"):
            call = self._forward_begin(action, ctx)
            out = self._run(call, None) if call.plan is not None else None
            self._forward_end(call, out, ctx)

    def _on_full_backward(self, action: Action, ctx: Context) -> None:
        del ctx
        with self._at(action, "full backward"):
            call = self._backward_begin(action, full=True)
            self._run(None, call)
            self._backward_end(call)

    def _on_backward_input(self, action: Action, ctx: Context) -> None:
        del ctx
        with self._at(action, "input backward"):
            call = self._backward_begin(action, full=False)
            if call.forwarded is None:
                # The stage has no backward (schedule.eval(), a schedule without loss_fn):
                # nothing to compute or hold for the weight backward, as in torch's own run.
                return
            params = list(call.stage.submod.parameters())
            aside = [p.grad for p in params]
            for p in params:
                p.grad = None
            try:
                self._run(None, call)
            finally:
                self._held[call.key] = [(p, p.grad) for p in params]
                for p, g in zip(params, aside, strict=True):
                    p.grad = g
            self._backward_end(call)

    def _on_backward_weight(self, action: Action, ctx: Context) -> None:
        del ctx
        with self._at(action, "weight backward"):
            stage, key = self._stage_of(action)
            _torch.assert_unsharded(self.schedule, stage)
            _torch.count_backward(self.schedule, key[0])
            if not stage.has_backward:
                return
            held = self._held.pop(key, None)
            if held is None:
                raise NodeStateError(
                    f"pipeline rank {self.rank}: {action} (weight backward of stage "
                    f"{key[0]}, microbatch {key[1]}) before its input backward"
                )
            for p, g in held:  # as torch's stage_backward_weight accumulates
                if g is None:
                    continue
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad += g

    def _on_overlap(self, action: Action, ctx: Context) -> None:
        assert action.sub_actions is not None  # checked at prepare
        f_action, b_action = action.sub_actions
        if not self.overlap:
            self._on_forward(f_action, ctx)
            self._on_full_backward(b_action, ctx)
            return
        with self._at(action, "overlapped forward and full backward"):
            f = self._forward_begin(f_action, ctx)
            b = self._backward_begin(b_action, full=True)
            out = self._run(f, b)
            self._forward_end(f, out, ctx)
            self._backward_end(b)

    # -- the halves of torch's FORWARD / FULL_BACKWARD branches --------------------------

    def _stage_of(self, action: Action) -> tuple[Stage, Key]:
        index, mb = action.stage_index, action.microbatch_index
        if mb is None or index not in self._stages:
            raise NodeStateError(
                f"pipeline rank {self.rank}: {action} names no (stage, microbatch) of this "
                f"rank (its stages: {sorted(self._stages)})"
            )
        return self._stages[index], (index, mb)

    def _forward_begin(self, action: Action, ctx: Context) -> _ForwardCall:
        if self._first_action:
            self._after_shape_inference()
        sched = self.schedule
        stage, key = self._stage_of(action)
        _torch.assert_unsharded(sched, stage)
        index, mb = key
        if (
            not stage.is_first
            and index - 1 not in self._stages
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
        stale = self._live.pop(key, None)
        if stale is not None:
            stale.plan.release_state()
        plan = None
        if stage.has_backward and torch.is_grad_enabled():
            plan = self._plan(stage, mb, args, kwargs)
        return _ForwardCall(stage, key, args, kwargs, plan)

    def _plan(
        self,
        stage: Stage,
        mb: int,
        args: tuple[object, ...],
        kwargs: Mapping[str, object],
    ) -> ModelChunkSchedulePlan:
        where = _where(stage)
        microbatch = _stage_microbatch(stage, args, kwargs, where)
        plan = ModelChunkSchedulePlan(
            check_model(stage.submod),
            microbatch,
            options=self._options[stage.stage_index],
            index=mb,
            vp_stage=stage.stage_index,
            float32_output=False,
        )
        return plan

    def _run(self, f: _ForwardCall | None, b: _BackwardCall | None) -> Tensor | None:
        """One :meth:`ModelChunkSchedulePlan.run`; a later stage's input goes in as
        ``decoder.input_tensor`` (read by the pre-process node, first step of the run)."""
        f_plan = f.plan if f is not None else None
        b_plan = b.forwarded.plan if b is not None and b.forwarded is not None else None
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

    def _forward_end(self, call: _ForwardCall, out: Tensor | None, ctx: Context) -> None:
        sched, stage = self.schedule, call.stage
        targets = _torch.targets(ctx)
        index, mb = call.key
        if call.plan is None:  # the plain path: torch's own forward of the stage module
            output = _torch.forward_one_chunk(
                stage, mb, call.args, call.kwargs, save_forward_output=self._return_outputs
            )
        else:
            assert out is not None
            leaf = out.detach().requires_grad_(out.requires_grad) if stage.is_last else None
            result = leaf if leaf is not None else out
            output = result
            if stage.is_last and self._return_outputs:
                _torch.keep_output(stage, result)
            inputs = _torch.flatten_args(call.args) + _torch.flatten_args(call.kwargs)
            _torch.cache_forward(stage, mb, result, inputs)
            _torch.validate_outputs(stage, (result,))
            self._live[call.key] = _Forwarded(call.plan, inputs, leaf)
        _torch.compute_loss(sched, stage, output, targets, mb, self._loss_kwargs)
        if index + 1 in self._stages:  # torch's V-schedule hand-off between local stages
            _torch.hand_forward(self._stages[index + 1], output, mb)

    def _backward_begin(self, action: Action, *, full: bool) -> _BackwardCall:
        if self._first_action:
            self._after_shape_inference()
        sched = self.schedule
        stage, key = self._stage_of(action)
        index, mb = key
        _torch.assert_unsharded(sched, stage)
        if (
            not stage.is_last
            and index + 1 not in self._stages
            and not _torch.wait_received(sched, key, forward=False)
        ):
            raise NodeStateError(
                f"pipeline rank {self.rank}: {action} computed before receiving its output gradient"
            )
        loss = _torch.stage_loss(sched, stage, mb)
        if full:
            _torch.count_backward(sched, index)
        if not stage.has_backward:
            return _BackwardCall(stage, key, None, None)
        forwarded = self._live.pop(key, None)
        if forwarded is None:
            raise NodeStateError(
                f"pipeline rank {self.rank}: {action} (backward of stage {index}, "
                f"microbatch {mb}) without its forward through moe_overlap"
            )
        _torch.drop_forward(stage, mb)
        grad: object
        if stage.is_last:
            grad = self._loss_grad(stage, forwarded, loss, full=full)
        else:
            grads = _torch.received_grads(stage, mb)
            _torch.validate_output_grads(stage, grads)
            grad = grads[0] if len(grads) == 1 else None
        if not isinstance(grad, Tensor):
            forwarded.plan.release_state()
            raise IntegrationError(
                f"pipeline stage {index}: expected one gradient tensor for the stage output "
                f"of microbatch {mb}, received {type(grad).__name__}; the stage output must "
                "require grad"
            )
        return _BackwardCall(stage, key, forwarded, grad)

    def _loss_grad(
        self, stage: Stage, forwarded: _Forwarded, loss: object, *, full: bool
    ) -> Tensor | None:
        """The last stage's output gradient: the loss's backward into the leaf handed to
        ``loss_fn`` (a full backward also reaches ``loss_fn``'s own parameters, as torch's
        does; an input backward computes the output gradient only, as torch's does)."""
        leaf = forwarded.leaf
        assert leaf is not None
        if not isinstance(loss, Tensor):
            raise IntegrationError(
                f"pipeline stage {stage.stage_index}: the last stage's backward needs the "
                f"schedule's loss, received {type(loss).__name__}; build the schedule with a "
                "loss_fn"
            )
        if full:
            torch.autograd.backward(loss)
            return leaf.grad
        (grad,) = torch.autograd.grad(loss, leaf)
        loss.detach_()  # torch's input backward detaches the loss it started from
        return grad

    def _backward_end(self, call: _BackwardCall) -> None:
        stage = call.stage
        index, mb = call.key
        if call.forwarded is None:
            return
        inputs = call.forwarded.inputs
        grads_input = tuple(t.grad if isinstance(t, Tensor) else None for t in inputs)
        _torch.cache_input_grads(stage, mb, grads_input)
        if stage.is_last and not stage.is_first and call.forwarded.leaf is not None:
            call.forwarded.leaf.detach_()
        if index - 1 in self._stages:  # torch's V-schedule hand-off between local stages
            grads = _torch.local_input_grads(stage, mb)
            _torch.hand_backward(self._stages[index - 1], grads, mb)

    @contextmanager
    def _at(self, action: Action, what: str) -> Generator[None]:
        """Name the pipeline position in a failure: ScheduleError for a failed plan step
        and for anything not the library's own; the library's own errors as they are."""
        try:
            yield
        except ScheduleError as e:
            position = f"pipeline rank {self.rank}, {describe(action)}"
            raise ScheduleError(f"{position}: {e}", position=f"{position}; {e.position}") from e
        except MoeOverlapError:
            raise
        except Exception as e:
            position = f"pipeline rank {self.rank}, {describe(action)} ({what})"
            raise ScheduleError(f"{position}: {type(e).__name__}: {e}", position=position) from e


def _global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> object:
    """The default process group (``None`` before ``init_process_group``: only stand-ins
    for stages are built then, never stepped)."""
    world: object = dist.group.WORLD if dist.is_initialized() else None
    return world


def _groups(stages: Iterable[Stage]) -> list[object]:
    """The process groups the stages communicate on (``None``: the default group)."""
    default = _world()
    found: list[object] = []
    for stage in stages:
        own: object = getattr(stage, "group", None)
        group = own if own is not None else default
        if group is not None and not any(group is g for g in found):
            found.append(group)
    return found


def _check_untainted(stages: Iterable[Stage], consensus_group: dist.ProcessGroup | None) -> None:
    """No group of a schedule whose step failed mid-communication is used again."""
    named = [
        (f"pipeline stage {stage.stage_index}'s group", group)
        for stage in stages
        for group in _groups([stage])
    ]
    if consensus_group is not None:
        named.append(("consensus_group", consensus_group))
    for where, group in named:
        if group in _TAINTED:
            raise ConfigError(
                f"prepare_schedule: {where} was used by a schedule whose step failed while "
                "it communicated; messages of that step may still be in flight on it and "
                "would be read by this schedule. Expected new process groups, received that "
                f"one. {_RECOVER}"
            )


def _check_consensus(
    stages: Iterable[Stage],
    group: dist.ProcessGroup | None,
    timeout: timedelta | None,
) -> None:
    """``prepare_schedule``'s consensus arguments (before anything is changed)."""
    given = cast(object, timeout)
    if given is not None and (not isinstance(given, timedelta) or given <= timedelta(0)):
        raise ConfigError(
            "prepare_schedule: consensus_timeout must be a positive datetime.timedelta or "
            f"None, received {given!r}"
        )
    if group is not None:
        if timeout is not None:
            raise ConfigError(
                "prepare_schedule: consensus_timeout sets the timeout of the group "
                "prepare_schedule makes; received it with a consensus_group of yours, whose "
                "own timeout applies: create it with the timeout you want"
            )
        if not isinstance(cast(object, group), dist.ProcessGroup):
            raise ConfigError(
                "prepare_schedule: consensus_group must be a torch.distributed ProcessGroup "
                f"or None, received {type(group).__name__}"
            )
        ranks = set(dist.get_process_group_ranks(group))
        needed = set[int]()
        for g in _groups(stages):
            needed |= set(dist.get_process_group_ranks(cast("dist.ProcessGroup", g)))
        if dist.get_rank() not in ranks or not needed <= ranks:
            raise ConfigError(
                "prepare_schedule: expected a consensus_group holding every rank of the "
                f"stages' groups {sorted(needed)}, received one of ranks {sorted(ranks)}"
            )


def _make_consensus(
    stages: Iterable[Stage],
    group: dist.ProcessGroup | None,
    timeout: timedelta | None,
) -> StepConsensus | None:
    """The step consensus (arguments checked): ``group``'s, else a new gloo group over the
    world; none for one process."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    if group is not None:
        return StepConsensus(group, timeout=None)
    if timeout is None:
        timeout = 2 * _longest_timeout(stages) + timedelta(seconds=30)
    return StepConsensus.create(timeout)


def _longest_timeout(stages: Iterable[Stage]) -> timedelta:
    """The longest timeout of the default group and the stages' groups (torch's default
    where a group does not say)."""
    groups = [_world(), *_groups(stages)]
    found = [_torch.group_timeout(g) for g in groups if g is not None]
    known = [t for t in found if t is not None]
    return max(known) if known else dist.default_pg_timeout


def _where(stage: Stage) -> str:
    return f"pipeline stage {stage.stage_index} ({type(stage.submod).__name__})"


_TOKEN_DTYPES = (torch.int64, torch.int32)
"""What an embedding takes as indices (``nn.Embedding``: Long or Int)."""


def _stage_microbatch(
    stage: Stage,
    args: tuple[object, ...] | None,
    kwargs: Mapping[str, object],
    where: str,
    *,
    names_checked: bool = False,
) -> Microbatch:
    """The :class:`~moe_overlap.Microbatch` a plan of ``stage`` is built from, its inputs
    checked: one tensor (``args``; ``None`` before a later stage received it), integer
    token ids on the first stage, and only the keywords a plan takes (:data:`_PLAN_KWARGS`),
    each a tensor or ``None``, each a parameter of the stage module's ``forward`` and read by
    the model (``names_checked``: these names were, for another microbatch)."""
    x: Tensor | None = None
    if args is not None:
        if len(args) != 1 or not isinstance(args[0], Tensor):
            shown = ", ".join(type(a).__name__ for a in args)
            raise IntegrationError(
                f"{where}: expected one tensor input (token ids on the first stage, hidden "
                f"states after it), received ({shown})"
            )
        x = args[0]
        if stage.is_first and x.dtype not in _TOKEN_DTYPES:
            raise ConfigError(
                f"{where}: the first stage's input (schedule.step's positional argument): "
                "expected token ids as an integer tensor (int64 or int32), received "
                f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)}; pass the token ids "
                "(e.g. ids.long()), not embeddings or float values"
            )
    if not names_checked:
        unknown = sorted(set(kwargs) - set(_PLAN_KWARGS))
        if unknown:
            raise ConfigError(
                f"{where}: stage keyword argument {unknown[0]!r} (schedule.step(..., "
                f"{unknown[0]}=...)): expected only the keyword arguments a plan takes, "
                f"{list(_PLAN_KWARGS)}, received also {unknown}; leave it out, or pass what "
                "the layers read through those or through the stage's inputs"
            )
        _check_stage_keywords(stage.submod, kwargs, where)

    def tensor_kwarg(name: str) -> Tensor | None:
        value = kwargs.get(name)
        if value is None or isinstance(value, Tensor):
            return value
        raise ConfigError(
            f"{where}: keyword {name} must be a Tensor or None, received {type(value).__name__}"
        )

    return Microbatch(
        input_ids=x if stage.is_first else None,
        position_ids=tensor_kwarg("position_ids"),
        attention_mask=tensor_kwarg("attention_mask"),
        decoder_input=None if stage.is_first else x,
        padding_mask=tensor_kwarg("padding_mask"),
    )


def _check_stage_keywords(module: nn.Module, kwargs: Mapping[str, object], where: str) -> None:
    """Every stage keyword is one the plan consumes, never one it drops: the stage module's
    ``forward`` must take it (torch's own run passes it there, ``None`` included) and, when
    set, the model must read it (:func:`~moe_overlap.inputs.check_inputs`)."""
    if not kwargs:
        return
    params = _forward_parameters(module)
    if params is not None:
        refused = sorted(k for k in kwargs if k not in params)
        if refused:
            raise ConfigError(
                f"{where}: stage keyword {refused[0]} is not a parameter of "
                f"{type(module).__name__}.forward{_signature(module)}, so torch's own run of "
                "the stage refuses it; the prepared schedule refuses it too rather than drop "
                "it. Leave it out, or give the stage module's forward that parameter"
            )
    check_inputs(module, kwargs, where=where, what="stage keyword")


def _forward_parameters(module: nn.Module) -> frozenset[str] | None:
    """The keyword names ``module.forward`` takes; ``None`` when it takes ``**kwargs``."""
    params = inspect.signature(module.forward).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return frozenset(p.name for p in params if p.kind in keyword)


def _signature(module: nn.Module) -> str:
    return str(inspect.signature(module.forward))


def _stage_options(stage: Stage, options: ScheduleOptions | None) -> ScheduleOptions:
    if options is not None:
        return options
    make: object = getattr(stage.submod, "schedule_options", None)
    if callable(make):
        made = make()
        if isinstance(made, ScheduleOptions):
            return made
    return ScheduleOptions()


def _check_stage(stage: Stage) -> None:
    """A stage the plans can run: its module a PreprocessableModel placed as the stage is."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    module = stage.submod
    where = f"pipeline stage {stage.stage_index} ({type(module).__name__})"
    if isinstance(module, (FSDPModule, DistributedDataParallel)):
        raise ConfigError(
            f"{where}: expected the stage module itself, received it wrapped by "
            f"{type(module).__name__}; data-parallel wrappers are not composed with the "
            "pipeline integration yet (their hooks do not fire when plan slots call "
            "submodules): prepare an unwrapped stage"
        )
    if _torch.dw_builder(stage) is not None:
        raise ConfigError(
            f"{where}: expected a stage without dw_builder (the plans compute the weight "
            "gradients), received one"
        )
    check_bypassed(module, f"pipeline stage {stage.stage_index}")
    model = check_model(module)
    for flag, expected, meaning in (
        ("pre_process", stage.is_first, "the first stage embeds"),
        ("post_process", stage.is_last, "the last stage's output goes to loss_fn"),
    ):
        got: bool = getattr(model, flag)
        if got != expected:
            raise IntegrationError(
                f"{where}: expected {flag}={expected} for stage {stage.stage_index} of "
                f"{stage.num_stages} ({meaning}), received {flag}={got}"
            )
