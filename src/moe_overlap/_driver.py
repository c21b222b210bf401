"""The microbatch driver: combined 1F1B over N microbatches of one model chunk."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ._chunk_plan import ModelChunkSchedulePlan
from ._conformance import check_model
from ._errors import ConfigError, IntegrationError
from ._options import ScheduleOptions
from ._protocols import PreprocessableModel, StepObserver
from ._streams import StreamPair

__all__ = ["Microbatch", "combined_1f1b"]

_DEFAULT_OPTIONS = ScheduleOptions()


@dataclass(frozen=True, slots=True, kw_only=True)
class Microbatch:
    """One microbatch's inputs, by the names of Megatron-Core's ``build_schedule_plan``."""

    input_ids: Tensor | None = None
    position_ids: Tensor | None = None
    attention_mask: Tensor | None = None
    labels: Tensor | None = None
    loss_mask: Tensor | None = None
    decoder_input: Tensor | None = None
    padding_mask: Tensor | None = None
    packed_seq_params: Any = None
    extra_block_kwargs: Mapping[str, object] | None = None
    runtime_gather_output: bool | None = None


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
) -> list[Tensor]:
    """Run forward and backward of every microbatch; return the (detached, fp32) losses.

    With ``overlap`` (combined 1F1B)::

        F0 | F1+B0 | F2+B1 | ... | F(N-1)+B(N-2) | B(N-1)

    each ``Fi+Bj`` a :meth:`ModelChunkSchedulePlan.run` interleaving microbatch ``i``'s
    forward with ``j``'s backward. Without it, ``F0 B0 F1 B1 ...`` through the same nodes.
    Either way the losses and the gradients accumulated into the parameters are those of
    ``(loss_i * loss_scale).backward()`` per microbatch, in order.

    ``on_plan`` is called with each plan right after it is built (FSDP reshard hooks).
    ``observer`` (a :class:`~moe_overlap.StepObserver`, e.g. a
    :class:`~moe_overlap.timeline.Timeline`) is asked for a timer for every node step of
    every :meth:`ModelChunkSchedulePlan.run`. Delayed weight gradients are all computed by
    the time this returns.

    If a node fails, :class:`~moe_overlap.ScheduleError` says where; streams are
    synchronized and every plan released, so the model can run the next step. The
    gradients the failed step had accumulated are partial: zero them (and drop any weight
    gradients a delayed-wgrad model still holds) before that next step, as after an
    overflowed mixed-precision step.
    """
    model = check_model(model)
    if len(microbatches) == 0:
        raise ConfigError("combined_1f1b: expected at least one microbatch, received none")
    for i, mb in enumerate(microbatches):
        if not isinstance(mb, Microbatch):  # pyright: ignore[reportUnnecessaryIsInstance]
            raise ConfigError(
                f"combined_1f1b: microbatches[{i}] must be a Microbatch, "
                f"received {type(mb).__name__}"
            )

    def build(i: int) -> ModelChunkSchedulePlan:
        mb = microbatches[i]
        plan = ModelChunkSchedulePlan(
            model,
            mb.input_ids,
            mb.position_ids,
            mb.attention_mask,
            decoder_input=mb.decoder_input,
            labels=mb.labels,
            packed_seq_params=mb.packed_seq_params,
            extra_block_kwargs=mb.extra_block_kwargs,
            runtime_gather_output=mb.runtime_gather_output,
            loss_mask=mb.loss_mask,
            padding_mask=mb.padding_mask,
            streams=streams,
            options=options,
            microbatch=i,
        )
        if on_plan is not None:
            on_plan(plan)
        return plan

    losses: list[Tensor] = []
    live: list[ModelChunkSchedulePlan] = []

    def forward(f: ModelChunkSchedulePlan | None, b: ModelChunkSchedulePlan | None) -> None:
        grad = torch.full_like(losses[-1], loss_scale) if b is not None else None
        out = ModelChunkSchedulePlan.run(f, b, b_grad=grad, observer=observer)
        if b is not None:
            live.remove(b)
        if f is not None:
            losses.append(_check_loss(model, out))

    try:
        if overlap:
            live.append(build(0))
            forward(live[-1], None)
            for i in range(1, len(microbatches)):
                prev = live[-1]
                live.append(build(i))
                forward(live[-1], prev)
            forward(None, live[-1])
        else:
            for i in range(len(microbatches)):
                live.append(build(i))
                forward(live[-1], None)
                forward(None, live[-1])
    finally:
        for plan in live:
            if not plan.released:
                plan.release_state()
    return [loss.detach() for loss in losses]


def _check_loss(model: PreprocessableModel, out: Tensor | None) -> Tensor:
    if out is None or out.numel() != 1:
        got = "nothing" if out is None else f"a tensor of shape {tuple(out.shape)}"
        raise IntegrationError(
            f"combined_1f1b: {type(model).__name__}._postprocess must return a scalar loss "
            f"(model.post_process true, labels given), received {got}"
        )
    return out
