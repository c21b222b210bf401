# pyright: reportPrivateUsage=false
# The one module of moe_overlap.integrations.pipelining that touches torch's private names.
"""torch's pipelining internals, as the pipelining integration uses them; the tested releases.

The integration's other modules reach torch's internals only through the functions here
(``tests/integrations/test_private_torch.py`` parses them and fails on a private torch
name), so a torch release that moves them breaks this module alone. The differences of
torch 2.11 and 2.13 are shims here. Tested with :data:`TESTED_TORCH`; on another release
every public function of the integration raises :class:`~moe_overlap.ConfigError`
(:func:`check_torch`) before any of these is touched.

Private names used, all in this module:

- ``torch.distributed.pipelining.schedules``: ``_PipelineScheduleRuntime`` (its
  ``register_custom_function``, ``step`` / ``_step_microbatches`` wrapped on the instance,
  ``_prepare_schedule_with_comms``, ``_assert_unsharded``, ``fwd_recv_ops`` /
  ``bwd_recv_ops``, ``backward_counter``, ``pipeline_order`` /
  ``pipeline_order_with_comms``, ``_stages``, ``_maybe_compute_loss`` /
  ``_maybe_get_loss``, ``_internal_losses``, ``stage_index_to_group_rank``,
  ``_num_stages``), ``_Action``, ``_ComputationType``, ``_PipelineContext`` (``arg_mbs``,
  ``kwarg_mbs``, ``target_mbs``), ``_wait_batch_p2p`` and ``_add_send_recv``;
- ``torch.distributed.pipelining.stage``, ``_PipelineStageBase``:
  ``_retrieve_recv_activations`` / ``_retrieve_recv_grads``, ``fwd_cache`` / ``bwd_cache``,
  ``output_chunks``, ``forward_one_chunk``, ``set_local_fwd_input`` /
  ``set_local_bwd_input`` / ``get_local_bwd_output``, ``dw_builder``, and the output checks
  (``_validate_fwd_outputs`` in 2.11; ``_runtime_validate`` / ``_validate_stage_tensors`` /
  ``_stage_meta`` in 2.13);
- ``torch.distributed.pipelining._utils``: ``flatten_args``;
- ``torch.distributed``: a process group's ``_get_backend(device).options._timeout``.

Read directly by the other modules (torch's public names): a stage's ``stage_index``,
``num_stages``, ``is_first``, ``is_last``, ``submod``, ``group`` and ``has_backward``; a
schedule's ``rank``; an action's fields (``stage_index``, ``computation_type``,
``microbatch_index``, ``sub_actions``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from moe_overlap import ConfigError
from moe_overlap.args import Instance, Opt, check_arg

if TYPE_CHECKING:
    from typing import TypeAlias

    from torch.distributed.pipelining.schedules import (
        _Action,
        _ComputationType,
        _PipelineContext,
    )
    from torch.distributed.pipelining.stage import _PipelineStageBase

    Action: TypeAlias = _Action
    """One action of a schedule (``1F0``, ``(0F7;7B3)OVERLAP_F_B``, ...)."""
    Kind: TypeAlias = _ComputationType
    """An action's computation type (``FORWARD``, ``OVERLAP_F_B``, ...)."""
    Context: TypeAlias = _PipelineContext
    """What torch hands a custom function besides its action (the step's microbatches)."""
    Stage: TypeAlias = _PipelineStageBase
    """A pipeline stage (``PipelineStage``)."""
else:
    # At run time the aliases stay opaque: torch's pipelining is imported only after
    # check_torch, and debug mode's beartype resolves annotations through these names (the
    # integration checks stages and actions itself).
    Action = Kind = Context = Stage = object

__all__ = [
    "TESTED_TORCH",
    "Kinds",
    "add_send_recv",
    "assert_unsharded",
    "cache_forward",
    "cache_input_grads",
    "check_torch",
    "clear_step_state",
    "compute_loss",
    "count_backward",
    "drop_forward",
    "dw_builder",
    "flatten_args",
    "forward_one_chunk",
    "group_timeout",
    "hand_backward",
    "hand_forward",
    "is_action_runtime",
    "keep_output",
    "kinds",
    "local_input_grads",
    "microbatch_args",
    "microbatch_kwargs",
    "num_stages",
    "overlap_action",
    "pipeline_order",
    "rank_actions",
    "received_activations",
    "received_grads",
    "register_action",
    "schedule_stages",
    "set_pipeline_order",
    "stage_loss",
    "stage_to_rank",
    "step_functions",
    "targets",
    "validate_inputs",
    "validate_output_grads",
    "validate_outputs",
    "wait_received",
    "wrap_step_functions",
]

