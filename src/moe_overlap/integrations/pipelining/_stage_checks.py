"""What a stage and its inputs must be for the plans to run it.

``prepare_schedule``'s check of each stage and its plan options; the
:class:`~moe_overlap.Microbatch` a plan is built from, its inputs checked; and each step's
check of every microbatch's inputs before anything runs.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import cast

import torch
from torch import Tensor, nn

from moe_overlap import ChunkState, ConfigError, IntegrationError, Microbatch, ScheduleOptions
from moe_overlap.engine import check_bypassed, check_model
from moe_overlap.inputs import check_inputs
from moe_overlap.integrations.pipelining import _torch
from moe_overlap.integrations.pipelining._torch import Stage

__all__ = [
    "PLAN_KWARGS",
    "check_stage",
    "check_step_inputs",
    "stage_microbatch",
    "stage_name",
    "stage_options",
]

PLAN_KWARGS = ("position_ids", "attention_mask", "padding_mask")
"""Stage-module keyword arguments (``schedule.step(..., **kwargs)``) a plan takes by name."""

_TOKEN_DTYPES = (torch.int64, torch.int32)
"""What an embedding takes as indices (``nn.Embedding``: Long or Int)."""


def stage_name(stage: Stage) -> str:
    """How messages name ``stage``: its index and its module's class."""
    return f"pipeline stage {stage.stage_index} ({type(stage.submod).__name__})"


def check_stage(stage: Stage) -> None:
    """A stage the plans can run: its module a PreprocessableModel placed as the stage is."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    module = stage.submod
    where = stage_name(stage)
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


def stage_options(stage: Stage, options: ScheduleOptions | None) -> ScheduleOptions:
    """``options``, else the stage module's ``schedule_options()``, else the defaults."""
    if options is not None:
        return options
    make: object = getattr(stage.submod, "schedule_options", None)
    if callable(make):
        made = make()
        if isinstance(made, ScheduleOptions):
            return made
    return ScheduleOptions()


def check_step_inputs(stages: Iterable[Stage], arg_mbs: object, kwarg_mbs: object) -> None:
    """Every microbatch's inputs of every stage of this rank, before the step runs or
    communicates anything (torch's shape inference included, which runs the stage
    modules' plain forward): what a plan of the stage would refuse, the first stage's
    token ids and every stage keyword (the same on every rank that is given the same
    keywords, so every rank fails before communicating)."""
    args_mbs = cast("list[object]", arg_mbs) if isinstance(arg_mbs, list) else []
    kwargs_mbs = cast("list[object]", kwarg_mbs) if isinstance(kwarg_mbs, list) else []
    for stage in stages:
        at = stage_name(stage)
        checked: set[frozenset[str]] = set()  # torch gives every microbatch the same names
        for mb in range(max(len(args_mbs), len(kwargs_mbs))):
            args: tuple[object, ...] | None = None
            if stage.is_first and mb < len(args_mbs):
                args = tuple(cast("tuple[object, ...]", args_mbs[mb]))
            given = kwargs_mbs[mb] if mb < len(kwargs_mbs) else None
            kwargs = dict(cast("Mapping[str, object]", given or {}))
            names = frozenset(kwargs)
            microbatch = stage_microbatch(stage, args, kwargs, at, names_checked=names in checked)
            checked.add(names)
            check_inputs(stage.submod, ChunkState(microbatch), where=at, what="stage input")


def stage_microbatch(
    stage: Stage,
    args: tuple[object, ...] | None,
    kwargs: Mapping[str, object],
    where: str,
    *,
    names_checked: bool = False,
) -> Microbatch:
    """The :class:`~moe_overlap.Microbatch` a plan of ``stage`` is built from, its inputs
    checked: one tensor (``args``; ``None`` before a later stage received it), integer
    token ids on the first stage, and only the keywords a plan takes (:data:`PLAN_KWARGS`),
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
        unknown = sorted(set(kwargs) - set(PLAN_KWARGS))
        if unknown:
            raise ConfigError(
                f"{where}: stage keyword argument {unknown[0]!r} (schedule.step(..., "
                f"{unknown[0]}=...)): expected only the keyword arguments a plan takes, "
                f"{list(PLAN_KWARGS)}, received also {unknown}; leave it out, or pass what "
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
