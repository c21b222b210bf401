"""The planner's presets as data: published models' shapes and datasheet machines.

Each table maps a preset's name to the field values :meth:`ModelSpec.preset
<moe_overlap.plan.ModelSpec.preset>` and :meth:`Machine.preset
<moe_overlap.plan.Machine.preset>` build it from; a field left out takes the class's
default, and the name is the preset's own. The classes check every value when a preset
is built.
"""

from collections.abc import Mapping
from types import MappingProxyType
from typing import TypedDict

__all__ = ["MACHINE_PRESETS", "MODEL_PRESETS", "LinkFields", "MachineFields", "ModelFields"]


class _ModelShape(TypedDict):
    """What every model preset gives."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    moe_ffn_hidden_size: int
    num_experts: int
    top_k: int
    vocab_size: int


class ModelFields(_ModelShape, total=False):
    """A model preset's fields of :class:`~moe_overlap.plan.ModelSpec`, less its name and
    microbatch (``seq_len``, ``micro_batch_size``: the caller's)."""

    num_kv_heads: int
    head_dim: int
    shared_experts: int
    first_k_dense: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int


MODEL_PRESETS: Mapping[str, ModelFields] = MappingProxyType(
    {
        "deepseek-v3-671b": ModelFields(
            num_layers=61,
            hidden_size=7168,
            num_attention_heads=128,
            ffn_hidden_size=18432,
            moe_ffn_hidden_size=2048,
            num_experts=256,
            top_k=8,
            shared_experts=1,
            first_k_dense=3,
            vocab_size=129280,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=128,
            v_head_dim=128,
        ),
        "deepseek-v2-lite": ModelFields(
            num_layers=27,
            hidden_size=2048,
            num_attention_heads=16,
            ffn_hidden_size=10944,
            moe_ffn_hidden_size=1408,
            num_experts=64,
            top_k=6,
            shared_experts=2,
            first_k_dense=1,
            vocab_size=102400,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=128,
            v_head_dim=128,
        ),
        "qwen3-235b-a22b": ModelFields(
            num_layers=94,
            hidden_size=4096,
            num_attention_heads=64,
            num_kv_heads=4,
            head_dim=128,
            ffn_hidden_size=12288,
            moe_ffn_hidden_size=1536,
            num_experts=128,
            top_k=8,
            vocab_size=151936,
        ),
        "qwen3-30b-a3b": ModelFields(
            num_layers=48,
            hidden_size=2048,
            num_attention_heads=32,
            num_kv_heads=4,
            head_dim=128,
            ffn_hidden_size=6144,
            moe_ffn_hidden_size=768,
            num_experts=128,
            top_k=8,
            vocab_size=151936,
        ),
        "mixtral-8x7b": ModelFields(
            num_layers=32,
            hidden_size=4096,
            num_attention_heads=32,
            num_kv_heads=8,
            ffn_hidden_size=14336,
            moe_ffn_hidden_size=14336,
            num_experts=8,
            top_k=2,
            vocab_size=32000,
        ),
    }
)
"""Published models' shapes, from their public configurations."""


class LinkFields(TypedDict):
    """A :class:`~moe_overlap.plan.Link`'s fields."""

    name: str
    alpha_us: float
    beta_GBps: float


class MachineFields(TypedDict):
    """A machine preset's fields of :class:`~moe_overlap.plan.Machine`, less its name
    (``mfu`` and ``gpus_per_node``: the class's defaults)."""

    peak_tflops: float
    hbm_GBps: float
    hbm_GB: float
    nvlink: LinkFields
    network: LinkFields


# Latencies are assumptions, not datasheet figures: 3 us a message over NVLink, 8 us over
# the network (Machine.preset's docstring says so).
_NVLINK_4 = LinkFields(name="nvlink", alpha_us=3.0, beta_GBps=450.0)
_NVLINK_H800 = LinkFields(name="nvlink", alpha_us=3.0, beta_GBps=200.0)
_IB_400G = LinkFields(name="infiniband-400g", alpha_us=8.0, beta_GBps=50.0)

MACHINE_PRESETS: Mapping[str, MachineFields] = MappingProxyType(
    {
        "h100": MachineFields(
            peak_tflops=989.0, hbm_GBps=3350.0, hbm_GB=80.0, nvlink=_NVLINK_4, network=_IB_400G
        ),
        "h200": MachineFields(
            peak_tflops=989.0, hbm_GBps=4800.0, hbm_GB=141.0, nvlink=_NVLINK_4, network=_IB_400G
        ),
        "h800": MachineFields(
            peak_tflops=989.0, hbm_GBps=3350.0, hbm_GB=80.0, nvlink=_NVLINK_H800, network=_IB_400G
        ),
    }
)
"""Hopper SXM machines from public datasheets (:meth:`Machine.preset
<moe_overlap.plan.Machine.preset>` lists the figures)."""
