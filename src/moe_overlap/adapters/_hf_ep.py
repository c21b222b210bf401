"""Expert parallelism for a transformers MoE model: shard its expert weights, gather them back.

Rank ``r`` of an EP group of size ``P`` keeps global experts ``r*L .. r*L+L-1`` (``L =
E/P``), the order :class:`~moe_overlap.blocks.TokenDispatcher` sends tokens in. Every other
parameter stays replicated. :func:`gather_experts` rebuilds the full transformers
``state_dict`` (same keys, full ``[E, ...]`` expert tensors) for checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe_overlap import ConfigError
from moe_overlap.adapters._hf_calls import base_model, decoder_layers
from moe_overlap.adapters._hf_structure import block_of
from moe_overlap.args import GROUP, MODULE, Opt, check_arg
from moe_overlap.integrations.checkpoint import register_expert_shards

__all__ = ["Experts", "expert_parameter_names", "experts_of", "gather_experts", "shard_experts"]

# torch.distributed leaves these unannotated; give them types once, here.
_all_gather = cast(
    "Callable[..., object]",
    dist.all_gather,  # pyright: ignore[reportUnknownMemberType]
)
_get_world_size: Callable[..., int] = dist.get_world_size
_get_rank: Callable[..., int] = dist.get_rank


def _group_size_rank(group: dist.ProcessGroup | None, where: str) -> tuple[int, int]:
    check_arg(where, "group", group, Opt(GROUP))
    if group is None:
        return 1, 0
    return _get_world_size(group), _get_rank(group)


_GLOBAL = "_moe_overlap_num_experts"


@dataclass(frozen=True, slots=True)
class Experts:
    """A MoE layer's routed-experts module and its global expert count."""

    module: nn.Module
    num_global: int

    def weights(self) -> list[str]:
        """Names of the parameters with one slice per expert (sharded under EP)."""
        local = self.num_local
        return [
            n
            for n, p in self.module.named_parameters(recurse=False)
            if p.dim() >= 2 and p.shape[0] == local
        ]

    @property
    def num_local(self) -> int:
        value: object = getattr(self.module, "num_experts", None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        return max(p.shape[0] for p in self.module.parameters(recurse=False) if p.dim() == 3)


def experts_of(layer: nn.Module) -> Experts:
    """The routed experts of a MoE decoder layer (see ``block_of``)."""
    found = block_of(layer)
    if found is None:
        raise ConfigError(
            f"{type(layer).__name__}: expected a MoE block with experts, received none"
        )
    module = found[1].get_submodule("experts")
    recorded: object = getattr(module, _GLOBAL, None)
    if isinstance(recorded, int):
        return Experts(module, recorded)
    value: object = getattr(module, "num_experts", None)
    if isinstance(value, int) and not isinstance(value, bool):
        return Experts(module, value)
    return Experts(
        module, max(p.shape[0] for p in module.parameters(recurse=False) if p.dim() == 3)
    )


def _expert_modules(model: nn.Module) -> Iterator[tuple[str, Experts]]:
    """``(qualified name, experts)`` of every MoE layer."""
    # torch leaves named_modules() unannotated.
    named = cast("Iterator[tuple[str, nn.Module]]", model.named_modules())
    names = {id(m): n for n, m in named}
    for layer in decoder_layers(base_model(model)):
        if block_of(layer) is not None:
            experts = experts_of(layer)
            yield names[id(experts.module)], experts


def expert_parameter_names(model: nn.Module) -> list[str]:
    """The ``state_dict`` keys of the routed experts' weights (sharded under EP)."""
    check_arg("expert_parameter_names", "model", model, MODULE)
    return [f"{name}.{w}" for name, e in _expert_modules(model) for w in e.weights()]


def shard_experts(model: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Keep only this rank's slice of every MoE layer's expert weights, in place.

    ``model`` must hold all experts (as built or loaded by transformers); its own
    ``forward`` no longer runs afterwards (it indexes global experts), the adapter's
    schedule does. The experts module's ``num_experts`` becomes the local count, and the
    sliced tensors appear in state dicts as DTensors over ``group`` with the global expert
    count (:func:`~moe_overlap.integrations.checkpoint.register_expert_shards`), so
    ``torch.distributed.checkpoint`` saves and reshards them exactly. Raises
    :class:`~moe_overlap.ConfigError` when the group size does not divide the number of
    experts or the experts are already sharded.
    """
    check_arg("shard_experts", "model", model, MODULE)
    size, rank = _group_size_rank(group, "shard_experts")
    for name, experts in _expert_modules(model):
        num_experts = experts.num_global
        if num_experts % size:
            raise ConfigError(
                f"shard_experts: the expert-parallel size must divide num_experts="
                f"{num_experts} ({name}), received EP size {size}"
            )
        if experts.num_local != num_experts:
            raise ConfigError(
                f"shard_experts: {name}: expected all {num_experts} experts, received "
                f"{experts.num_local} (already sharded?)"
            )
        local = num_experts // size
        module = experts.module
        names = experts.weights()
        for w in names:
            full = getattr(module, w)
            assert isinstance(full, nn.Parameter)
            piece = full.detach()[rank * local : (rank + 1) * local].clone()
            setattr(module, w, nn.Parameter(piece, requires_grad=full.requires_grad))
        object.__setattr__(module, _GLOBAL, num_experts)
        if isinstance(getattr(module, "num_experts", None), int):
            setattr(module, "num_experts", local)  # noqa: B010 - an attribute of the HF module
        # Checkpoints: these tensors appear in state dicts as DTensors over the EP group.
        register_expert_shards(module, names, num_experts=num_experts, group=group)


def gather_experts(model: nn.Module, group: dist.ProcessGroup | None) -> dict[str, Tensor]:
    """The full transformers ``state_dict`` of an expert-sharded ``model``.

    A collective: every rank of ``group`` must call it. Expert weights are all-gathered
    (concatenated by rank), everything else is this rank's copy; keys and shapes are those
    of the unsharded model, so ``save_pretrained(dir, state_dict=...)`` or
    ``load_state_dict`` on a full model take it as is.
    """
    check_arg("gather_experts", "model", model, MODULE)
    size, _ = _group_size_rank(group, "gather_experts")
    state = {k: v.detach() for k, v in model.state_dict().items()}
    for name, experts in _expert_modules(model):
        if experts.num_local * size != experts.num_global:
            raise ConfigError(
                f"gather_experts: {name}: expected {experts.num_global // size} local experts "
                f"for EP size {size}, received {experts.num_local}"
            )
        if size == 1:
            continue
        for w in experts.weights():
            local = getattr(experts.module, w)
            assert isinstance(local, nn.Parameter)
            pieces = [torch.empty_like(local.detach()) for _ in range(size)]
            _all_gather(pieces, local.detach().contiguous(), group=group)
            state[f"{name}.{w}"] = torch.cat(pieces, dim=0)
    return state
