"""Transformer enums (the CUDA-graph ones)."""

import enum

class CudaGraphModule(enum.Enum):
    """Scopes a per-layer CUDA graph can capture; an empty list means the whole layer."""

    attn = 1
    mlp = 2
    moe = 3
    moe_router = 4
    moe_preprocess = 5
    mamba = 6

class CudaGraphScope(enum.Enum):
    """Deprecated: kept for checkpoint deserialisation; ordinals differ from CudaGraphModule."""

    full_iteration = 1
    attn = 2
    mlp = 3
    moe = 4
    moe_router = 5
    moe_preprocess = 6
    mamba = 7
    full_iteration_inference = 8
