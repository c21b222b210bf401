"""The reference model's configuration."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from moe_overlap import ConfigError, CudaGraphModule
from moe_overlap.args import (
    BOOL,
    NON_NEGATIVE,
    NONE,
    POSITIVE,
    Int,
    Items,
    OneOf,
    Opt,
    Real,
    Spec,
    check_fields,
    refuse,
)
from moe_overlap.blocks import DispatcherKind, RecomputePart, RecomputeParts

__all__ = ["GPTMoEConfig"]


@dataclass(frozen=True, slots=True, kw_only=True)
class GPTMoEConfig:
    """Configuration of :class:`~moe_overlap.models.GPTMoEModel`.

    Also a :class:`~moe_overlap.protocols.FreeInputConfig` (the ``moe_*``, ``fp8``, ``fp4`` and
    ``cuda_graph_modules`` fields, fixed to what this model supports) and a model config
    for :class:`~moe_overlap.PreprocessableModel` (``mtp_num_layers``).

    ``cuda_graph_modules`` runs these parts as CUDA graphs on a GPU (eagerly on a CPU):
    ``attn`` (norm, attention, residual), ``moe_router`` (the MoE layers' norm, router and
    shared expert), ``mlp`` (the dense layers' norm, MLP, residual); see
    :class:`~moe_overlap.blocks.GraphedBlock`. Not with ``recompute``.

    Layers ``0 .. first_k_dense-1`` are dense, the rest MoE. ``delay_wgrad_compute``
    builds the layers with delayed weight gradients; they then list their delayed modules
    and the schedule follows them (a ``ScheduleOptions.delay_wgrad_compute`` that says
    otherwise is an error).
    ``moe_aux_loss_coeff`` 0 turns the load-balancing loss off.
    ``moe_a2a_chunks`` ``K`` > 1 cuts each microbatch's tokens into ``K`` groups whose
    all-to-alls run under the previous group's expert GEMMs
    (:class:`~moe_overlap.blocks.TokenDispatcher`'s ``chunks``); 1 is one all-to-all.
    Every field is checked at construction (``ConfigError`` naming the field, what it
    expects and what it received): ints are ints (not bools; NumPy integers are taken as
    ints), flags are bools, reals finite, choices among the listed ones. ``attention`` ``math``
    is explicit, deterministic on every device; ``sdpa`` is PyTorch's fused kernel.
    ``recompute`` names the parts recomputed in backward instead of stored
    (:data:`~moe_overlap.blocks.RecomputePart`: ``norm``, ``attention_core``,
    ``activation``, ``attention``), in the plain path and the schedule alike.
    """

    vocab_size: int = 128
    hidden_size: int = 64
    num_layers: int = 4
    first_k_dense: int = 1
    num_attention_heads: int = 4
    ffn_hidden_size: int = 128
    num_experts: int = 8
    moe_ffn_hidden_size: int = 32
    moe_router_topk: int = 2
    moe_shared_expert_hidden_size: int | None = None
    moe_aux_loss_coeff: float = 0.0
    dispatcher: DispatcherKind = "alltoall"
    attention: Literal["math", "sdpa"] = "math"
    rotary_base: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    seed: int = 0
    dtype: torch.dtype = torch.float32
    delay_wgrad_compute: bool = False
    recompute: tuple[RecomputePart, ...] = ()
    moe_a2a_chunks: int = 1
    # FreeInputConfig / ModelConfigLike: what the schedule reads.
    moe_token_dispatcher_type: Literal["alltoall"] = "alltoall"
    moe_flex_dispatcher_backend: None = None
    fp8: None = None
    fp4: None = None
    cuda_graph_modules: tuple[CudaGraphModule, ...] = ()
    mtp_num_layers: None = None

    def __post_init__(self) -> None:
        check_fields(self, _FIELDS)
        where = "GPTMoEConfig"
        if self.first_k_dense > self.num_layers:
            raise refuse(
                f"{where}.first_k_dense",
                f"an int in [0, num_layers={self.num_layers}]",
                self.first_k_dense,
                field=True,
            )
        head_dim, rem = divmod(self.hidden_size, self.num_attention_heads)
        if rem or head_dim % 2:
            raise refuse(
                f"{where}.hidden_size",
                f"a multiple of num_attention_heads ({self.num_attention_heads}) with an even "
                "head dim (rotary)",
                self.hidden_size,
                field=True,
            )
        if self.moe_router_topk > self.num_experts:
            raise refuse(
                f"{where}.moe_router_topk",
                f"an int in [1, num_experts={self.num_experts}]",
                self.moe_router_topk,
                field=True,
            )
        if self.cuda_graph_modules and self.recompute:
            raise ConfigError(
                "GPTMoEConfig.cuda_graph_modules: expected no recompute with CUDA graphs (a "
                "graph keeps its activations in its own pool, so recomputing inside it saves "
                f"nothing), received recompute={self.recompute}: choose one of the two"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer ``index`` is an MoE layer (the first ``first_k_dense`` are dense)."""
        return index >= self.first_k_dense


_GRAPHABLE = (CudaGraphModule.attn, CudaGraphModule.moe_router, CudaGraphModule.mlp)
_FIELDS: dict[str, Spec[object]] = {
    "vocab_size": POSITIVE,
    "hidden_size": POSITIVE,
    "num_layers": NON_NEGATIVE,
    "first_k_dense": NON_NEGATIVE,
    "num_attention_heads": POSITIVE,
    "ffn_hidden_size": POSITIVE,
    "num_experts": POSITIVE,
    "moe_ffn_hidden_size": POSITIVE,
    "moe_router_topk": POSITIVE,
    "moe_shared_expert_hidden_size": Opt(POSITIVE),
    "moe_aux_loss_coeff": Real(min=0, hint="0 turns the load-balancing loss off"),
    "dispatcher": OneOf(("alltoall", "loopback")),
    "attention": OneOf(("math", "sdpa")),
    "rotary_base": Real(above=0),
    "norm_eps": Real(above=0),
    "init_std": Real(min=0),
    "seed": Int(-(2**63), 2**64 - 1),
    "dtype": OneOf(
        (torch.float32, torch.bfloat16, torch.float64),
        expects="torch.float32, torch.bfloat16 or torch.float64",
    ),
    "delay_wgrad_compute": BOOL,
    "recompute": RecomputeParts("GPTMoEConfig.recompute"),
    "moe_a2a_chunks": Int(
        1, hint="1 (the default) sends a microbatch's tokens in one all-to-all; K > 1 in K chunks"
    ),
    "moe_token_dispatcher_type": OneOf(("alltoall",)),
    "moe_flex_dispatcher_backend": NONE,
    "fp8": NONE,
    "fp4": NONE,
    "cuda_graph_modules": Items(
        OneOf(_GRAPHABLE),
        expects=(
            f"members of {[g.name for g in _GRAPHABLE]} (the static-shape parts; routed "
            "experts and the token permutation change shape every microbatch)"
        ),
        hint="pass CudaGraphModule members, e.g. (CudaGraphModule.attn,)",
    ),
    "mtp_num_layers": NONE,
}
