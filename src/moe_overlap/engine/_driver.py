"""The microbatch driver: combined 1F1B over N microbatches of one model chunk."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, cast

import torch
from torch import Tensor

from ._args import (
    ANY,
    BOOL,
    CALLABLE,
    TENSOR,
    Instance,
    Opt,
    Real,
    Spec,
    check_arg,
    check_fields,
)
from ._bypass_check import check_bypassed
from ._chunk_plan import ModelChunkSchedulePlan, check_grad_mode, run_pair
from ._conformance import check_model, checks_memoized
from ._contracts import OPT_STEP_OBSERVER
from ._debug import DEBUG
from ._errors import ConfigError, IntegrationError
from ._inputs import check_inputs
from ._options import ScheduleOptions
from ._plain_check import check_first_step
from ._protocols import PreprocessableModel, StepObserver
from ._state import ChunkState
from ._streams import StreamPair
from ._wgrad_check import check_wgrad_done, declared_wgrad

__all__ = ["Microbatch", "combined_1f1b"]

_DEFAULT_OPTIONS = ScheduleOptions()


@dataclass(frozen=True, slots=True, kw_only=True)
class Microbatch:
    """One microbatch's inputs, by the names of Megatron-Core's ``build_schedule_plan``.

    ``B`` batch, ``S`` sequence. A field is *set* when it is not ``None``. Each model reads
    the fields it declares in ``microbatch_inputs`` (:class:`~moe_overlap.DeclaresInputs`;
    :data:`~moe_overlap.DEFAULT_INPUTS` without a declaration): a set field it does not
    read is a :class:`~moe_overlap.ConfigError` naming the field and the model when the
    plan is built (:func:`~moe_overlap.check_inputs`), never silently ignored. What a field
    means is the model's; Megatron-Core's conventions, which the reference model
    (:mod:`moe_overlap.models`) follows and checks (dtype and shape, ``ConfigError``
    naming the field), are:

    Attributes:
        input_ids: token ids ``[B, S]`` (int64); the first pipeline stage's input.
        position_ids: positions ``[B, S]`` (int64); ``None``: ``0 .. S-1`` per row.
        attention_mask: bool ``[B or 1, 1, S or 1, S]``, ``True`` where a query (dim 2)
            must not attend a key (dim 3); applied on top of the causal mask. The
            transformers adapter takes transformers' own instead (``[B, S]``, ``1`` at
            tokens to attend).
        labels: target ids ``[B, S]`` (int64); with them ``_postprocess`` returns the loss.
        loss_mask: ``[B, S]`` weights of each position in the language-model loss (float
            or bool; ``0`` drops a position); ``None``: every position counts.
        decoder_input: the first layer's input ``[B, S, D]``, instead of embedding
            ``input_ids``.
        padding_mask: bool ``[B, S]``, ``True`` at padding tokens. The reference model
            keeps them out of attention (as keys) and of the router's aux loss; they are
            routed like any token. The loss is still ``loss_mask``'s: with ``labels``, a
            ``padding_mask`` needs a ``loss_mask`` (``0`` at padding).
        packed_seq_params: Megatron-Core's ``PackedSeqParams`` (no shipped model reads it).
        extra_block_kwargs: keywords for the decoder block (an empty mapping is unset).
        runtime_gather_output: Megatron-Core's output gather flag.
    """

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

    def __post_init__(self) -> None:
        check_fields(self, _MICROBATCH)


_TENSOR = Opt(TENSOR)
_MICROBATCH: dict[str, Spec[object]] = {
    "input_ids": _TENSOR,
    "position_ids": _TENSOR,
    "attention_mask": _TENSOR,
    "labels": _TENSOR,
    "loss_mask": _TENSOR,
    "decoder_input": _TENSOR,
    "padding_mask": _TENSOR,
    "packed_seq_params": ANY,
    "extra_block_kwargs": Opt(Instance(Mapping, "a mapping")),
    "runtime_gather_output": Opt(BOOL),
}

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
) -> list[Tensor]:
    """Run forward and backward of every microbatch; return the (detached, fp32) losses.

    With ``overlap`` (combined 1F1B)::

        F0 | F1+B0 | F2+B1 | ... | F(N-1)+B(N-2) | B(N-1)

    each ``Fi+Bj`` a :meth:`ModelChunkSchedulePlan.run` interleaving microbatch ``i``'s
    forward with ``j``'s backward. Without it, ``F0 B0 F1 B1 ...`` through the same nodes.
    With ``fill_drain`` (and at least two microbatches) the first two forwards and the
    last two backwards are overlapped with each other too (:func:`run_pair`)::

        F0+F1 | F2+B0 | F3+B1 | ... | F(N-1)+B(N-3) | B(N-2)+B(N-1)

    keeping one more microbatch's activations alive throughout.
    Either way the losses and the gradients accumulated into the parameters are those of
    ``(loss_i * loss_scale).backward()`` per microbatch, in order.

    ``on_plan`` is called with each plan right after it is built (FSDP reshard hooks).
    ``observer`` (a :class:`~moe_overlap.StepObserver`, e.g. a
    :class:`~moe_overlap.timeline.Timeline`) is asked for a timer for every node step of
    every :meth:`ModelChunkSchedulePlan.run`. Delayed weight gradients are all computed by
    the time this returns: modules that count them (:class:`~moe_overlap.PendingWgrad`)
    are checked to owe none before and after the step (:class:`~moe_overlap.WgradError`).

    The arguments are checked once per call (:class:`~moe_overlap.ConfigError`):
    ``microbatches`` a non-empty sequence of :class:`Microbatch` (not a generator),
    ``overlap`` a bool, ``loss_scale`` a finite int or float, autograd enabled (not under
    ``torch.no_grad()`` / ``torch.inference_mode()``).

    If a node fails, :class:`~moe_overlap.ScheduleError` says where; streams are
    synchronized and every plan released, so the model can run the next step. The
    gradients the failed step had accumulated are partial: zero them (and drop any weight
    gradients a delayed-wgrad model still holds) before that next step, as after an
    overflowed mixed-precision step.
    """
    check_bypassed(model)  # before the Protocol checks: a wrapper's message wins
    with checks_memoized():  # the model and its layers are checked once, not per plan
        model = check_model(model)
        _check_arguments(microbatches, overlap, options, streams, loss_scale, on_plan, observer)
        _check_fill_drain(fill_drain, overlap)
        _check_inputs(model, microbatches)
        check_grad_mode("combined_1f1b")
        declared = declared_wgrad(model)
        check_wgrad_done(
            model, when="before the step (left from an earlier one)", declared=declared
        )
        if DEBUG:  # the model's first step: its schedule and its plain forward agree
            first = [microbatches[0]]
            check_first_step(
                model,
                microbatches[0],
                lambda: _run(model, first, overlap, options, streams, loss_scale, None, None),
                loss_scale,
            )
        losses = _run(
            model,
            microbatches,
            overlap,
            options,
            streams,
            loss_scale,
            on_plan,
            observer,
            fill_drain=fill_drain,
        )
    check_wgrad_done(model, when="when combined_1f1b returns", declared=declared)
    return [loss.detach() for loss in losses]


def _run(
    model: PreprocessableModel,
    microbatches: Sequence[Microbatch],
    overlap: bool,
    options: ScheduleOptions,
    streams: StreamPair | None,
    loss_scale: float,
    on_plan: PlanCallback | None,
    observer: StepObserver | None,
    *,
    fill_drain: bool = False,
) -> list[Tensor]:
    """The schedule itself: build, run and release the plans; the losses, in order."""

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

    def grad_of(plan: ModelChunkSchedulePlan) -> Tensor:
        assert plan.microbatch is not None
        return torch.full_like(losses[plan.microbatch], loss_scale)

    def forward(f: ModelChunkSchedulePlan | None, b: ModelChunkSchedulePlan | None) -> None:
        grad = grad_of(b) if b is not None else None
        out = ModelChunkSchedulePlan.run(f, b, b_grad=grad, observer=observer)
        if b is not None:
            live.remove(b)
        if f is not None:
            losses.append(_check_loss(model, out))

    try:
        if overlap and fill_drain and len(microbatches) >= 2:
            live += [build(0), build(1)]
            first, second = run_pair(live[0], live[1], observer=observer)
            losses += [_check_loss(model, first), _check_loss(model, second)]
            for i in range(2, len(microbatches)):
                oldest = live[0]
                live.append(build(i))
                forward(live[-1], oldest)
            b1, b2 = live
            run_pair(b1, b2, b_grads=(grad_of(b1), grad_of(b2)), observer=observer)
            live.clear()
        elif overlap:
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
    return losses


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


def _check_inputs(model: PreprocessableModel, microbatches: Sequence[Microbatch]) -> None:
    """Every microbatch's inputs, before the first plan: an input the model does not read
    (or its own ``validate_inputs`` refuses) fails here, not after earlier microbatches
    accumulated gradients."""
    for i, mb in enumerate(microbatches):
        state = ChunkState(**{f.name: getattr(mb, f.name) for f in fields(mb)})
        check_inputs(
            model, state, where=f"combined_1f1b: microbatches[{i}]", what="Microbatch field"
        )


def _check_fill_drain(fill_drain: object, overlap: object) -> None:
    check_arg("combined_1f1b", "fill_drain", fill_drain, BOOL)
    if fill_drain and not overlap:
        raise ConfigError(
            "combined_1f1b: fill_drain overlaps the first two forwards and the last two "
            "backwards of the overlapped schedule; expected overlap=True with it, received "
            "overlap=False"
        )


def _check_loss(model: PreprocessableModel, out: Tensor | None) -> Tensor:
    if out is None or out.numel() != 1:
        got = "nothing" if out is None else f"a tensor of shape {tuple(out.shape)}"
        raise IntegrationError(
            f"combined_1f1b: {type(model).__name__}._postprocess must return a scalar loss "
            f"(model.post_process true, labels given), received {got}"
        )
    return out
