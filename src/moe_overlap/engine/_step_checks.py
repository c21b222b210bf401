"""A macro step's arguments, checked before the runner lists its steps (a guard).

The core's runner (``core/_runner.py``) runs what it is given; :class:`StepChecks`, attached
at its ``step_started`` hook, refuses what cannot run first: a released plan, an output
gradient given without a backward plan or missing for one, or not of the shape, dtype and
device of that plan's output (which ``output.backward(grad)`` would broadcast silently), and
a step outside autograd recording (:func:`check_grad_mode`, which ``combined_1f1b`` also
calls before its first plan).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from moe_overlap.errors import ConfigError, IntegrationError, PlanReleasedError

from ._guards import BaseGuard
from .core._chunk_plan import ModelChunkSchedulePlan
from .core._node import ScheduleNode
from .core._runner import ChunkRun
from .core._steps import Slot

__all__ = ["StepChecks", "check_grad_mode", "check_output_grad", "output_node"]


class StepChecks(BaseGuard):
    """The guard: a macro step's plans, output gradients and grad mode, before its steps."""

    def step_started(
        self,
        forward: Sequence[ChunkRun],
        backward: Sequence[ChunkRun],
        grads: Sequence[object],
        where: str,
    ) -> None:
        for plan in (*forward, *backward):
            if plan.released:
                raise PlanReleasedError(
                    f"{where}: the plan of microbatch {plan.microbatch_index} was released; "
                    "build a new plan for every microbatch"
                )
        if len(grads) > len(backward):
            raise ConfigError(
                f"{where}: b_grad is given but there is no backward plan (b_schedule_plan is "
                "None); expected b_grad only with a backward plan"
            )
        for i, plan in enumerate(backward):
            grad = grads[i] if i < len(grads) else None
            if grad is None:
                raise IntegrationError(f"{where}: a backward plan needs b_grad")
            label = f"{where}: b_grad" if len(backward) == 1 else f"{where}: b_grads[{i}]"
            check_output_grad(plan, label, grad)
        check_grad_mode(where)


def check_grad_mode(where: str) -> None:
    """Raise :class:`~moe_overlap.ConfigError` unless autograd records (a training step):
    grad mode on, and not inside ``torch.inference_mode()`` (where ``torch.enable_grad()``
    turns grad mode on but nothing made there can be saved for backward)."""
    if torch.is_grad_enabled():
        if not torch.is_inference_mode_enabled():
            return
        raise ConfigError(
            f"{where}: expected autograd recording (the schedule runs forward and backward), "
            "received grad mode on inside torch.inference_mode() (torch.enable_grad() there "
            "records nothing: tensors made under inference mode cannot be saved for "
            "backward, and the step would fail in its first slot); call it outside "
            "torch.inference_mode()"
        )
    mode = "torch.inference_mode()" if torch.is_inference_mode_enabled() else "torch.no_grad()"
    raise ConfigError(
        f"{where}: expected autograd enabled (the schedule runs forward and backward), "
        f"received grad mode off ({mode}); call it outside {mode}, and evaluate with the "
        "model's own forward"
    )


def output_node(plan: ModelChunkSchedulePlan) -> ScheduleNode | None:
    """The node whose forward output is the chunk's (what ``b_grad`` is the gradient of):
    the post-process, else the last layer's last slot, else the pre-process."""
    if plan.post_process is not None:
        return plan.post_process
    if plan.layers:
        last = plan.layers[-1]
        if last.shape.has_mtp_post:
            slot = Slot.MTP_POST
        else:
            slot = Slot.COMBINE if last.shape.is_moe else Slot.MLP
        return last.nodes.get(slot)
    return plan.pre_process


def check_output_grad(plan: ChunkRun, where: str, grad: object) -> None:
    """Raise :class:`~moe_overlap.ConfigError` unless ``grad`` can be the gradient of the
    plan's forward output: a tensor of its shape, dtype and device (as
    ``output.backward(grad)`` needs; the autograd engine itself would broadcast a
    wrong-shaped one and sum it, silently)."""
    mb = plan.microbatch_index
    if not isinstance(grad, Tensor):
        raise ConfigError(
            f"{where}: expected the gradient of the backward plan's output (microbatch "
            f"{mb}) as a Tensor, received {type(grad).__name__}"
        )
    node = output_node(plan) if isinstance(plan, ModelChunkSchedulePlan) else None
    outputs = node.outputs if node is not None else ()
    if len(outputs) != 1:
        return  # not forwarded (or not through this plan): the run refuses it
    out = outputs[0]
    if grad.shape == out.shape and grad.dtype == out.dtype and grad.device == out.device:
        return
    raise ConfigError(
        f"{where}: expected the gradient of the backward plan's output (microbatch {mb}) "
        f"as a tensor of its shape {list(out.shape)}, dtype {_dtype(out)} on {out.device}, "
        f"received one of shape {list(grad.shape)}, dtype {_dtype(grad)} on {grad.device}; "
        "pass what output.backward(grad) takes, e.g. torch.ones_like(loss) (times a loss "
        "scale)"
    )


def _dtype(t: Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")
