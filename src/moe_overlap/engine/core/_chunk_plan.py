"""A model chunk of one microbatch: pre-process, layer plans, post-process; and its run."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import Tensor

from moe_overlap.errors import PlanReleasedError, StreamError
from moe_overlap.microbatch import Microbatch
from moe_overlap.protocols import PreprocessableModel, SchedulableLayer, StepObserver

from ._hooks import on_inputs_read, on_plan_built, on_plan_started
from ._layer_node import refresh_collectives
from ._layer_plan import TransformerLayerSchedulePlan
from ._node import ScheduleNode
from ._options import ChunkHooks, PostBackwardHook, PostForwardHook, PreHook, ScheduleOptions
from ._process_nodes import PostProcessNode, PreProcessNode
from ._runner import run_step
from ._state import ChunkState
from ._steps import (
    ChunkShape,
    Slot,
    Step,
)
from ._streams import (
    CpuStream,
    StreamPair,
    cpu_default_stream,
    current_stream,
    device_streams,
    new_event,
    record_event,
    record_tensor_on,
    wait_event,
)

__all__ = ["ModelChunkSchedulePlan", "default_streams", "device_of"]

_DEFAULT_OPTIONS = ScheduleOptions()
_EMPTY_MICROBATCH = Microbatch()
"""A microbatch with no input set (what a released plan keeps)."""
_CPU_STREAMS = StreamPair(comp=cpu_default_stream(), comm=CpuStream("comm"))


def default_streams(device: torch.device) -> StreamPair:
    """CPU no-op streams on CPU; the device's default streams (see ``set_streams``) on CUDA."""
    if device.type == "cpu":
        return _CPU_STREAMS
    if device.type != "cuda":
        raise StreamError(
            f"schedule: expected a cpu or cuda device, received {device} (the device of "
            "the microbatch's input_ids, else decoder_input, else labels); put the model and "
            "its inputs on 'cpu' or 'cuda' (a model built on 'meta': materialize it first "
            "with model.to_empty(device=...) and load or initialize its weights, then pass "
            "real tensors)"
        )
    return device_streams(device)


def device_of(mb: Microbatch) -> torch.device:
    """The device of the chunk's input (token ids, else hidden states, else labels)."""
    for t in (mb.input_ids, mb.decoder_input, mb.labels):
        if t is not None:
            return t.device
    return torch.device("cpu")


