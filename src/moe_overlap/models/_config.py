"""The reference model's configuration."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from moe_overlap import ConfigError, CudaGraphModule
from moe_overlap.blocks._dispatcher import DispatcherKind
from moe_overlap.blocks._recompute import RecomputePart, check_recompute

__all__ = ["GPTMoEConfig"]


@dataclass(frozen=True, slots=True, kw_only=True)
class GPTMoEConfig:
    """Configuration of :class:`~moe_overlap.models.GPTMoEModel`.

    Also a :class:`~moe_overlap.FreeInputConfig` (the ``moe_*``, ``fp8``, ``fp4`` and
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
    ``moe_aux_loss_coeff`` 0 turns the load-balancing loss off. ``attention`` ``math``
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
    # FreeInputConfig / ModelConfigLike: what the schedule reads.
    moe_token_dispatcher_type: Literal["alltoall"] = "alltoall"
    moe_flex_dispatcher_backend: None = None
    fp8: None = None
    fp4: None = None
    cuda_graph_modules: tuple[CudaGraphModule, ...] = ()
    mtp_num_layers: None = None

    def __post_init__(self) -> None:
        positive = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "ffn_hidden_size": self.ffn_hidden_size,
            "num_experts": self.num_experts,
            "moe_ffn_hidden_size": self.moe_ffn_hidden_size,
            "moe_router_topk": self.moe_router_topk,
        }
        for name, value in positive.items():
            if value < 1:
                raise ConfigError(f"GPTMoEConfig.{name}: expected a positive int, received {value}")
        if self.num_layers < 0:
            raise ConfigError(f"GPTMoEConfig.num_layers: expected >= 0, received {self.num_layers}")
        if not 0 <= self.first_k_dense <= self.num_layers:
            raise ConfigError(
                f"GPTMoEConfig.first_k_dense: expected 0..num_layers={self.num_layers}, "
                f"received {self.first_k_dense}"
            )
        head_dim, rem = divmod(self.hidden_size, self.num_attention_heads)
        if rem or head_dim % 2:
            raise ConfigError(
                "GPTMoEConfig.hidden_size: expected a multiple of num_attention_heads "
                f"({self.num_attention_heads}) with an even head dim (rotary), received "
                f"{self.hidden_size}"
            )
        if self.moe_router_topk > self.num_experts:
            raise ConfigError(
                f"GPTMoEConfig.moe_router_topk: expected <= num_experts={self.num_experts}, "
                f"received {self.moe_router_topk}"
            )
        shared = self.moe_shared_expert_hidden_size
        if shared is not None and shared < 1:
            raise ConfigError(
                "GPTMoEConfig.moe_shared_expert_hidden_size: expected a positive int or None, "
                f"received {shared}"
            )
        if self.dispatcher not in ("alltoall", "loopback"):
            raise ConfigError(
                "GPTMoEConfig.dispatcher: expected 'alltoall' or 'loopback', "
                f"received {self.dispatcher!r}"
            )
        if self.attention not in ("math", "sdpa"):
            raise ConfigError(
                f"GPTMoEConfig.attention: expected 'math' or 'sdpa', received {self.attention!r}"
            )
        if self.dtype not in (torch.float32, torch.bfloat16, torch.float64):
            raise ConfigError(
                "GPTMoEConfig.dtype: expected torch.float32, torch.bfloat16 or torch.float64, "
                f"received {self.dtype}"
            )
        check_recompute(self.recompute, "GPTMoEConfig.recompute")
        graphable = (CudaGraphModule.attn, CudaGraphModule.moe_router, CudaGraphModule.mlp)
        for scope in self.cuda_graph_modules:
            if scope not in graphable:
                raise ConfigError(
                    "GPTMoEConfig.cuda_graph_modules: expected members of "
                    f"{[g.name for g in graphable]} (the static-shape parts; routed experts and "
                    f"the token permutation change shape every microbatch), received {scope!r}"
                )
        if self.cuda_graph_modules and self.recompute:
            raise ConfigError(
                "GPTMoEConfig.cuda_graph_modules: expected no recompute with CUDA graphs (a "
                "graph keeps its activations in its own pool, so recomputing inside it saves "
                f"nothing), received recompute={self.recompute}: choose one of the two"
            )
        if self.moe_aux_loss_coeff < 0:
            raise ConfigError(
                "GPTMoEConfig.moe_aux_loss_coeff: expected >= 0, "
                f"received {self.moe_aux_loss_coeff}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer ``index`` is an MoE layer (the first ``first_k_dense`` are dense)."""
        return index >= self.first_k_dense