TESTED_TORCH = ("2.11", "2.13")
"""The torch releases (major.minor) whose pipelining internals this module was tested with."""


def check_torch(version: str | None = None) -> None:
    """Raise :class:`~moe_overlap.ConfigError` unless torch is one of :data:`TESTED_TORCH`."""
    check_arg("check_torch", "version", version, Opt(Instance(str, "a version string")))
    found = version if version is not None else torch.__version__
    release = ".".join(found.split("+")[0].split(".")[:2])
    if release not in TESTED_TORCH:
        raise ConfigError(
            f"moe_overlap.integrations.pipelining: uses private names of "
            f"torch.distributed.pipelining tested with torch {', '.join(TESTED_TORCH)}; "
            f"received torch {found}. Pin one of those, or check the module against this "
            "release and add it to TESTED_TORCH"
        )


# Imported on first use, after check_torch: another release may lack these names.
@functools.cache
def _schedules() -> Any:
    from torch.distributed.pipelining import schedules

    return schedules


# -- actions ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Kinds:
    """torch's computation types the integration runs."""

    forward: Kind
    full_backward: Kind
    backward_input: Kind
    backward_weight: Kind
    overlap_f_b: Kind


@functools.cache
def kinds() -> Kinds:
    """torch's computation types (``FORWARD``, ``FULL_BACKWARD``, ...)."""
    S = _schedules()
    return Kinds(S.FORWARD, S.FULL_BACKWARD, S.BACKWARD_INPUT, S.BACKWARD_WEIGHT, S.OVERLAP_F_B)


def schedule_class(name: str) -> Any:
    """A schedule class of ``torch.distributed.pipelining.schedules`` by name."""
    return getattr(_schedules(), name)


def is_action(value: object) -> bool:
    """``value`` is one of torch's actions (an ``_Action``)."""
    return isinstance(value, _schedules()._Action)


def is_reduce_grad(action: Action) -> bool:
    """``REDUCE_GRAD`` (torch 2.13's gradient scaling step; 2.11 has none)."""
    kind = getattr(_schedules(), "REDUCE_GRAD", None)
    return kind is not None and action.computation_type == kind


def overlap_action(forward: Action, backward: Action) -> Action:
    """The ``OVERLAP_F_B`` action of ``(forward, backward)``, as ``ScheduleDualPipeV`` makes it."""
    S = _schedules()
    action: Action = S._Action(-1, S.OVERLAP_F_B, None, (forward, backward))
    return action


def add_send_recv(
    compute: Mapping[int, list[Action]], stage_to_rank: Callable[[int], int], num_stages: int
) -> None:
    """torch's placement of sends and receives; raises ``AssertionError`` where a rank
    would wait forever."""
    _schedules()._add_send_recv(compute, stage_to_rank, num_stages)


# -- the schedule (a _PipelineScheduleRuntime) ---------------------------------------------


def is_action_runtime(schedule: object) -> bool:
    """``schedule`` is run by torch's action runtime (a multi-stage schedule)."""
    return isinstance(schedule, _schedules()._PipelineScheduleRuntime)


def schedule_stages(schedule: Any) -> list[Stage]:
    """This rank's stages."""
    stages: list[Stage] = list(schedule._stages)
    return stages


def register_action(schedule: Any, kind: Kind, fn: Callable[[Action, Context], None]) -> None:
    """Run ``fn`` for each action of computation type ``kind``."""
    schedule.register_custom_function(kind, fn)


def pipeline_order(schedule: Any) -> Mapping[int, Sequence[Action | None]]:
    """The compute-only schedule: per rank, its actions and ``None`` bubbles."""
    order: Mapping[int, Sequence[Action | None]] = schedule.pipeline_order
    return order


def set_pipeline_order(schedule: Any, order: Mapping[int, Sequence[Action | None]]) -> None:
    """Replace the compute-only schedule, and lower it to communication again."""
    schedule.pipeline_order = order
    schedule._prepare_schedule_with_comms(order)


def num_stages(schedule: Any) -> int:
    """The pipeline's number of stages (every rank's)."""
    count: int = schedule._num_stages
    return count


def stage_to_rank(schedule: Any) -> dict[int, int]:
    """The pipeline rank of each stage."""
    return dict(schedule.stage_index_to_group_rank)


def rank_actions(schedule: Any) -> Sequence[Action]:
    """This rank's actions, communication included."""
    actions: Sequence[Action] = schedule.pipeline_order_with_comms[schedule.rank]
    return actions


