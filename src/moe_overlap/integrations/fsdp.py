"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for models trained with the overlap.

FSDP2 all-gathers a module's parameters in a forward pre-hook, frees them in a forward
hook, and all-gathers again and reduce-scatters the gradients from hooks it registers on
the module's inputs and outputs in forward. The schedule never calls a model's
``forward`` nor a layer's: it calls ``_preprocess`` / ``_postprocess`` and the layers'
slots, which call the modules inside the layer. FSDP applied to the model or to a layer
would therefore never run its hooks (refused at plan construction); applied to the
modules the slots call, it runs exactly as in plain training, slot by slot, whichever
microbatch's slot runs next. :func:`fully_shard_slots` applies it there.

Only public torch API is used (``fully_shard``, ``FSDPModule.set_gradient_divide_factor`` and
``set_force_sum_reduction_for_comms``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

from torch import nn

from moe_overlap import ConfigError
from moe_overlap.args import BOOL, CALLABLE, MODULE, Instance, Opt, check_arg
from moe_overlap.blocks import GroupedExperts
from moe_overlap.integrations.checkpoint import expert_shards, register_fsdp_experts

__all__ = ["fully_shard_slots", "slot_modules"]


def _device_mesh() -> type[object]:
    from torch.distributed.device_mesh import DeviceMesh

    return cast("type[object]", DeviceMesh)


_MESH = Opt(Instance(_device_mesh, "a DeviceMesh (init_device_mesh)"))


def _is_grouped_experts(module: nn.Module) -> bool:
    return isinstance(module, GroupedExperts)


def slot_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(name, module)`` of the modules the schedule calls, each holding parameters.

    Every child of every decoder layer, then every child of the model outside its decoder
    (the embedding, the final norm, the output layer). The layers themselves and the model
    are not among them: the schedule never calls their ``forward``.
    """
    check_arg("slot_modules", "model", model, MODULE)
    decoder: object = getattr(model, "decoder", None)
    layers: object = getattr(decoder, "layers", None)
    if not isinstance(layers, (list, tuple, nn.ModuleList)):
        raise ConfigError(
            f"fully_shard_slots: expected {type(model).__name__}.decoder.layers, a list of "
            f"the layers (a PreprocessableModel), received {type(layers).__name__}"
        )
    checked: list[nn.Module] = []
    for i, layer in enumerate(cast("Sequence[object]", layers)):
        if not isinstance(layer, nn.Module):
            raise ConfigError(
                f"fully_shard_slots: decoder.layers[{i}] is a {type(layer).__name__}, not an "
                "nn.Module whose children the slots call; shard such a model's modules "
                "yourself with fully_shard, never the layer objects or the model"
            )
        checked.append(layer)
    # Checked above, when called; the modules are listed when iterated.
    return _slot_modules(model, decoder, checked)


def _slot_modules(
    model: nn.Module, decoder: object, layers: Sequence[nn.Module]
) -> Iterator[tuple[str, nn.Module]]:
    named = cast("Iterator[tuple[str, nn.Module]]", model.named_modules())  # unannotated
    names = {id(m): n for n, m in named}
    in_layers: set[int] = set()
    for layer in layers:
        for child in layer.children():
            in_layers.update(id(m) for m in child.modules())
            if any(True for _ in child.parameters()):
                yield names.get(id(child), type(child).__name__), child
        in_layers.add(id(layer))
    for name, child in model.named_children():
        if child is decoder or id(child) in in_layers:
            continue
        if any(True for _ in child.parameters()):
            yield name, child


def fully_shard_slots(
    model: nn.Module,
    *,
    mesh: Any = None,
    expert_mesh: Any = None,
    is_expert: Callable[[nn.Module], bool] = _is_grouped_experts,
    reshard_after_forward: bool = True,
    **fsdp_kwargs: Any,
) -> list[nn.Module]:
    """``fully_shard`` every module of :func:`slot_modules`; returns them (now FSDPModules).

    Args:
        model: a ``PreprocessableModel`` whose layers are ``nn.Module`` s (the reference
            model, models built from :mod:`moe_overlap.blocks`).
        mesh: the data-parallel ``DeviceMesh`` of the dense parameters (``None``: the
            world, as ``fully_shard`` takes it).
        expert_mesh: the mesh of the ranks holding the same experts (under EP, the ranks
            with the same EP rank); ``None``: experts are sharded like the rest. Their
            gradient is divided by ``mesh``'s size, not ``expert_mesh``'s: each rank's
            expert gradient already sums the tokens of its whole EP group, so the result
            is the mean over every data-parallel replica, like the dense parameters'.
        is_expert: which slot modules hold routed experts (default: ``GroupedExperts``).
        reshard_after_forward: free the gathered parameters after each forward slot (the
            memory saving); every sharded module is its own FSDP root, so ``fully_shard``'s
            root default (keep them) is not taken.
        fsdp_kwargs: passed on (``mp_policy``, ``offload_policy``, ...).

    Checkpoints: the experts' state-dict DTensors become 2-D over ``(ep, expert_dp)`` with
    the global expert count (:func:`~moe_overlap.integrations.checkpoint.register_fsdp_experts`,
    a collective over ``expert_mesh`` and the EP groups), so ``torch.distributed.checkpoint``
    saves every rank's rows and reshards them. Refused with
    :class:`~moe_overlap.ConfigError`: EP-sharded experts without ``expert_mesh``, and an
    expert module over an ``expert_mesh`` smaller than ``mesh`` without registered shards.

    Delayed weight gradients are refused at plan construction for a model with FSDP
    modules: FSDP reduce-scatters in its post-backward hook, before the schedule's delayed
    weight-gradient step would have filled the gradients.
    """
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule, fully_shard

    w = "fully_shard_slots"
    check_arg(w, "model", model, MODULE)
    check_arg(w, "mesh", mesh, _MESH)
    check_arg(w, "expert_mesh", expert_mesh, _MESH)
    check_arg(w, "is_expert", is_expert, CALLABLE)
    check_arg(w, "reshard_after_forward", reshard_after_forward, BOOL)
    if isinstance(model, FSDPModule):
        raise ConfigError(
            f"fully_shard_slots: {type(model).__name__} is already an FSDPModule; its hooks "
            "never run under the schedule: pass the model before any fully_shard"
        )
    if mesh is None and not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(
            "fully_shard_slots: expected a process group to shard over (mesh=None shards "
            "over the default group), received none: the default process group is not "
            "initialized; call torch.distributed.init_process_group first, or pass a "
            "DeviceMesh (init_device_mesh)"
        )
    targets = list(slot_modules(model))
    sharded = [f"{name} ({type(m).__name__})" for name, m in targets if isinstance(m, FSDPModule)]
    if sharded:
        raise ConfigError(
            f"fully_shard_slots: expected {type(model).__name__}'s slot modules not yet "
            f"sharded, received {sharded[:3]}{' ...' if len(sharded) > 3 else ''} already "
            "FSDPModules (fully_shard_slots or fully_shard applied before); apply "
            "fully_shard_slots once, to a model without FSDP modules"
        )
    covered = {id(p) for _, m in targets for p in m.parameters()}
    left = [n for n, p in model.named_parameters() if id(p) not in covered]
    if left:
        raise ConfigError(
            f"fully_shard_slots: expected every parameter of {type(model).__name__} in a slot "
            "module (a child of a decoder layer, or a child of the model outside its decoder), "
            f"received {len(left)} outside them ({', '.join(left[:3])}"
            f"{', ...' if len(left) > 3 else ''}): they would stay unsharded and their "
            "gradients never be reduced over the data-parallel ranks; move them into such a "
            "module, or shard the model's modules yourself with fully_shard"
        )
    dense_size = _mesh_size(mesh)
    experts = _check_experts(targets, expert_mesh, is_expert, dense_size)
    out: list[nn.Module] = []
    for _, module in targets:
        expert = expert_mesh is not None and is_expert(module)
        fully_shard(
            module,
            mesh=expert_mesh if expert else mesh,
            reshard_after_forward=reshard_after_forward,
            **fsdp_kwargs,
        )
        if expert and dense_size != _mesh_size(expert_mesh):
            sharded = cast(Any, module)
            sharded.set_gradient_divide_factor(float(dense_size))
            # Sum, then divide: a pre-multiplied sum (NCCL's PreMulSum) does not exist on gloo.
            sharded.set_force_sum_reduction_for_comms(True)
        out.append(module)
    if experts and expert_mesh is not None:
        register_fsdp_experts(experts, expert_mesh)
    return out


def _check_experts(
    targets: Sequence[tuple[str, nn.Module]],
    expert_mesh: Any,
    is_expert: Callable[[nn.Module], bool],
    dense_size: int,
) -> list[nn.Module]:
    """The expert modules with EP-sharded checkpoints; refuses what would mix EP ranks."""
    registered: list[nn.Module] = []
    for name, module in targets:
        shards = expert_shards(module)
        if shards is not None and expert_mesh is None:
            raise ConfigError(
                f"fully_shard_slots: {name} ({type(module).__name__}) holds {shards.local_experts} "
                f"of {shards.num_experts} experts (EP size {shards.size}); expected an "
                "expert_mesh of the ranks holding the same experts, received None (sharding "
                "them over mesh would gather other EP ranks' experts)"
            )
        if expert_mesh is None or not is_expert(module):
            continue
        if shards is not None:
            registered.append(module)
        elif _mesh_size(expert_mesh) != dense_size:
            raise ConfigError(
                f"fully_shard_slots: {name} ({type(module).__name__}) is an expert module sharded "
                "over an expert_mesh smaller than mesh (expert parallelism), but has no "
                "register_expert_shards: its checkpoints would mix the EP ranks' experts; "
                "register it (moe_overlap.integrations.checkpoint) before fully_shard_slots"
            )
    return registered


def _mesh_size(mesh: Any) -> int:
    if mesh is None:
        import torch.distributed as dist

        size: int = dist.get_world_size()
        return size
    return int(mesh.size())
