"""Exact ``torch.distributed.checkpoint`` (DCP) state dicts under expert parallelism.

Under EP every rank holds ``L = E / P`` of a layer's ``E`` experts as a plain ``[L, ...]``
tensor, under the same name on every rank. Saved as is, DCP takes the tensors of the EP
ranks for replicas of one tensor and keeps one of them. Here each expert tensor (and each
optimizer state of the same shape) appears in state dicts as a ``DTensor`` sharded
``Shard(0)`` over the EP group's ``DeviceMesh``, with the global shape ``[E, ...]``: DCP then
saves every rank's rows and reshards on load (EP=2 to EP=1 and back, DP=2 to DP=1) with its
own machinery. The parameters stay plain tensors for compute; the DTensors share their
storage, so ``dcp.load`` writes straight into them.

- :func:`register_expert_shards` adds the module hooks (the reference model's MoE layers
  and :func:`~moe_overlap.adapters.transformers.shard_experts` call it);
- :func:`register_fsdp_experts` describes experts that FSDP2 sharded further over the ranks
  holding the same experts (:func:`~moe_overlap.integrations.fsdp.fully_shard_slots` calls
  it): their DTensor becomes 2-D, ``(Shard(0), Shard(0))`` over ``(ep, expert_dp)``;
- optimizers get the same treatment of their states automatically the first time they step
  (also the zero-learning-rate step ``get_optimizer_state_dict`` runs on a fresh one), or
  explicitly with :func:`attach_optimizer`.

What cannot be done exactly raises :class:`~moe_overlap.IntegrationError` or
:class:`~moe_overlap.ConfigError` (see ``docs/checkpoint.md``). Only public torch API is used
(``DeviceMesh``, ``DTensor``, module and optimizer state-dict hooks,
``register_optimizer_step_pre_hook``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from itertools import chain
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh  # at run time: debug mode resolves hints

from moe_overlap import ConfigError, IntegrationError
from moe_overlap.args import GROUP, MODULE, POSITIVE, Instance, Items, Opt, check_arg

__all__ = [
    "ExpertShards",
    "attach_optimizer",
    "expert_shards",
    "register_expert_shards",
    "register_fsdp_experts",
]

_ATTR = "_moe_overlap_expert_shards"

# torch.distributed leaves these unannotated; give them types once, here.
_get_world_size: Callable[..., int] = dist.get_world_size
_get_rank: Callable[..., int] = dist.get_rank
_group_ranks: Callable[..., list[int]] = dist.get_process_group_ranks
_all_gather_object = cast(
    "Callable[..., None]",
    dist.all_gather_object,  # pyright: ignore[reportUnknownMemberType]
)


@dataclass(frozen=True, slots=True)
class _FsdpGrid:
    """Experts FSDP2 shards over ``mesh`` (the ranks with this EP rank); ``grid`` is
    ``(ep, expert_dp)``."""

    mesh: DeviceMesh
    grid: DeviceMesh


@dataclass(frozen=True, eq=False)
class ExpertShards:
    """How a module's expert tensors are split: rank ``r`` of ``group`` (size ``size``)
    holds global experts ``r*L .. r*L+L-1`` (``L = num_experts // size``) of each tensor
    ``names`` (relative to the module; dim 0 is the expert)."""

    names: tuple[str, ...]
    num_experts: int
    group: dist.ProcessGroup
    size: int
    rank: int
    fsdp: _FsdpGrid | None = None
    _meshes: dict[str, DeviceMesh] = field(default_factory=dict[str, "DeviceMesh"], repr=False)

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.size

    @property
    def offset(self) -> int:
        """Global index of this rank's first expert."""
        return self.rank * self.local_experts

    def mesh(self, device_type: str) -> DeviceMesh:
        """The 1-D EP mesh (from ``group``, no collective) for ``device_type``."""
        found = self._meshes.get(device_type)
        if found is None:
            found = DeviceMesh.from_group(self.group, device_type, mesh_dim_names=("ep",))
            self._meshes[device_type] = found
        return found

    def __deepcopy__(self, memo: dict[int, object]) -> ExpertShards:
        # A deep copy of the module shares this description (groups and meshes cannot be
        # copied); the copy joins the registry so optimizers over it find its experts.
        for owner in list(_MODULES):
            twin = memo.get(id(owner))
            if isinstance(twin, nn.Module) and getattr(owner, _ATTR, None) is self:
                _MODULES.add(twin)
        return self


_NAMES = Items(Instance(str, "a parameter name"))
_OPTIMIZER = Instance(torch.optim.Optimizer, "a torch.optim.Optimizer", error=IntegrationError)


def _device_mesh() -> type[DeviceMesh]:
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh


_MESH = Instance(_device_mesh, "a 1-D DeviceMesh (init_device_mesh)")

_MODULES: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_ATTACHED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_STEP_HOOK: list[object] = []


def expert_shards(module: nn.Module) -> ExpertShards | None:
    """The registered description of ``module``'s expert tensors, if any."""
    check_arg("expert_shards", "module", module, MODULE)
    found: object = getattr(module, _ATTR, None)
    return found if isinstance(found, ExpertShards) else None


def register_expert_shards(
    module: nn.Module,
    names: Iterable[str],
    *,
    num_experts: int,
    group: dist.ProcessGroup | None,
) -> ExpertShards | None:
    """Expose ``module``'s expert tensors ``names`` as EP-sharded DTensors in state dicts.

    Rank ``r`` of ``group`` must hold global experts ``r*L .. r*L+L-1`` (``L =
    num_experts / group size``) as a plain ``[L, ...]`` parameter for each name. Adds a
    state-dict post-hook (``[L, ...]`` to a ``DTensor`` of shape ``[num_experts, ...]``,
    ``Shard(0)`` over the group's mesh, sharing storage) and a load pre-hook (back to this
    rank's rows; a full plain ``[num_experts, ...]`` tensor is sliced). Keys are the module's
    own, so a module holding some layers (a pipeline stage) works as a whole model does.
    ``None`` or a group of one: nothing to do (returns ``None``); state dicts stay plain.
    Call it before ``fully_shard``; registering again replaces the description.
    """
    w = "register_expert_shards"
    check_arg(w, "module", module, MODULE)
    listed = check_arg(w, "names", names, _NAMES)
    num_experts = check_arg(w, "num_experts", num_experts, POSITIVE)
    check_arg(w, "group", group, Opt(GROUP))
    where = type(module).__name__
    twice = sorted({name for name in listed if listed.count(name) > 1})
    if twice:
        raise ConfigError(
            f"register_expert_shards({where}): expected each expert tensor name once, "
            f"received {twice} more than once; list each name once"
        )
    for name in listed:  # a misspelt name: refused here too, not only under EP
        _parameter(module, name, "register_expert_shards")
    if group is None or _get_world_size(group) == 1:
        return None
    size, rank = _get_world_size(group), _get_rank(group)
    if num_experts % size:
        raise ConfigError(
            f"register_expert_shards({where}): expected an EP size dividing num_experts="
            f"{num_experts}, received {size}"
        )
    local = num_experts // size
    if not listed:
        raise ConfigError(
            f"register_expert_shards({where}): expected expert tensor names, received none"
        )
    for name in listed:
        p = _parameter(module, name, "register_expert_shards")
        if _is_dtensor(p):
            raise ConfigError(
                f"register_expert_shards({where}.{name}): expected a plain tensor of this "
                "rank's experts, received a DTensor; register the experts before fully_shard "
                "and describe FSDP's sharding with register_fsdp_experts"
            )
        if p.dim() < 1 or p.shape[0] != local:
            raise ConfigError(
                f"register_expert_shards({where}.{name}): expected {local} experts on dim 0 "
                f"({num_experts} over EP size {size}), received shape {list(p.shape)}"
            )
    fresh = expert_shards(module) is None
    object.__setattr__(module, _ATTR, ExpertShards(listed, num_experts, group, size, rank))
    if fresh:
        # torch leaves both unannotated.
        post = cast(
            "Callable[..., object]",
            module.register_state_dict_post_hook,  # pyright: ignore[reportUnknownMemberType]
        )
        pre = cast(
            "Callable[..., object]",
            module.register_load_state_dict_pre_hook,  # pyright: ignore[reportUnknownMemberType]
        )
        post(_state_dict_post_hook)
        pre(_load_pre_hook)
    _MODULES.add(module)
    _install_step_hook()
    return expert_shards(module)


def register_fsdp_experts(modules: Iterable[nn.Module], expert_mesh: DeviceMesh) -> None:
    """Describe experts that ``fully_shard(module, mesh=expert_mesh)`` sharded further.

    ``expert_mesh`` is a 1-D mesh of the ranks holding the same experts (the same EP rank).
    A collective over ``expert_mesh``'s group and each EP group: every rank calls it, with
    its modules in the same order. The experts' state-dict DTensors become 2-D over
    ``(ep, expert_dp)`` with ``(Shard(0), Shard(0))`` and the global expert count.
    Raises :class:`~moe_overlap.ConfigError` when the ranks of ``expert_mesh`` do not all
    hold this rank's experts, or a module has no :func:`register_expert_shards`.
    """
    modules = check_arg("register_fsdp_experts", "modules", modules, Items(MODULE))
    check_arg("register_fsdp_experts", "expert_mesh", expert_mesh, _MESH)
    grids: dict[str, _FsdpGrid] = {}
    for module in modules:
        shards = expert_shards(module)
        where = type(module).__name__
        if shards is None:
            raise ConfigError(
                f"register_fsdp_experts({where}): expected a module with registered expert "
                "shards (register_expert_shards), received one without"
            )
        if expert_mesh.ndim != 1:
            raise ConfigError(
                f"register_fsdp_experts({where}): expected a 1-D expert_mesh, received "
                f"{expert_mesh.ndim} dimensions"
            )
        key = shards.group.group_name
        grid = grids.get(key)
        if grid is None:
            grid = _fsdp_grid(shards, expert_mesh, where)
            grids[key] = grid
        object.__setattr__(module, _ATTR, replace(shards, fsdp=grid))


def _fsdp_grid(shards: ExpertShards, expert_mesh: DeviceMesh, where: str) -> _FsdpGrid:
    from torch.distributed.device_mesh import DeviceMesh

    edp = expert_mesh.get_group()
    members = [int(r) for r in expert_mesh.mesh.flatten()]
    ep_ranks = _group_ranks(shards.group)
    views: list[object] = [None] * len(members)
    _all_gather_object(views, ep_ranks, group=edp)
    columns = [cast("list[int]", v) for v in views]
    for d, column in enumerate(columns):
        if len(column) != shards.size or column[shards.rank] != members[d]:
            raise ConfigError(
                f"register_fsdp_experts({where}): expected expert_mesh to hold the ranks with "
                f"this rank's EP rank {shards.rank} (each in an EP group of size {shards.size}), "
                f"received rank {members[d]} whose EP group is {column}"
            )
    layout = [[column[e] for column in columns] for e in range(shards.size)]
    flat = [r for row in layout for r in row]
    views = [None] * shards.size
    _all_gather_object(views, layout, group=shards.group)
    if len(set(flat)) != len(flat) or any(v != layout for v in views):
        raise ConfigError(
            f"register_fsdp_experts({where}): expected the EP groups and expert meshes to form "
            f"one grid of ranks (EP x expert data parallel), received the layouts {views}"
        )
    grid = DeviceMesh.from_group(
        [shards.group, edp],
        expert_mesh.device_type,
        mesh=layout,
        mesh_dim_names=("ep", "expert_dp"),
    )
    return _FsdpGrid(expert_mesh, grid)


def attach_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Expose ``optimizer``'s states of registered expert parameters like the parameters.

    Done automatically the first time an optimizer steps once an expert-sharded module
    exists; call it for an optimizer whose ``state_dict`` / ``load_state_dict`` is used
    before it ever steps. States of another shape than their parameter's (other than
    scalars such as ``step``) are refused at ``state_dict`` with
    :class:`~moe_overlap.IntegrationError`: which EP rank's rows they hold cannot be said.
    Idempotent. Also turns expert states already loaded as DTensors back into local ones.
    """
    check_arg("attach_optimizer", "optimizer", optimizer, _OPTIMIZER)
    if optimizer in _ATTACHED:
        return
    _ATTACHED.add(optimizer)
    optimizer.register_state_dict_post_hook(_optimizer_state_dict_post_hook)
    optimizer.register_load_state_dict_pre_hook(_optimizer_load_pre_hook)
    experts = _expert_parameters()
    for p, state in list(optimizer.state.items()):
        found = experts.get(id(p))
        if found is None or not isinstance(state, dict):
            continue
        named = cast("dict[str, object]", state)
        for key, value in list(named.items()):
            if isinstance(value, Tensor) and _foreign(value, p):
                named[key] = _to_local(found[0], value, p, f"optimizer state {key!r}")


def _install_step_hook() -> None:
    if _STEP_HOOK:
        return
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    def on_step(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        del args, kwargs
        if optimizer not in _ATTACHED:
            attach_optimizer(optimizer)

    _STEP_HOOK.append(register_optimizer_step_pre_hook(on_step))


# ----------------------------------------------------------------------------- conversions


def _is_dtensor(t: object) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _foreign(value: Tensor, param: Tensor) -> bool:
    """A DTensor state that is not over its parameter's own mesh (a loaded global one)."""
    if not _is_dtensor(value):
        return False
    if not _is_dtensor(param):
        return True
    mesh: object = cast(Any, value).device_mesh
    return bool(mesh != cast(Any, param).device_mesh)