class ModelChunkSchedulePlan:
    """The nodes of one model chunk for one microbatch; ``run`` schedules two chunks.

    Every node of the chunk shares one event, so one microbatch's nodes run in order
    whichever stream they are on; two microbatches' nodes interleave freely. Megatron-Core's
    positional form (``build_schedule_plan(model, input_ids, position_ids, ...)``) is
    :func:`moe_overlap.megatron.build_schedule_plan`.

    An input the model does not read (:func:`~moe_overlap.inputs.check_inputs`: not in its
    ``microbatch_inputs``) is a :class:`~moe_overlap.ConfigError` here, before any node.

    Args:
        model: the model chunk; checked once here, member by member.
        microbatch: the microbatch's inputs (:class:`~moe_overlap.Microbatch`).
        options: :class:`~moe_overlap.ScheduleOptions`.
        streams: compute/comm streams; by default those of the inputs' device: CPU no-op
            streams for CPU inputs, the device's default streams (:func:`~moe_overlap.set_streams`)
            on CUDA. A CUDA stream for CPU inputs (or the reverse) is a
            :class:`~moe_overlap.StreamError`.
        index: the microbatch number shown in error messages and timelines (kept as
            ``microbatch_index``).
        vp_stage: virtual-pipeline stage passed to the p2p hooks.
        float32_output: return a half-precision post-process result (the loss) in float32;
            off, in the model's dtype (a pipeline stage's output for the schedule's loss).
        output_processor, output_processor_context: passed to ``_postprocess``.
    """

    def __init__(
        self,
        model: PreprocessableModel,
        microbatch: Microbatch,
        *,
        options: ScheduleOptions = _DEFAULT_OPTIONS,
        streams: StreamPair | None = None,
        index: int | None = None,
        vp_stage: int | None = None,
        float32_output: bool = True,
        output_processor: Callable[..., object] | None = None,
        output_processor_context: object | None = None,
    ) -> None:
        where = f"ModelChunkSchedulePlan (microbatch {index})"
        for guard in on_plan_started:  # the model, the microbatch (moe_overlap.engine._guards)
            guard.plan_started(model, microbatch, where)
        state = ChunkState(
            microbatch,
            output_processor=output_processor,
            output_processor_context=output_processor_context,
        )
        device = device_of(microbatch)
        if streams is None:
            streams = default_streams(device)
        elif (device.type == "cpu") != isinstance(streams.comp, CpuStream):
            raise StreamError(
                f"ModelChunkSchedulePlan: inputs are on {device} but the streams are "
                f"{streams.comp!r} / {streams.comm!r}; pass streams for the inputs' device"
            )
        self.streams = streams
        self.options = options
        self.microbatch_index = index
        """The microbatch number shown in errors and timelines (``index``)."""
        self.vp_stage = vp_stage
        self.event = new_event(streams.device)
        self.state = state
        for guard in on_inputs_read:  # the fields the model reads
            guard.inputs_read(model, microbatch, state, where)
        refresh_collectives()
        self.pre_process: PreProcessNode | None = PreProcessNode(
            model, self.state, self.event, streams.comp_provider
        )
        layers = model.decoder.layers
        n = len(layers)
        owner = type(model).__name__
        self.layers: list[TransformerLayerSchedulePlan] = [
            TransformerLayerSchedulePlan(
                cast(SchedulableLayer, layer),  # checked there, named after ``owner``
                event=self.event,
                chunk_state=state,
                streams=streams,
                options=options,
                index=i,
                is_first_layer=i == 0,
                is_last_layer=i == n - 1,
                owner=owner,
                microbatch_index=index,
            )
            for i, layer in enumerate(layers)
        ]
        try:
            self.post_process: PostProcessNode | None = (
                PostProcessNode(
                    model,
                    self.state,
                    self.event,
                    streams.comp_provider,
                    float32_output=float32_output,
                )
                if model.post_process
                else None
            )
            self.shape = ChunkShape(
                layers=tuple(lp.shape for lp in self.layers),
                has_post_process=self.post_process is not None,
            )
            self.released = False
            for guard in on_plan_built:  # delayed-wgrad modules, FSDP units, node names
                guard.plan_built(model, self)
        except BaseException:
            for lp in self.layers:  # refused: the layer plans' claims end here
                lp.release_state()
            raise

    def num_layers(self) -> int:
        return len(self.layers)

    def get_layer(self, i: int) -> TransformerLayerSchedulePlan:
        return self.layers[i]

    def node_for(self, step: Step) -> ScheduleNode:
        """The node behind ``step``: a layer slot, the pre-process or the post-process."""
        if self.released:
            raise PlanReleasedError(
                f"chunk plan of microbatch {self.microbatch_index}: used after release_state "
                f"(step {step}); build a new plan for every microbatch"
            )
        if step.layer is not None:
            return self.layers[step.layer].node_for(step)
        node = self.pre_process if step.slot is Slot.PRE_PROCESS else self.post_process
        assert node is not None, f"step {step} has no node in this chunk"
        return node

    def record_current_stream(self) -> None:
        """Make this chunk's next node wait for the work queued so far on the current stream."""
        record_event(self.event, current_stream(self.streams.comp))

    def wait_current_stream(self) -> None:
        """Make the current stream wait for this chunk's last node."""
        wait_event(self.event, current_stream(self.streams.comp))

    def hand_to_caller(self, output: Tensor | None) -> None:
        """``output`` (made on the schedule's streams) goes to the caller: when the caller
        runs on another stream, its memory waits for that stream's use before reuse."""
        if output is None:
            return
        caller = current_stream(self.streams.comp)
        if caller != self.streams.comp:
            record_tensor_on(output, caller)

    def release_state(self) -> None:
        """Drop every node, layer plan and the chunk state's model reference."""
        for lp in self.layers:
            lp.release_state()
        for node in (self.pre_process, self.post_process):
            if node is not None:
                node.release_state()
        self.layers = []
        self.pre_process = None
        self.post_process = None
        self.state = ChunkState(_EMPTY_MICROBATCH)
        self.released = True

    @staticmethod
    def run(
        f_schedule_plan: ModelChunkSchedulePlan | None,
        b_schedule_plan: ModelChunkSchedulePlan | None,
        b_grad: Tensor | None = None,
        pre_forward: PreHook | None = None,
        pre_backward: PreHook | None = None,
        post_forward: PostForwardHook | None = None,
        post_backward: PostBackwardHook | None = None,
        *,
        observer: StepObserver | None = None,
    ) -> Tensor | None:
        """Forward ``f_schedule_plan`` overlapped with backward of ``b_schedule_plan``.

        Phases (see :func:`~moe_overlap.steps.chunk_steps`):

        1. f pre-process forward; 2. b post-process backward (from ``b_grad``);
        3. forward layer ``i`` paired with backward layer ``n-1-i``; 4. leftover layers;
        5. p2p hooks; 6. b's first-layer delayed wgrad; 7. f post-process forward, b
        pre-process backward.

        Returns f's output (the loss when f has a post-process), ``None`` without f. The
        b plan is released at the end; on failure both are, after synchronizing streams.
        ``observer`` (a :class:`~moe_overlap.steps.StepObserver`) is asked for a timer for every
        non-hook step, in order. One :func:`run_step` of the runner.
        """
        f, b = f_schedule_plan, b_schedule_plan
        hooks = ChunkHooks(
            pre_forward=pre_forward,
            pre_backward=pre_backward,
            post_forward=post_forward,
            post_backward=post_backward,
        )
        outputs = run_step(
            [f] if f is not None else [],
            [b] if b is not None else [],
            [b_grad] if b_grad is not None or b is not None else [],
            where="ModelChunkSchedulePlan.run",
            hooks=hooks,
            observer=observer,
        )
        return outputs[0] if outputs else None
