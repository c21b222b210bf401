"""Megatron-Core's call forms: for code ported from Megatron-Core.

The engine works on its own typed shapes: a plan is built from ``(model, Microbatch)`` and
keywords, a layer node takes a :class:`~moe_overlap.LayerArgs`, the layer nodes consume a
:class:`~moe_overlap.PreprocessOutput` through the :class:`~moe_overlap.ChunkState`.
This module accepts Megatron-Core's shapes and converts them:

- :func:`build_schedule_plan`: ``build_schedule_plan(model, input_ids, position_ids,
  attention_mask, decoder_input=None, labels=None, packed_seq_params=None,
  extra_block_kwargs=None, runtime_gather_output=None, loss_mask=None, padding_mask=None,
  ...)``, a :class:`~moe_overlap.ModelChunkSchedulePlan`;
- :func:`layer_args`: a dict-shaped ``extra_args`` as a :class:`~moe_overlap.LayerArgs`
  (an unknown key is a :class:`~moe_overlap.ConfigError`);
  :class:`~moe_overlap.TransformerLayerNode` takes either;
- :func:`layer_schedule_plan`: ``TransformerLayerSchedulePlan(layer, event, chunk_state,
  comp_stream, comm_stream, extra_args)``.

Megatron-Core's ``ModelChunkState`` attribute bag has no counterpart: the typed
:class:`~moe_overlap.ChunkState` reads the same names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor

from moe_overlap import (
    ChunkState,
    LayerArgs,
    Microbatch,
    ModelChunkSchedulePlan,
    PreprocessableModel,
    SchedulableLayer,
    ScheduleOptions,
    StreamPair,
    StreamProvider,
    TransformerLayerSchedulePlan,
)
from moe_overlap.engine._core_args import layer_args as layer_args
from moe_overlap.engine.core._streams import AnyEvent

__all__ = ["build_schedule_plan", "layer_args", "layer_schedule_plan"]

_DEFAULT_OPTIONS = ScheduleOptions()


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
    return ModelChunkSchedulePlan(
        model,
        Microbatch(
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
