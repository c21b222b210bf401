"""Negative cases: each marked line must be a type error, for mypy and for pyright.

Each expected error carries ``# type: ignore[<mypy code>]  # pyright: ignore[<rule>]``.
mypy's ``warn_unused_ignores`` and pyright's ``reportUnnecessaryTypeIgnoreComment`` make
both checkers fail when a marked line stops being an error (or fails for another rule).
Nothing here is run; see README.md.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor, nn
from torch.nn import Parameter

from moe_overlap import (
    ChunkState,
    LayerArgs,
    LayerState,
    Microbatch,
    ModelChunkSchedulePlan,
    PreprocessableModel,
    PreprocessOutput,
    SchedulableLayer,
    ScheduleOptions,
    SlotContext,
    StreamProvider,
    TransformerLayerNode,
    WgradLayer,
    WgradScope,
    combined_1f1b,
    get_comp_stream,
    should_free_input,
)
from moe_overlap.protocols import FreeInputConfig
from moe_overlap.steps import Step, StepObserver
from moe_overlap.streams import CpuEvent, CpuStream

from ._user_model import UserConfig, UserDecoder, UserLayer, UserModel

config = UserConfig()

# ---------------------------------------------------------------- models


class ReturnsTensor(UserModel):
    """``_preprocess`` returns the decoder input alone instead of the 6-tuple."""

    def _preprocess(  # type: ignore[override]  # pyright: ignore[reportIncompatibleMethodOverride]
        self,
        input_ids: Tensor | None,
        position_ids: Tensor | None,
        *,
        decoder_input: Tensor | None = None,
        packed_seq_params: object | None = None,
        padding_mask: Tensor | None = None,
    ) -> Tensor:
        return torch.ones(1)


class RenamedParameter(UserModel):
    """``_preprocess`` names its first parameter ``tokens``, not Megatron's ``input_ids``.

    Only pyright catches this: mypy does not compare the names of positional parameters.
    """

    def _preprocess(  # pyright: ignore[reportIncompatibleMethodOverride]
        self,
        tokens: Tensor | None,
        position_ids: Tensor | None,
        *,
        decoder_input: Tensor | None = None,
        packed_seq_params: object | None = None,
        padding_mask: Tensor | None = None,
    ) -> PreprocessOutput:
        return PreprocessOutput(torch.ones(1))


class NoPostprocess(nn.Module):
    """Everything but ``_postprocess``."""

    def __init__(self) -> None:
        super().__init__()
        self.pre_process = True
        self.post_process = True
        self.config = config
        self.decoder = UserDecoder([])

    def _preprocess(
        self, input_ids: Tensor | None, position_ids: Tensor | None, **kwargs: object
    ) -> tuple[Tensor, None, None, None, None, None]:
        return (torch.ones(1), None, None, None, None, None)


class NoDecoderInput(UserDecoder):
    """A decoder without ``input_tensor`` (pipeline stages hand activations through it)."""

    def __init__(self) -> None:
        super().__init__([])
        del self.input_tensor


class IntFlagModel(NoPostprocess):
    """``pre_process`` is an int, not a bool."""

    def __init__(self) -> None:
        super().__init__()
        self.pre_process: int = 1  # type: ignore[assignment]

    def _postprocess(self, hidden_states: Tensor, *args: object, **kwargs: object) -> Tensor:
        return hidden_states


returns_tensor: PreprocessableModel = ReturnsTensor(config)  # type: ignore[assignment]  # pyright: ignore[reportAssignmentType]
renamed: PreprocessableModel = RenamedParameter(config)  # pyright: ignore[reportAssignmentType]
no_post: PreprocessableModel = NoPostprocess()  # type: ignore[assignment]  # pyright: ignore[reportAssignmentType]
int_flag: PreprocessableModel = IntFlagModel()  # type: ignore[assignment]  # pyright: ignore[reportAssignmentType]

# ---------------------------------------------------------------- layers


class MissingCombine(nn.Module):
    """A layer without ``slot_combine``."""

    def __init__(self) -> None:
        super().__init__()
        self.config = config
        self.is_moe = True
        self.num_local_experts: int | None = 2

    def slot_pre_dispatch(self, node: SlotContext, inputs: tuple[Tensor, ...], /) -> Tensor:
        return inputs[0]

    def slot_dispatch(self, node: SlotContext, inputs: tuple[Tensor, ...], /) -> Tensor:
        return inputs[0]

    def slot_mlp(self, node: SlotContext, inputs: tuple[Tensor, ...], /) -> Tensor:
        return inputs[0]

    def pre_dispatch_wgrad(self) -> Sequence[WgradScope]:
        return []

    def mlp_wgrad(self) -> Sequence[WgradLayer]:
        return []


class SlotWithoutNode(UserLayer):
    """``slot_mlp`` takes only the inputs, not the node that runs it."""

    def slot_mlp(self, inputs: tuple[Tensor, ...], /) -> Tensor:  # type: ignore[override]  # pyright: ignore[reportIncompatibleMethodOverride]
        return inputs[0]


class SlotReturnsList(UserLayer):
    """``slot_dispatch`` returns a list; slots return a tensor or a tuple of tensors."""

    def slot_dispatch(  # type: ignore[override]  # pyright: ignore[reportIncompatibleMethodOverride]
        self, node: SlotContext, inputs: tuple[Tensor, ...], /
    ) -> list[Tensor]:
        return list(inputs)


class MlpWgradNotModules(UserLayer):
    """``mlp_wgrad`` returns bare callables instead of ``WgradLayer`` modules."""

    def mlp_wgrad(self) -> Sequence[object]:  # type: ignore[override]  # pyright: ignore[reportIncompatibleMethodOverride]
        return [self.expert.backward_dw]


missing_combine: SchedulableLayer = MissingCombine()  # type: ignore[assignment]  # pyright: ignore[reportAssignmentType]
slot_without_node: SchedulableLayer = SlotWithoutNode(config)  # type: ignore[assignment]  # pyright: ignore[reportAssignmentType]
slot_list: SchedulableLayer = SlotReturnsList(config)  # type: ignore[assignment]  # pyright: ignore[reportAssignmentType]
wgrad_callables: SchedulableLayer = MlpWgradNotModules(config)  # type: ignore[assignment]  # pyright: ignore[reportAssignmentType]

# ---------------------------------------------------------------- wgrad modules


class NoBackwardDw(nn.Linear):
    """A plain linear layer: its weight gradient is never delayed."""


class BackwardDwTakesArg:
    """``backward_dw`` must take no argument (Megatron's MoE one takes flags: wrap it)."""

    def backward_dw(self, routed_experts: bool) -> None:
        pass

    def parameters(self) -> Iterator[Parameter]:
        return iter(())


class NoParameters:
    """``parameters`` is needed to collect the post-wgrad hooks."""

    def backward_dw(self) -> None:
        pass


no_dw: WgradLayer = NoBackwardDw(2, 2)  # type: ignore[assignment]  # pyright: ignore[reportAssignmentType]
dw_arg: WgradLayer = BackwardDwTakesArg()  # type: ignore[assignment]  # pyright: ignore[reportAssignmentType]
no_params: WgradLayer = NoParameters()  # type: ignore[assignment]  # pyright: ignore[reportAssignmentType]
scope = WgradScope("attn", NoBackwardDw(2, 2))  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]

