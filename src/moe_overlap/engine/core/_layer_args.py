"""What a layer node knows about its layer: the typed form of Megatron's ``extra_args``."""

from __future__ import annotations

from dataclasses import dataclass

from moe_overlap.protocols import FreeInputConfig

__all__ = ["LayerArgs"]


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerArgs:
    """What a :class:`~moe_overlap.TransformerLayerNode` knows about its layer.

    Megatron-Core passes the same keys as an ``extra_args`` dict;
    :func:`moe_overlap.megatron.layer_args` converts one (an unknown key is an error).
    """

    config: FreeInputConfig
    is_moe: bool = False
    num_local_experts: int | None = None
    delay_wgrad_compute: bool = False
    is_mtp: bool = False
    is_first_layer: bool = False
    is_last_layer: bool = False