def step_functions(schedule: Any) -> tuple[Callable[..., object], Callable[..., object]]:
    """The schedule's ``step`` and its runtime's per-step entry ``_step_microbatches``."""
    return schedule.step, schedule._step_microbatches


def wrap_step_functions(
    schedule: Any, step: Callable[..., object], step_microbatches: Callable[..., object]
) -> None:
    """Replace, on the instance, what :func:`step_functions` returns."""
    schedule._step_microbatches = step_microbatches
    schedule.step = step


def clear_step_state(schedule: Any) -> None:
    """Drop torch's per-step state after a failed step: the losses (indexed by microbatch,
    stale entries would be read as the next step's) and the pending receives."""
    schedule._internal_losses.clear()
    schedule.fwd_recv_ops.clear()
    schedule.bwd_recv_ops.clear()


def assert_unsharded(schedule: Any, stage: Stage) -> None:
    """torch's check that the stage's parameters are unsharded for compute."""
    schedule._assert_unsharded(stage)


def count_backward(schedule: Any, stage_index: int) -> None:
    """Count a stage's backward, as torch's runtime does (its gradient scaling reads it)."""
    schedule.backward_counter[stage_index] += 1


def wait_received(schedule: Any, key: tuple[int, int], *, forward: bool) -> bool:
    """Wait for the receive of ``key`` (stage, microbatch): the input (``forward``) or the
    output gradient; ``False`` when none was posted."""
    ops = schedule.fwd_recv_ops if forward else schedule.bwd_recv_ops
    if key not in ops:
        return False
    _schedules()._wait_batch_p2p(ops.pop(key))
    return True


def compute_loss(
    schedule: Any,
    stage: Stage,
    output: object,
    targets: object,
    mb: int,
    loss_kwargs: dict[str, Any] | None,
) -> None:
    """torch's loss of the last stage's output (none on the other stages)."""
    if loss_kwargs is None:
        schedule._maybe_compute_loss(stage, output, targets, mb)
    else:
        schedule._maybe_compute_loss(stage, output, targets, mb, loss_kwargs)


def stage_loss(schedule: Any, stage: Stage, mb: int) -> object:
    """The loss torch computed for ``mb`` (``None`` off the last stage)."""
    loss: object = schedule._maybe_get_loss(stage, mb)
    return loss


# -- the context handed to custom functions -----------------------------------------------


def microbatch_args(ctx: Context, mb: int) -> tuple[object, ...]:
    """The first stage's positional inputs of microbatch ``mb``."""
    context: Any = ctx  # torch leaves the microbatch lists' items untyped
    arg_mbs: list[tuple[object, ...]] = context.arg_mbs
    return tuple(arg_mbs[mb])


def microbatch_kwargs(ctx: Context, mb: int) -> dict[str, object]:
    """The stage keyword arguments of microbatch ``mb`` (``step(..., **kwargs)``)."""
    context: Any = ctx  # torch leaves the microbatch lists' items untyped
    kwarg_mbs: list[dict[str, object] | None] = context.kwarg_mbs
    return dict(kwarg_mbs[mb] or {})


def targets(ctx: Context) -> object:
    """The step's loss targets, per microbatch."""
    found: object = cast(Any, ctx).target_mbs
    return found


# -- a stage (a _PipelineStageBase) -------------------------------------------------------


def dw_builder(stage: Stage) -> object:
    """The stage's weight-gradient builder (``None`` when it has none)."""
    builder: object = stage.dw_builder
    return builder


def received_activations(stage: Stage, mb: int) -> tuple[object, ...]:
    """The stage's received inputs of microbatch ``mb``."""
    torch_stage: Any = stage
    received: Any = torch_stage._retrieve_recv_activations(mb)
    return tuple(received)


def received_grads(stage: Stage, mb: int) -> tuple[object, ...]:
    """The stage's received output gradients of microbatch ``mb``."""
    return tuple(stage._retrieve_recv_grads(mb))


def forward_one_chunk(
    stage: Stage,
    mb: int,
    args: tuple[object, ...],
    kwargs: dict[str, object],
    *,
    save_forward_output: bool,
) -> object:
    """torch's own forward of the stage module (the plain path)."""
    output: object = stage.forward_one_chunk(
        mb, args, kwargs, save_forward_output=save_forward_output
    )
    return output


def keep_output(stage: Stage, output: Tensor) -> None:
    """Keep the last stage's output for ``step``'s return value."""
    stage.output_chunks.append(output)


