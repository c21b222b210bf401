"""Expert parallelism for a transformers MoE model: shard its expert weights, gather them back.

Rank ``r`` of an EP group of size ``P`` keeps global experts ``r*L .. r*L+L-1`` (``L =
E/P``), the order :class:`~moe_overlap.blocks.TokenDispatcher` sends tokens in. Every other
parameter stays replicated. :func:`gather_experts` rebuilds the full transformers
``state_dict`` (same keys, full ``[E, ...]`` expert tensors) for checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe_overlap import ConfigError
from moe_overlap.adapters._hf_parts import find_parts

__all__ = ["expert_parameter_names", "gather_experts", "shard_experts"]

_EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")

# torch.distributed leaves these unannotated; give them types once, here.
_all_gather = cast(
    "Callable[..., object]",
    dist.all_gather,  # pyright: ignore[reportUnknownMemberType]
)
_get_world_size: Callable[..., int] = dist.get_world_size
_get_rank: Callable[..., int] = dist.get_rank


def _group_size_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return _get_world_size(group), _get_rank(group)


def _expert_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module, int]]:
    """``(qualified name, experts module, global expert count)`` of every MoE layer."""
    parts = find_parts(model)
    # torch leaves named_modules() unannotated.
    named = cast("Iterator[tuple[str, nn.Module]]", model.named_modules())
    names = {id(m): n for n, m in named}
    for layer in parts.layers:
        if layer.moe is not None:
            yield names[id(layer.moe.experts)], layer.moe.experts, layer.moe.num_experts


def expert_parameter_names(model: nn.Module) -> list[str]:
    """The ``state_dict`` keys of the routed experts' weights (sharded under EP)."""
    return [f"{name}.{w}" for name, _, _ in _expert_modules(model) for w in _EXPERT_WEIGHTS]


def shard_experts(model: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Keep only this rank's slice of every MoE layer's expert weights, in place.

    ``model`` must hold all experts (as built or loaded by transformers); its own
    ``forward`` no longer runs afterwards (it indexes global experts), the adapter's
    schedule does. Raises :class:`~moe_overlap.ConfigError` when the group size does not
    divide the number of experts or the experts are already sharded.
    """
    size, rank = _group_size_rank(group)
    for name, experts, num_experts in _expert_modules(model):
        if num_experts % size:
            raise ConfigError(
                f"shard_experts: the expert-parallel size must divide num_experts="
                f"{num_experts} ({name}), received EP size {size}"
            )
        local = num_experts // size
        for w in _EXPERT_WEIGHTS:
            full = getattr(experts, w)
            assert isinstance(full, nn.Parameter)
            if full.shape[0] != num_experts:
                raise ConfigError(
                    f"shard_experts: {name}.{w}: expected all {num_experts} experts, received "
                    f"{full.shape[0]} (already sharded?)"
                )
            piece = full.detach()[rank * local : (rank + 1) * local].clone()
            setattr(experts, w, nn.Parameter(piece, requires_grad=full.requires_grad))


def gather_experts(model: nn.Module, group: dist.ProcessGroup | None) -> dict[str, Tensor]:
    """The full transformers ``state_dict`` of an expert-sharded ``model``.

    A collective: every rank of ``group`` must call it. Expert weights are all-gathered
    (concatenated by rank), everything else is this rank's copy; keys and shapes are those
    of the unsharded model, so ``save_pretrained(dir, state_dict=...)`` or
    ``load_state_dict`` on a full model take it as is.
    """
    size, _ = _group_size_rank(group)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    for name, experts, num_experts in _expert_modules(model):
        for w in _EXPERT_WEIGHTS:
            local = getattr(experts, w)
            assert isinstance(local, nn.Parameter)
            if local.shape[0] * size != num_experts:
                raise ConfigError(
                    f"gather_experts: {name}.{w}: expected {num_experts // size} local experts "
                    f"for EP size {size}, received {local.shape[0]}"
                )
            if size == 1:
                continue
            pieces = [torch.empty_like(local.detach()) for _ in range(size)]
            _all_gather(pieces, local.detach().contiguous(), group=group)
            state[f"{name}.{w}"] = torch.cat(pieces, dim=0)
    return state
