"""The Megatron-Core configurations the adapter refuses, each with its reason.

The adapter reproduces a layer's own forward and backward by calling its own methods in
its own order. A setting that changes that path in a way the slots cannot follow (another
call order, state carried between the pieces, random numbers drawn in schedule order) is
a :class:`~moe_overlap.ConfigError` at construction, naming the setting, the value, the
reason and what to do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from moe_overlap import ConfigError
from moe_overlap.adapters._mc_imports import mcore

__all__ = ["refuse_config"]

# (config field, the values accepted, why another is refused, what to do)
_RULES: tuple[tuple[str, tuple[object, ...], str, str], ...] = (
    (
        "tensor_model_parallel_size",
        (1,),
        "the adapter runs tensor parallelism 1 (expert parallelism goes through the model's "
        "own token dispatcher)",
        "build the model with tensor_model_parallel_size=1",
    ),
    ("sequence_parallel", (False,), "it comes with tensor parallelism", "set it False"),
    (
        "context_parallel_size",
        (1,),
        "the adapter runs context parallelism 1",
        "build the model with context_parallel_size=1",
    ),
    (
        "hidden_dropout",
        (0.0, 0),
        "the schedule interleaves microbatches, so dropout masks would be drawn in another "
        "order than the model's own forward draws them",
        "set hidden_dropout=0.0",
    ),
    (
        "attention_dropout",
        (0.0, 0),
        "the schedule interleaves microbatches, so dropout masks would be drawn in another "
        "order than the model's own forward draws them",
        "set attention_dropout=0.0",
    ),
    (
        "recompute_granularity",
        (None,),
        "Megatron-Core's own recomputation checkpoints across the pieces the slots split",
        "leave it None and recompute with ScheduleOptions(recompute=('pre_dispatch', 'mlp'))",
    ),
    ("fp8", (None,), "FP8 is not supported by the adapter", "leave fp8 None"),
    ("fp4", (None,), "FP4 is not supported by the adapter", "leave fp4 None"),
    (
        "cuda_graph_impl",
        ("none",),
        "CUDA graphs capture the layer's forward whole",
        "set cuda_graph_impl='none'",
    ),
    (
        "moe_shared_expert_overlap",
        (False,),
        "it runs the shared experts inside the token dispatcher on a side stream",
        "set moe_shared_expert_overlap=False (the schedule overlaps the all-to-all instead)",
    ),
    (
        "overlap_dispatch_backward_with_experts_wgrad",
        (False,),
        "it moves the experts' weight gradients onto a side stream of its own",
        "set it False",
    ),
    (
        "delay_wgrad_compute",
        (False,),
        "the adapter does not delay Megatron-Core's weight gradients",
        "set it False",
    ),
    (
        "moe_token_dispatcher_type",
        ("alltoall", "allgather"),
        "the adapter runs the all-to-all and all-gather dispatchers (flex needs DeepEP or "
        "HybridEP, CUDA only, untested)",
        "set moe_token_dispatcher_type='alltoall'",
    ),
    (
        "mlp_chunks_for_training",
        (1,),
        "it runs the MLP in chunks inside the layer's forward",
        "set mlp_chunks_for_training=1",
    ),
    (
        "fine_grained_activation_offloading",
        (False,),
        "its offload groups span the pieces the slots split",
        "set it False",
    ),
    ("cpu_offloading", (False,), "its offload groups span the layers", "set it False"),
    (
        "mtp_num_layers",
        (None, 0),
        "multi-token-prediction layers are not supported by the adapter",
        "leave mtp_num_layers None",
    ),
    (
        "transformer_impl",
        ("local", "transformer_engine"),
        "the inference-optimized layers are for inference",
        "build the model for training",
    ),
)


def refuse_config(model: nn.Module, layers: Sequence[tuple[str, nn.Module]]) -> None:
    """Raise :class:`~moe_overlap.ConfigError` for a configuration or layer the adapter
    cannot run exactly."""
    m: Any = model
    cls = type(model).__name__
    config: Any = getattr(m, "config", None)
    for name, accepted, why, todo in _RULES:
        value: object = getattr(config, name, accepted[0])
        if value not in accepted:
            shown = " or ".join(repr(a) for a in accepted)
            raise ConfigError(
                f"MegatronMoEAdapter: {cls}.config.{name}: expected {shown} ({why}), "
                f"received {value!r}; {todo}"
            )
    mc = mcore()
    for name, layer in layers:
        if not isinstance(layer, mc.transformer_layer):
            raise ConfigError(
                f"MegatronMoEAdapter: {cls}.{name}: expected a Megatron-Core TransformerLayer, "
                f"received {type(layer).__name__}; the adapter splits TransformerLayers only"
            )
        mlp: object = getattr(layer, "mlp", None)
        if isinstance(mlp, mc.moe_layer):
            dispatcher: object = getattr(mlp, "token_dispatcher", None)
            if not isinstance(dispatcher, mc.dispatchers):
                raise ConfigError(
                    f"MegatronMoEAdapter: {cls}.{name}.mlp.token_dispatcher: expected "
                    "Megatron-Core's all-to-all or all-gather token dispatcher, received "
                    f"{type(dispatcher).__name__}"
                )