def cache_forward(stage: Stage, mb: int, output: Tensor, inputs: list[object]) -> None:
    """What torch's forward caches for the backward and the send (output, flat inputs)."""
    cache = cast("dict[int, object]", stage.fwd_cache)
    cache[mb] = ((output,), inputs)


def drop_forward(stage: Stage, mb: int) -> None:
    """Drop what :func:`cache_forward` kept, as torch's backward does."""
    stage.fwd_cache.pop(mb)


def cache_input_grads(stage: Stage, mb: int, grads: tuple[Tensor | None, ...]) -> None:
    """Cache the input gradients to send back (2.13: the positional inputs'; 2.11: all),
    checked as torch 2.13 checks them when asked."""
    stage.bwd_cache[mb] = _positional_grads(stage, grads)
    _validate_input_grads(stage, stage.bwd_cache[mb])


def hand_forward(stage: Stage, output: object, mb: int) -> None:
    """torch's V-schedule hand-off of an output to the next stage on this rank."""
    stage.set_local_fwd_input(output, mb)


def local_input_grads(stage: Stage, mb: int) -> object:
    """The input gradients to hand to the previous stage on this rank."""
    grads: object = cast(Any, stage).get_local_bwd_output(mb)  # untyped in torch
    return grads


def hand_backward(stage: Stage, grads: object, mb: int) -> None:
    """torch's V-schedule hand-off of input gradients to the previous stage on this rank."""
    stage.set_local_bwd_input(cast(Any, grads), mb)


def flatten_args(args: object) -> list[object]:
    """torch's flattening of a stage's inputs (the tensors its backward reads)."""
    from torch.distributed.pipelining import _utils

    utils: Any = _utils
    flatten: Callable[[object], list[object]] = utils.flatten_args
    return list(flatten(args))


# -- torch's optional runtime checks of the stage tensors (2.11 / 2.13) ---------------------


def validate_inputs(stage: Stage, args: tuple[object, ...]) -> None:
    """torch 2.13's optional runtime check of the stage inputs (2.11 has none)."""
    if getattr(stage, "_runtime_validate", False):
        stage._validate_stage_tensors(
            f"Stage {stage.stage_index} forward inputs",
            stage._stage_meta.inputs,
            cast("tuple[Tensor | None, ...]", args),
        )


def validate_outputs(stage: Stage, outputs: tuple[Tensor, ...]) -> None:
    """torch's output check after a forward: 2.11 always, 2.13 when asked (not last)."""
    check: object = getattr(stage, "_validate_fwd_outputs", None)
    if callable(check):
        check(outputs)
    elif getattr(stage, "_runtime_validate", False) and not stage.is_last:
        stage._validate_stage_tensors(
            f"Stage {stage.stage_index} forward outputs", stage._stage_meta.outputs, outputs
        )


def validate_output_grads(stage: Stage, grads: tuple[object, ...]) -> None:
    """torch 2.13's optional runtime check of the received output gradients."""
    if getattr(stage, "_runtime_validate", False):
        stage._validate_stage_tensors(
            f"Stage {stage.stage_index} backward input (output_grads)",
            stage._stage_meta.output_grads,
            cast("tuple[Tensor | None, ...]", grads),
        )


def _validate_input_grads(stage: Stage, grads: tuple[Tensor | None, ...]) -> None:
    """torch 2.13's optional runtime check of the input gradients to send back."""
    if getattr(stage, "_runtime_validate", False) and not stage.is_first:
        stage._validate_stage_tensors(
            f"Stage {stage.stage_index} backward output (input_grads)",
            stage._stage_meta.input_grads,
            grads,
        )


def _positional_grads(stage: Stage, grads: tuple[Tensor | None, ...]) -> tuple[Tensor | None, ...]:
    """What torch caches to send back: 2.13 the positional inputs' grads, 2.11 all."""
    meta: object = getattr(stage, "_stage_meta", None)
    inputs: object = getattr(meta, "inputs", None)
    if isinstance(inputs, (tuple, list)):
        return grads[: len(cast("Sequence[object]", inputs))]
    return grads


# -- process groups -----------------------------------------------------------------------


def group_timeout(group: object) -> timedelta | None:
    """A process group's timeout (``None`` where its backend does not say)."""
    for device in ("cpu", "cuda"):
        try:
            backend: Any = cast(Any, group)._get_backend(torch.device(device))
        except (RuntimeError, AttributeError, ValueError):
            continue
        value: object = getattr(getattr(backend, "options", None), "_timeout", None)
        if isinstance(value, timedelta):
            return value
    return None
