"""Transformer configuration (the fields the EP-A2A overlap reads)."""

from dataclasses import dataclass
from typing import Literal

from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.transformer.enums import CudaGraphModule

@dataclass(kw_only=True)
class TransformerConfig(ModelParallelConfig):
    """A subset of Megatron's ``TransformerConfig``.

    ``cuda_graph_modules`` is declared with its type after ``__post_init__``: Megatron
    accepts a string, a member or a list there and normalises it to a list of
    :class:`CudaGraphModule` (the default ``"full"`` becomes ``[]``).
    """

    mtp_num_layers: int | None = None
    num_moe_experts: int | None = None
    moe_token_dispatcher_type: Literal["allgather", "alltoall", "flex"] = "allgather"
    moe_flex_dispatcher_backend: Literal["deepep", "hybridep", "ncclep"] = "deepep"
    moe_ncclep_zero_copy: bool = False
    moe_shared_expert_overlap: bool = False
    fp8: Literal["e4m3", "hybrid"] | None = None
    fp8_recipe: str = "delayed"
    fp4: Literal["e2m1"] | None = None
    cuda_graph_impl: Literal["none", "local", "transformer_engine", "full_iteration"] = "none"
    cuda_graph_modules: list[CudaGraphModule] = ...
    high_priority_a2a_comm_stream: bool = False
