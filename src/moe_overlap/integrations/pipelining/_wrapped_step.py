"""The prepared schedule's ``step``, wrapped on the instance.

``step`` and the runtime's per-step entry ``_step_microbatches`` are replaced: the entry
reads ``return_outputs`` / ``loss_kwargs`` (which the custom functions' context lacks),
checks every microbatch's inputs before anything runs, and cleans up after a failed step;
the consensus runs after the outermost of the two.
"""

from __future__ import annotations

import inspect
from typing import Any, cast

from moe_overlap.integrations._consensus import Phase
from moe_overlap.integrations.pipelining import _torch
from moe_overlap.integrations.pipelining._agreement import StepAgreement
from moe_overlap.integrations.pipelining._plan_runner import PlanRunner
from moe_overlap.integrations.pipelining._stage_checks import check_step_inputs

__all__ = ["wrap_step"]


def wrap_step(schedule: Any, runner: PlanRunner, agreement: StepAgreement) -> None:
    """Wrap ``schedule``'s ``step`` (the consensus after it) and the runtime's per-step
    entry (read ``return_outputs`` / ``loss_kwargs``, which the custom functions' context
    lacks; clean up after a failed step; called alone, the consensus too)."""
    original_step, original = _torch.step_functions(schedule)
    signature = inspect.signature(original)

    def run(args: tuple[object, ...], kwargs: dict[str, object]) -> object:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        runner.return_outputs = bool(bound.arguments.get("return_outputs", True))
        loss_kwargs = bound.arguments.get("loss_kwargs")
        runner.loss_kwargs = cast("dict[str, Any] | None", loss_kwargs)
        check_step_inputs(
            runner.stages.values(), bound.arguments.get("arg_mbs"), bound.arguments.get("kwarg_mbs")
        )
        runner.begin_step()
        agreement.phase = Phase.DURING
        try:
            result = original(*args, **kwargs)
        except BaseException:
            runner.abort_step()
            raise
        agreement.phase = Phase.AFTER  # every receive waited, every send completed
        runner.end_step()
        return result

    def step_microbatches(*args: object, **kwargs: object) -> object:
        if agreement.stepping:
            return run(args, kwargs)
        return agreement.agreed(lambda: run(args, kwargs))

    def step(*args: object, **kwargs: object) -> object:
        return agreement.agreed(lambda: original_step(*args, **kwargs))

    _torch.wrap_step_functions(schedule, step, step_microbatches)
