"""Megatron-Core's call forms converted to the engine's shapes: the implementation of
:mod:`moe_overlap.megatron` (documented there). In the engine's floor, so that
:class:`~moe_overlap.TransformerLayerNode` takes an ``extra_args`` mapping without importing
upward; the two plan builders import their plan when called."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from torch import Tensor

from ._args import BOOL, POSITIVE, Opt, check_arg
from ._errors import ConfigError
from ._layer_args import LayerArgs
from ._microbatch import Microbatch
from ._options import ScheduleOptions
from ._protocols import FreeInputConfig, SchedulableLayer, StreamProvider

if TYPE_CHECKING:
    from ._chunk_plan import ModelChunkSchedulePlan
    from ._layer_plan import TransformerLayerSchedulePlan
    from ._protocols import PreprocessableModel
    from ._state import ChunkState
    from ._streams import AnyEvent, StreamPair

__all__ = ["build_schedule_plan", "layer_args", "layer_schedule_plan", "microbatch"]

_DEFAULT_OPTIONS = ScheduleOptions()
_LOCAL_EXPERTS = Opt(POSITIVE)
_FLAGS = ("is_moe", "delay_wgrad_compute", "is_mtp", "is_first_layer", "is_last_layer")
_KEYS = frozenset(f.name for f in fields(LayerArgs))


def layer_args(extra_args: Mapping[str, object] | None) -> LayerArgs:
    """Megatron's ``extra_args`` dict as a :class:`~moe_overlap.LayerArgs`.

    Keys are ``LayerArgs``' fields; ``config`` is required, the flags default to
    ``False``. An unknown key, a flag that is not a bool, a config without the free-input
    fields, or ``None`` is a :class:`~moe_overlap.ConfigError`.
    """
    if extra_args is None:
        raise ConfigError("LayerArgs: extra_args must give at least 'config', received None")
    unknown = sorted(set(extra_args) - _KEYS)
    if unknown:
        raise ConfigError(
            f"LayerArgs: unknown extra_args keys {unknown}; expected a subset of {sorted(_KEYS)}"
        )
    config = extra_args.get("config")
    if not isinstance(config, FreeInputConfig):
        raise ConfigError(
            "LayerArgs: extra_args['config'] must have moe_token_dispatcher_type, "
            "moe_flex_dispatcher_backend, fp8, fp4 and cuda_graph_modules; received "
            f"{type(config).__name__}"
        )
    flags = {
        key: check_arg("LayerArgs", f"extra_args[{key!r}]", extra_args.get(key, False), BOOL)
        for key in _FLAGS
    }
    nle = check_arg(
        "LayerArgs",
        "extra_args['num_local_experts']",
        extra_args.get("num_local_experts"),
        _LOCAL_EXPERTS,
    )
    return LayerArgs(config=config, num_local_experts=nle, **flags)


def microbatch(
    input_ids: Tensor | None,
    position_ids: Tensor | None,
    attention_mask: Tensor | None,
    decoder_input: Tensor | None = None,
    labels: Tensor | None = None,
    packed_seq_params: Any = None,
    extra_block_kwargs: Mapping[str, object] | None = None,
    runtime_gather_output: bool | None = None,
    loss_mask: Tensor | None = None,
    padding_mask: Tensor | None = None,
) -> Microbatch:
    """Megatron's positional chunk inputs, in ``build_schedule_plan``'s order, as a
    :class:`~moe_overlap.Microbatch`."""
    return Microbatch(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        decoder_input=decoder_input,
        labels=labels,
        packed_seq_params=packed_seq_params,
        extra_block_kwargs=extra_block_kwargs,
        runtime_gather_output=runtime_gather_output,
        loss_mask=loss_mask,
        padding_mask=padding_mask,
    )


def build_schedule_plan(
    model: PreprocessableModel,
    input_ids: Tensor | None,
    position_ids: Tensor | None,
    attention_mask: Tensor | None,
    decoder_input: Tensor | None = None,
    labels: Tensor | None = None,
    packed_seq_params: Any = None,
    extra_block_kwargs: Mapping[str, object] | None = None,
    runtime_gather_output: bool | None = None,
    loss_mask: Tensor | None = None,
    padding_mask: Tensor | None = None,
    *,
    output_processor: Callable[..., object] | None = None,
    output_processor_context: object | None = None,
    streams: StreamPair | None = None,
    options: ScheduleOptions = _DEFAULT_OPTIONS,
    index: int | None = None,
    vp_stage: int | None = None,
    float32_output: bool = True,
) -> ModelChunkSchedulePlan:
    """A :class:`~moe_overlap.ModelChunkSchedulePlan` from Megatron-Core's positional
    inputs (the order of its ``build_schedule_plan``); the keywords are the plan's."""
    from ._chunk_plan import ModelChunkSchedulePlan  # the chunk plan's nodes import this module

    return ModelChunkSchedulePlan(
        model,
        microbatch(
            input_ids,
            position_ids,
            attention_mask,
            decoder_input,
            labels,
            packed_seq_params,
            extra_block_kwargs,
            runtime_gather_output,
            loss_mask,
            padding_mask,
        ),
        output_processor=output_processor,
        output_processor_context=output_processor_context,
        streams=streams,
        options=options,
        index=index,
        vp_stage=vp_stage,
        float32_output=float32_output,
    )


def layer_schedule_plan(
    layer: SchedulableLayer,
    event: AnyEvent,
    chunk_state: ChunkState,
    comp_stream: StreamProvider,
    comm_stream: StreamProvider,
    extra_args: LayerArgs | Mapping[str, object] | None = None,
    *,
    options: ScheduleOptions = _DEFAULT_OPTIONS,
    index: int = 0,
    owner: str | None = None,
) -> TransformerLayerSchedulePlan:
    """A :class:`~moe_overlap.TransformerLayerSchedulePlan` from Megatron-Core's positional
    form. Only the layer's position (``is_first_layer`` / ``is_last_layer``) is taken from
    ``extra_args`` (checked as by :func:`layer_args`); the rest comes from the layer itself,
    as Megatron-Core overwrites it."""
    from ._layer_plan import TransformerLayerSchedulePlan  # it imports this module's floor
    from ._streams import StreamPair

    if extra_args is None:
        first, last = False, False
    else:
        given = (
            extra_args
            if isinstance(extra_args, LayerArgs)
            else layer_args({"config": layer.config, **extra_args})
        )
        first, last = given.is_first_layer, given.is_last_layer
    return TransformerLayerSchedulePlan(
        layer,
        event=event,
        chunk_state=chunk_state,
        streams=StreamPair(comp=comp_stream(), comm=comm_stream()),
        options=options,
        index=index,
        is_first_layer=first,
        is_last_layer=last,
        owner=owner,
    )
