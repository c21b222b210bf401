"""Positive cases: a user's model, layer, wgrad module and streams satisfy the Protocols.

Each assignment to a Protocol-typed name is the assertion; nothing here is run.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe_overlap import (
    ChunkState,
    LayerArgs,
    LayerState,
    Microbatch,
    ModelChunkSchedulePlan,
    MtpSchedulableLayer,
    PreprocessableModel,
    PreprocessOutput,
    SchedulableLayer,
    ScheduleOptions,
    SlotContext,
    StreamPair,
    StreamProvider,
    TransformerLayerNode,
    WgradLayer,
    combined_1f1b,
    get_comm_stream,
    get_comp_stream,
    make_streams,
    should_free_input,
)
from moe_overlap.inputs import DeclaresInputs, ValidatesInputs, check_inputs
from moe_overlap.megatron import build_schedule_plan
from moe_overlap.models import GPTMoEConfig, GPTMoEModel, GPTMoEStage
from moe_overlap.protocols import FreeInputConfig
from moe_overlap.steps import NodeTimer, Slot, Step, StepObserver, StreamKind
from moe_overlap.streams import CpuEvent, CpuStream
from moe_overlap.timeline import Timeline

from ._user_model import (
    DelayedLinear,
    ShortUserModel,
    UserConfig,
    UserLayer,
    UserModel,
    UserWgrad,
)

config = UserConfig()

# Models: the full spelling and the **kwargs spelling.
model: PreprocessableModel = UserModel(config)
short_model: PreprocessableModel = ShortUserModel(config)

# The optional input declaration (a class attribute) and the reference model's check.
declares: DeclaresInputs = UserModel(config)
reference = GPTMoEModel(GPTMoEConfig())
reference_model: PreprocessableModel = reference
reference_declares: DeclaresInputs = reference
reference_validates: ValidatesInputs = reference
stage_validates: ValidatesInputs = GPTMoEStage(reference, range(0, 1))
check_inputs(reference, ChunkState(Microbatch()), where="typing")
check_inputs(reference, {"attention_mask": None}, what="stage keyword")

# Layers, wgrad modules, configs.
layer: SchedulableLayer = UserLayer(config)
wgrad_module: WgradLayer = DelayedLinear(8, 8)
wgrad_plain: WgradLayer = UserWgrad(torch.nn.Parameter(torch.ones(2)))
free_config: FreeInputConfig = config
frees: bool = should_free_input("mlp", True, config, 2)

# Stream providers: module functions, bound methods, lambdas.
streams: StreamPair = make_streams("cpu")
provider_fn: StreamProvider = get_comp_stream
provider_comm: StreamProvider = get_comm_stream
provider_method: StreamProvider = streams.comm_provider
provider_lambda: StreamProvider = lambda: CpuStream("comp")  # noqa: E731

# extra_args: the typed value, or a Megatron-style mapping.
node_typed = TransformerLayerNode(
    provider_fn,
    CpuEvent(),
    LayerState(),
    ChunkState(Microbatch()),
    UserLayer(config).slot_mlp,
    name="mlp",
    bwd_dw_callables=[DelayedLinear(8, 8)],
    extra_args=LayerArgs(config=config, is_moe=True, num_local_experts=2),
)
node_mapping = TransformerLayerNode(
    provider_method,
    CpuEvent(),
    LayerState(),
    ChunkState(Microbatch()),
    UserLayer(config).slot_mlp,
    name="mlp",
    bwd_dw_callables=DelayedLinear(8, 8),
    extra_args={"config": config, "is_moe": True, "num_local_experts": 2},
)

# Slots take a SlotContext: the node is one.
context: SlotContext = node_typed

# The preprocess 6-tuple is a NamedTuple with defaults; a plain tuple is also accepted.
out = PreprocessOutput(torch.ones(2))
decoder_input: Tensor = out.decoder_input
offset: Tensor | int | None = out.sequence_len_offset

# The driver and the chunk plan.
losses: list[Tensor] = combined_1f1b(
    UserModel(config),
    [Microbatch(input_ids=torch.zeros(2, 4, dtype=torch.long), labels=torch.zeros(2, 4))],
    options=ScheduleOptions(delay_wgrad_compute=True),
    streams=streams,
)
recomputed = ScheduleOptions(recompute=("pre_dispatch", Slot.MLP))
slots: tuple[Slot | str, ...] = recomputed.recompute
plan = ModelChunkSchedulePlan(UserModel(config), Microbatch(), streams=streams, index=0)
megatron_plan: ModelChunkSchedulePlan = build_schedule_plan(
    UserModel(config), None, None, None, streams=streams
)
chunk_out: Tensor | None = ModelChunkSchedulePlan.run(plan, None)


# Step observers: the Timeline, and a user's observer that times some steps only.
class WallTimer:
    def start(self, stream: torch.cuda.Stream | CpuStream) -> None: ...
    def stop(self, stream: torch.cuda.Stream | CpuStream) -> None: ...


class CommOnly:
    def timer(self, step: Step, microbatch: int | None) -> WallTimer | None:
        return WallTimer() if step.stream is StreamKind.COMM else None


timeline_observer: StepObserver = Timeline()
user_observer: StepObserver = CommOnly()
user_timer: NodeTimer = WallTimer()
observed: list[Tensor] = combined_1f1b(UserModel(config), [], observer=CommOnly())
observed_run: Tensor | None = ModelChunkSchedulePlan.run(plan, None, observer=Timeline())


def narrows(value: object) -> None:
    """The Protocols are runtime-checkable, so ``isinstance`` narrows."""
    if isinstance(value, MtpSchedulableLayer):
        _mtp: SchedulableLayer = value
    if isinstance(value, PreprocessableModel):
        _checked: PreprocessableModel = value