# ---------------------------------------------------------------- streams


def stream_for(device: str) -> CpuStream:
    return CpuStream(device)


def stream_name() -> str:
    return "comm"


takes_arg: StreamProvider = stream_for  # type: ignore[assignment]  # pyright: ignore[reportAssignmentType]
not_a_stream: StreamProvider = stream_name  # type: ignore[assignment]  # pyright: ignore[reportAssignmentType]
a_stream_not_a_provider: StreamProvider = CpuStream("comp")  # type: ignore[assignment]  # pyright: ignore[reportAssignmentType]

# ---------------------------------------------------------------- extra_args and values


def node(extra_args: object) -> None:
    TransformerLayerNode(
        get_comp_stream,
        CpuEvent(),
        LayerState(),
        ChunkState(Microbatch()),
        UserLayer(config).slot_mlp,
        name="mlp",
        extra_args=[("config", config)],  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    )
    TransformerLayerNode(
        get_comp_stream,
        CpuEvent(),
        LayerState(),
        ChunkState(Microbatch()),
        UserLayer(config).pre_dispatch_wgrad,  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    )


bad_flag = LayerArgs(config=config, is_moe="yes")  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
no_config = LayerArgs(is_moe=True)  # type: ignore[call-arg]  # pyright: ignore[reportCallIssue]
args = LayerArgs(config=config)
args.is_moe = True  # type: ignore[misc]  # pyright: ignore[reportAttributeAccessIssue]
options = ScheduleOptions()
options.free_input = False  # type: ignore[misc]  # pyright: ignore[reportAttributeAccessIssue]
all_to_all = ScheduleOptions(recompute=("dispatch",))  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
typo = ChunkState(Microbatch(input_id=None))  # type: ignore[call-arg]  # pyright: ignore[reportCallIssue]
no_microbatch = ChunkState()  # type: ignore[call-arg]  # pyright: ignore[reportCallIssue]
ChunkState(Microbatch()).attention_mask = None  # type: ignore[misc]  # pyright: ignore[reportAttributeAccessIssue]
old_plan = ModelChunkSchedulePlan(UserModel(config), None, None, None)  # type: ignore[call-arg, arg-type]  # pyright: ignore[reportCallIssue]
LayerState().router_logits = torch.ones(1)  # type: ignore[attr-defined]  # pyright: ignore[reportAttributeAccessIssue]


class NoDispatcherConfig:
    """A config without ``moe_token_dispatcher_type`` and the rest."""

    mtp_num_layers: int | None = None


bad_config: FreeInputConfig = NoDispatcherConfig()  # type: ignore[assignment]  # pyright: ignore[reportAssignmentType]
free = should_free_input("mlp", True, NoDispatcherConfig(), 2)  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
losses = combined_1f1b(UserModel(config), [{"input_ids": torch.ones(1)}])  # type: ignore[list-item]  # pyright: ignore[reportArgumentType]


class TimerTakesNoStream:
    """A timer whose ``start`` / ``stop`` ignore the node's stream."""

    def start(self) -> None: ...
    def stop(self) -> None: ...


class ObserverOfStrings:
    """An observer expecting the step's string form."""

    def timer(self, step: str, microbatch: int | None) -> None: ...


class ObserverReturningBadTimer:
    def timer(self, step: Step, microbatch: int | None) -> TimerTakesNoStream:
        return TimerTakesNoStream()


def on_plan_style(step: Step) -> None: ...


str_steps: StepObserver = ObserverOfStrings()  # type: ignore[assignment]  # pyright: ignore[reportAssignmentType]
bad_timer: StepObserver = ObserverReturningBadTimer()  # type: ignore[assignment]  # pyright: ignore[reportAssignmentType]
observer_fn = combined_1f1b(UserModel(config), [], observer=on_plan_style)  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