def _parameter(module: nn.Module, name: str, where: str) -> Tensor:
    try:
        p = module.get_parameter(name)
    except AttributeError as exc:
        raise ConfigError(
            f"{where}({type(module).__name__}): expected a parameter {name!r}, received none "
            f"({exc})"
        ) from exc
    return p


def _global_shape(shards: ExpertShards, local: Tensor) -> tuple[int, ...]:
    return (shards.num_experts, *local.shape[1:])


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride: list[int] = []
    step = 1
    for n in reversed(shape):
        stride.append(step)
        step *= max(n, 1)
    return tuple(reversed(stride))


def _fsdp_rows(shards: ExpertShards, grid: _FsdpGrid) -> tuple[int, int]:
    """This rank's FSDP chunk of its ``L`` experts, as ``torch.chunk`` (and DTensor's
    ``Shard``) cut it: ``(start, stop)`` within ``0 .. L``."""
    parts = grid.mesh.size()
    index = grid.mesh.get_local_rank()
    per = -(-shards.local_experts // parts)
    start = min(index * per, shards.local_experts)
    return start, min(start + per, shards.local_experts)


def _to_global(shards: ExpertShards, value: Tensor, param: Tensor, what: str) -> Tensor:
    """``value`` (``param``'s local view, or an optimizer state of its shape) as the
    DTensor of its global expert tensor; shares storage."""
    from torch.distributed.tensor import DTensor, Shard

    if tuple(value.shape) != tuple(param.shape):
        raise IntegrationError(
            f"{what}: expected the shape of its expert parameter {list(param.shape)}, received "
            f"{list(value.shape)}; which EP rank's experts such a tensor holds cannot be said, "
            "so it cannot be checkpointed exactly under expert parallelism (use an optimizer "
            "whose states have their parameter's shape, e.g. Adam / AdamW / SGD)"
        )
    grid = shards.fsdp
    if isinstance(value, DTensor):
        if grid is None:
            raise IntegrationError(
                f"{what}: expected a plain tensor of this rank's experts, received a DTensor over "
                f"{value.device_mesh}; experts sharded by fully_shard need "
                "register_fsdp_experts(modules, expert_mesh) after it (fully_shard_slots does so)"
            )
        if value.device_mesh != grid.mesh or tuple(value.placements) != (Shard(0),):
            raise IntegrationError(
                f"{what}: expected a DTensor Shard(0) over the expert mesh {grid.mesh}, "
                f"received {tuple(value.placements)} over {value.device_mesh}"
            )
        local = value.to_local()
        start, stop = _fsdp_rows(shards, grid)
        if local.shape[0] != stop - start:
            raise IntegrationError(
                f"{what}: FSDP holds {local.shape[0]} of this rank's {shards.local_experts} "
                f"experts, expected {stop - start} (rows {start}..{stop - 1}, DTensor's Shard(0) "
                "chunking); such a sharding cannot be described exactly"
            )
        shape = _global_shape(shards, local)
        return DTensor.from_local(
            local,
            grid.grid,
            (Shard(0), Shard(0)),
            run_check=False,
            shape=torch.Size(shape),
            stride=_contiguous_stride(shape),
        )
    if grid is not None:
        raise IntegrationError(
            f"{what}: expected FSDP's DTensor of this rank's experts, received a plain tensor "
            "(a state dict taken while FSDP's parameters were gathered?)"
        )
    shape = _global_shape(shards, value)
    return DTensor.from_local(
        value,
        shards.mesh(value.device.type),
        (Shard(0),),
        run_check=False,
        shape=torch.Size(shape),
        stride=_contiguous_stride(shape),
    )


def _same_storage(a: Tensor, b: Tensor) -> bool:
    """``a`` is ``b`` or a view of all of it (what a strict=False full load hands back)."""
    if a is b:
        return True
    if tuple(a.shape) != tuple(b.shape) or _is_dtensor(a) != _is_dtensor(b):
        return False
    if _is_dtensor(a):
        da, db = cast(Any, a), cast(Any, b)
        if da.device_mesh != db.device_mesh or tuple(da.placements) != tuple(db.placements):
            return False
        a, b = cast(Tensor, da.to_local()), cast(Tensor, db.to_local())
    return a.shape == b.shape and a.numel() > 0 and a.data_ptr() == b.data_ptr()


def _to_local(shards: ExpertShards, value: Tensor, param: Tensor, what: str) -> Tensor:
    """``value`` (a DTensor of the global expert tensor, or a plain full one) as what
    ``param`` holds: its local rows (FSDP: its DTensor of them)."""
    from torch.distributed.tensor import DTensor, Shard

    if _same_storage(value, param):
        return value
    grid = shards.fsdp
    local_param = cast(Tensor, cast(Any, param).to_local()) if grid is not None else param
    full_shape = (shards.num_experts, *param.shape[1:])
    if tuple(value.shape) != full_shape:
        hint = (
            "a tensor of one rank's experts: which EP rank's cannot be said; load through "
            "torch.distributed.checkpoint (get_model_state_dict / dcp.load), which keeps the "
            "global layout"
            if value.dim() >= 1 and value.shape[0] == shards.local_experts
            else "a checkpoint of another model (expert count or expert shape)?"
        )
        raise IntegrationError(
            f"{what}: expected the global expert tensor of shape {list(full_shape)} (a DTensor "
            f"or a full tensor), received {type(value).__name__} of shape {list(value.shape)}: "
            f"{hint}"
        )
    if grid is None:
        rows = (shards.offset, shards.offset + shards.local_experts)
        ep_mesh = shards.mesh(param.device.type)
        canonical: tuple[DeviceMesh, tuple[object, ...]] = (ep_mesh, (Shard(0),))
        known = [ep_mesh]
    else:
        start, stop = _fsdp_rows(shards, grid)
        rows = (shards.offset + start, shards.offset + stop)
        canonical = (grid.grid, (Shard(0), Shard(0)))
        known = [grid.grid, grid.mesh]
    if isinstance(value, DTensor):
        mesh, placements = value.device_mesh, tuple(value.placements)
        ours = next((k for k in known if mesh == k), None)
        if ours is not None and mesh.get_coordinate() != ours.get_coordinate():
            # Meshes compare by their ranks; the coordinate is the one of the rank that made
            # the DTensor (it survives torch.save), so another rank's rows show here.
            raise IntegrationError(
                f"{what}: expected a DTensor of this rank's rows (mesh coordinate "
                f"{ours.get_coordinate()}), received one made on the rank at "
                f"{mesh.get_coordinate()} (a state_dict() saved with torch.save on another "
                "rank?); its local rows are that rank's experts. Save and load through "
                "torch.distributed.checkpoint (dcp.save / dcp.load), which keeps every rank's rows"
            )
        if mesh == canonical[0] and placements == canonical[1]:
            local = value.to_local()
        elif any(mesh == k for k in known):
            # A full tensor distributed over one of this layout's meshes another way (what
            # set_model_state_dict(full_state_dict=True) makes of FSDP's mesh): regather it.
            local = value.full_tensor()[rows[0] : rows[1]]
        else:
            raise IntegrationError(
                f"{what}: expected a DTensor over this rank's EP mesh {canonical[0]} "
                f"{canonical[1]}, received {placements} over {mesh}; load through "
                "torch.distributed.checkpoint into this model's own state dict "
                "(get_model_state_dict / get_optimizer_state_dict)"
            )
    else:
        local = value[rows[0] : rows[1]]
    if tuple(local.shape) != tuple(local_param.shape):
        raise IntegrationError(
            f"{what}: expected this rank's rows of shape {list(local_param.shape)}, received "
            f"{list(local.shape)}"
        )
    if grid is None:
        return local
    return DTensor.from_local(
        local,
        grid.mesh,
        (Shard(0),),
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )


# ----------------------------------------------------------------------------- module hooks


def _state_dict_post_hook(
    module: nn.Module, state_dict: dict[str, object], prefix: str, local_metadata: object
) -> None:
    del local_metadata
    _convert_entries(module, state_dict, prefix, "state_dict", _to_global)


def _load_pre_hook(
    module: nn.Module,
    state_dict: dict[str, object],
    prefix: str,
    local_metadata: object,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    del local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    _convert_entries(module, state_dict, prefix, "load_state_dict", _to_local)


def _convert_entries(
    module: nn.Module,
    state_dict: dict[str, object],
    prefix: str,
    where: str,
    convert: Callable[[ExpertShards, Tensor, Tensor, str], Tensor],
) -> None:
    """``convert`` each of ``module``'s expert tensors in ``state_dict`` (under ``prefix``)."""
    shards = expert_shards(module)
    if shards is None:
        return
    for name in shards.names:
        key = prefix + name
        value = state_dict.get(key)
        if isinstance(value, Tensor):
            state_dict[key] = convert(shards, value, _parameter(module, name, where), key)


# -------------------------------------------------------------------------- optimizer hooks


def _expert_parameters() -> dict[int, tuple[ExpertShards, Tensor, str]]:
    """``id(param) -> (shards, param, name)`` of every registered module's experts."""
    out: dict[int, tuple[ExpertShards, Tensor, str]] = {}
    for module in list(_MODULES):
        shards = expert_shards(module)
        if shards is None:
            continue
        for name in shards.names:
            p = _parameter(module, name, "optimizer state_dict")
            out[id(p)] = (shards, p, f"{type(module).__name__}.{name}")
    return out


def _convert_state(
    state: Mapping[object, object],
    params: Mapping[object, Tensor],
    convert: Callable[[ExpertShards, Tensor, Tensor, str], Tensor],
) -> dict[object, object] | None:
    experts = _expert_parameters()
    if not experts:
        return None
    out: dict[object, object] = dict(state)
    for key, per_param in state.items():
        p = params.get(key)
        found = experts.get(id(p)) if p is not None else None
        if found is None or not isinstance(per_param, Mapping):
            continue
        shards, param, label = found
        entries = cast("Mapping[str, object]", per_param)
        new: dict[str, object] = {}
        for k, v in entries.items():
            if isinstance(v, Tensor) and v.dim() > 0:
                v = convert(shards, v, param, f"optimizer state {k!r} of {label}")
            new[k] = v
        out[key] = new
    return out


def _optimizer_state_dict_post_hook(
    optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
) -> dict[str, Any] | None:
    ordered = list(chain.from_iterable(g["params"] for g in optimizer.param_groups))
    params: dict[object, Tensor] = {i: cast(Tensor, p) for i, p in enumerate(ordered)}
    state = cast("Mapping[object, object]", state_dict.get("state", {}))
    converted = _convert_state(state, params, _to_global)
    if converted is None:
        return None
    return {**state_dict, "state": converted}


def _optimizer_load_pre_hook(
    optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
) -> dict[str, Any] | None:
    saved = state_dict.get("param_groups")
    state = state_dict.get("state")
    if not isinstance(saved, list) or not isinstance(state, Mapping):
        return None  # torch's own load reports the malformed state dict
    groups = cast("list[Mapping[str, list[object]]]", saved)
    current = chain.from_iterable(g["params"] for g in optimizer.param_groups)
    keys = chain.from_iterable(g["params"] for g in groups)
    params: dict[object, Tensor] = {k: cast(Tensor, p) for k, p in zip(keys, current, strict=False)}
    converted = _convert_state(cast("Mapping[object, object]", state), params, _to_local)
    if converted is None:
        return None
    return {**state_dict, "state": converted}
