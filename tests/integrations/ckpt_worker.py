"""The EP and FSDP2 x EP parts of the checkpoint launches (``ckpt_launch_worker.py``).

Each part prints one JSON line per check: ``{"rank", "check", "ok", ...}`` (``rank``: the
global rank). ``group`` is the EP group of the part's ranks (two ranks of a larger world:
every collective and DCP call is over it).

- ``phase_save`` (2 ranks): the reference model at EP=2 trains 2 steps (combined_1f1b,
  AdamW) and saves model and optimizer with DCP; an uninterrupted copy trains 4 steps and
  writes what steps 3-4 give (losses, gradients, parameters). The same at EP=1
  (replicated), and the tiny Mixtral adapter at EP=2. The saved global tensors go to
  ``*_full.pt``.
- ``phase_fsdp_save`` / ``phase_fsdp_resume`` (4 ranks): the same under FSDP2 x EP
  (DP=2 x EP=2).
- ``phase_load`` (2 ranks, fresh processes): resume EP=2 and train on; EP=2 -> EP=1,
  EP=1 -> EP=2, FSDP2 DP=2 -> DP=1 (x EP=2), the adapter EP=2 -> EP=1; the refusals.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.device_mesh import DeviceMesh

from moe_overlap import ConfigError, IntegrationError, Microbatch, combined_1f1b
from moe_overlap.integrations.checkpoint import (
    attach_optimizer,
    register_expert_shards,
    register_fsdp_experts,
)
from moe_overlap.models import GPTMoEConfig, GPTMoEModel, MoELayer

CONFIG = GPTMoEConfig(
    hidden_size=16,
    num_layers=2,
    first_k_dense=1,
    num_attention_heads=2,
    ffn_hidden_size=32,
    num_experts=4,
    moe_ffn_hidden_size=8,
    vocab_size=64,
    seed=3,
)
FSDP_CONFIG = GPTMoEConfig(
    hidden_size=16,
    num_layers=2,
    first_k_dense=1,
    num_attention_heads=2,
    ffn_hidden_size=32,
    num_experts=6,  # 3 per EP rank: FSDP's DP=2 chunks are uneven (2 + 1)
    moe_ffn_hidden_size=8,
    vocab_size=64,
    seed=4,
)
FULL = StateDictOptions(full_state_dict=True)


def report(check: str, ok: bool, **extra: object) -> None:
    row = {"rank": dist.get_rank(), "check": check, "ok": bool(ok), **extra}
    print(json.dumps(row), flush=True)


def data(step: int, rank: int) -> list[Microbatch]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    out = []
    for _ in range(2):
        x = torch.randint(0, 64, (2, 8), generator=g)
        out.append(Microbatch(input_ids=x, labels=x.roll(-1, 1)))
    return out


def local(t: Tensor) -> Tensor:
    to_local: Any = getattr(t, "to_local", None)
    return cast(Tensor, to_local()) if callable(to_local) else t


def average_dense(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Data parallelism of the replicated (non-expert, non-FSDP) parameters, as DDP would:
    the mean of their gradients over ``group``'s ranks, so the replicas stay identical (DCP
    keeps one copy of a tensor every rank holds under the same name)."""
    world = dist.get_world_size(group)
    for name, p in model.named_parameters():
        if p.grad is None or "experts." in name or hasattr(p, "to_local"):
            continue
        dist.all_reduce(p.grad, group=group)
        p.grad.div_(world)


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train(
    model: GPTMoEModel,
    opt: torch.optim.Optimizer,
    steps: range,
    data_rank: int,
    group: dist.ProcessGroup,
) -> dict[str, Tensor]:
    """``steps`` of combined_1f1b + AdamW (the dense gradients averaged over ``group``);
    the losses, gradients and parameters seen."""
    seen: dict[str, Tensor] = {}
    for step in steps:
        losses = combined_1f1b(model, data(step, data_rank))
        seen[f"loss{step}"] = torch.stack([x.detach() for x in losses])
        average_dense(model, group)
        for name, p in model.named_parameters():
            assert p.grad is not None, name
            seen[f"grad{step}.{name}"] = local(p.grad).detach().clone()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for name, p in model.named_parameters():
        seen[f"param.{name}"] = local(p).detach().clone()
    return seen


def save(
    model: nn.Module, opt: torch.optim.Optimizer, path: Path, group: dist.ProcessGroup
) -> None:
    """DCP save of model and optimizer over ``group``, and their global tensors (its rank
    0) beside it."""
    msd, osd = get_state_dict(model, opt)
    dcp_save({"model": msd, "optim": osd}, checkpoint_id=str(path), process_group=group)
    full_m = get_model_state_dict(model, options=FULL)
    full_o = get_optimizer_state_dict(model, opt, options=FULL)
    if dist.get_rank(group) == 0:
        torch.save({"model": full_m, "optim": full_o["state"]}, f"{path}_full.pt")


def load(
    model: nn.Module, opt: torch.optim.Optimizer, path: Path, group: dist.ProcessGroup
) -> None:
    msd, osd = get_state_dict(model, opt)
    dcp_load({"model": msd, "optim": osd}, checkpoint_id=str(path), process_group=group)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)


def flat(state: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Tensor]]:
    for k, v in state.items():
        if isinstance(v, dict):
            yield from flat(cast("dict[str, Any]", v), f"{prefix}{k}.")
        elif isinstance(v, Tensor):
            yield f"{prefix}{k}", v


def equal_to_saved(model: nn.Module, opt: torch.optim.Optimizer, path: Path) -> list[str]:
    """Names whose loaded global tensor differs from the saved one (bit for bit)."""
    saved = torch.load(f"{path}_full.pt", weights_only=False)
    now = {
        "model": get_model_state_dict(model, options=FULL),
        "optim": get_optimizer_state_dict(model, opt, options=FULL)["state"],
    }
    want, got = dict(flat(saved)), dict(flat(now))
    bad = sorted(set(want) ^ set(got))
    bad += [k for k in want if k in got and not torch.equal(local(want[k]), local(got[k]))]
    return bad


def from_step(seen: dict[str, Tensor], first: int) -> dict[str, Tensor]:
    """What a run resumed before step ``first`` sees: later losses and gradients, the
    final parameters."""
    earlier = tuple(f"{kind}{s}" for s in range(first) for kind in ("loss", "grad"))
    return {k: v for k, v in seen.items() if k.split(".")[0] not in earlier}


def same(a: dict[str, Tensor], b: dict[str, Tensor]) -> list[str]:
    bad = sorted(set(a) ^ set(b))
    return bad + [k for k in a if k in b and not torch.equal(a[k], b[k])]


# ---------------------------------------------------------------------------------- phases


def phase_save(root: Path, group: dist.ProcessGroup) -> None:
    rank = dist.get_rank(group)
    # EP=2: uninterrupted 4 steps, and 2 steps then save.
    ref = GPTMoEModel(CONFIG, ep_group=group)
    expect = train(ref, optimizer(ref), range(4), rank, group)
    torch.save(from_step(expect, 2), root / f"expect{rank}.pt")
    model = GPTMoEModel(CONFIG, ep_group=group)
    opt = optimizer(model)
    train(model, opt, range(2), rank, group)
    sd = model.state_dict()
    experts = [k for k, v in sd.items() if type(v).__name__ == "DTensor"]
    report(
        "experts_are_dtensors",
        experts == ["decoder.layers.1.experts.fc1.weight", "decoder.layers.1.experts.fc2.weight"]
        and all(sd[k].shape[0] == CONFIG.num_experts for k in experts),
        experts=experts,
    )
    osd = opt.state_dict()["state"]
    report(
        "optimizer_states_are_dtensors",
        sum(type(v).__name__ == "DTensor" for s in osd.values() for v in s.values()) == 4,
    )
    # Plain state_dict round trip on the same rank: the DTensors come back as local rows.
    twin = GPTMoEModel(CONFIG, ep_group=group)
    twin.load_state_dict(model.state_dict())
    report(
        "plain_round_trip",
        same(dict(model.named_parameters()), dict(twin.named_parameters())) == [],
    )
    save(model, opt, root / "ep2", group)
    # EP=1, replicated on both ranks (same data): DCP keeps one copy of each tensor.
    one = GPTMoEModel(CONFIG)
    opt1 = optimizer(one)
    train(one, opt1, range(2), 0, group)
    report("ep1_state_dict_plain", all(type(v) is Tensor for v in one.state_dict().values()))
    save(one, opt1, root / "ep1", group)
    # The transformers adapter at EP=2.
    hf_save(root, group)


def hf_model() -> nn.Module:
    from tests.adapters._hf import mixtral

    return mixtral(seed=5)


def hf_train(
    adapter: Any,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    steps: range,
    group: dist.ProcessGroup,
) -> dict[str, Tensor]:
    from tests.adapters._hf import microbatches

    seen: dict[str, Tensor] = {}
    for step in steps:
        seed = 100 * step + dist.get_rank(group)
        losses = combined_1f1b(adapter, microbatches(2, seed=seed))
        seen[f"loss{step}"] = torch.stack([x.detach() for x in losses])
        average_dense(model, group)
        for name, p in model.named_parameters():
            if p.grad is not None:
                seen[f"grad{step}.{name}"] = p.grad.detach().clone()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for name, p in model.named_parameters():
        seen[f"param.{name}"] = p.detach().clone()
    return seen


def hf_save(root: Path, group: dist.ProcessGroup) -> None:
    from moe_overlap.adapters.transformers import TransformersMoEAdapter, gather_experts

    ref = hf_model()
    adapter = TransformersMoEAdapter(ref, ep_group=group)
    expect = hf_train(adapter, ref, optimizer(ref), range(2), group)
    torch.save(from_step(expect, 1), root / f"hf_expect{dist.get_rank(group)}.pt")
    model = hf_model()
    adapter = TransformersMoEAdapter(model, ep_group=group)
    opt = optimizer(model)
    hf_train(adapter, model, opt, range(1), group)
    msd, osd = get_state_dict(model, opt)
    dcp_save({"model": msd, "optim": osd}, checkpoint_id=str(root / "hf"), process_group=group)
    full = gather_experts(model, group)
    if dist.get_rank(group) == 0:
        torch.save(full, root / "hf_gathered.pt")


def phase_load(root: Path, group: dist.ProcessGroup, dp1: FsdpLayout) -> None:
    """``dp1``: FSDP2 DP=1 x EP=2 on ``group``'s ranks."""
    rank = dist.get_rank(group)
    # Resume EP=2 in fresh processes, train on: bit-identical to the uninterrupted run.
    model = GPTMoEModel(CONFIG, ep_group=group)
    opt = optimizer(model)
    load(model, opt, root / "ep2", group)
    report("ep2_loaded_equals_saved", equal_to_saved(model, opt, root / "ep2") == [])
    got = train(model, opt, range(2, 4), rank, group)
    bad = same(got, torch.load(root / f"expect{rank}.pt"))
    report("ep2_resume_bit_identical", bad == [], differs=bad[:5])
    # EP=2 -> EP=1 (every rank the whole model).
    one = GPTMoEModel(CONFIG)
    opt1 = optimizer(one)
    load(one, opt1, root / "ep2", group)
    bad = equal_to_saved(one, opt1, root / "ep2")
    report("ep2_to_ep1", bad == [], differs=bad[:5])
    report("ep1_plain_tensors", all(type(v) is Tensor for v in one.state_dict().values()))
    # EP=1 -> EP=2.
    two = GPTMoEModel(CONFIG, ep_group=group)
    opt2 = optimizer(two)
    load(two, opt2, root / "ep1", group)
    bad = equal_to_saved(two, opt2, root / "ep1")
    report("ep1_to_ep2", bad == [], differs=bad[:5])
    # FSDP2 DP=2 x EP=2 -> DP=1 x EP=2.
    fsdp = fsdp_model(dp1)
    optf = optimizer(fsdp)
    load(fsdp, optf, root / "fsdp", group)
    bad = equal_to_saved(fsdp, optf, root / "fsdp")
    report("fsdp_dp2_to_dp1", bad == [], differs=bad[:5])
    hf_load(root, group)
    refusals(root, group)
    misuse(group)


def hf_load(root: Path, group: dist.ProcessGroup) -> None:
    from moe_overlap.adapters.transformers import TransformersMoEAdapter

    # EP=2, fresh: load and train on, bit-identical to the uninterrupted run.
    model = hf_model()
    adapter = TransformersMoEAdapter(model, ep_group=group)
    opt = optimizer(model)
    load(model, opt, root / "hf", group)
    got = hf_train(adapter, model, opt, range(1, 2), group)
    bad = same(got, torch.load(root / f"hf_expect{dist.get_rank(group)}.pt"))
    report("hf_resume_bit_identical", bad == [], differs=bad[:5])
    # EP=2 -> EP=1: the full model equals gather_experts of the saved one.
    model = hf_model()
    TransformersMoEAdapter(model)  # EP=1
    opt = optimizer(model)
    load(model, opt, root / "hf", group)
    bad = same(model.state_dict(), torch.load(root / "hf_gathered.pt"))
    report("hf_ep2_to_ep1_equals_gather_experts", bad == [], differs=bad[:5])


def refusals(root: Path, group: dist.ProcessGroup) -> None:
    from moe_overlap.integrations.fsdp import fully_shard_slots

    model = GPTMoEModel(CONFIG, ep_group=group)
    rank = dist.get_rank(group)
    # Rank 0's state_dict() through torch.save, loaded on every rank: rank 1 would get
    # rank 0's experts; refused there, exact on rank 0.
    if rank == 0:
        torch.save(model.state_dict(), root / "rank0_state_dict.pt")
    dist.barrier(group=group)
    rank0 = torch.load(root / "rank0_state_dict.pt", weights_only=False)
    message = expect_error(
        IntegrationError, lambda: GPTMoEModel(CONFIG, ep_group=group).load_state_dict(rank0)
    )
    report(
        "other_rank_state_dict_refused",
        message == "no error" if rank == 0 else "made on the rank at (0,)" in message,
        message=message,
    )
    key = "decoder.layers.1.experts.fc1.weight"
    local_rows = model.state_dict()[key].to_local().clone()
    sd = {k: v for k, v in model.state_dict().items()}
    sd[key] = local_rows
    message = expect_error(IntegrationError, lambda: model.load_state_dict(sd))
    report("local_rows_refused", "which EP rank's cannot be said" in message, message=message)
    # A full tensor is sliced exactly.
    full = torch.arange(float(CONFIG.num_experts)).view(-1, 1, 1).expand(-1, 16, 16).clone()
    sd[key] = full
    model.load_state_dict(sd)
    layer = model.layer_list[1]
    assert isinstance(layer, MoELayer)
    rows = layer.experts.fc1.weight
    report("full_tensor_sliced", torch.equal(rows, full[2 * rank : 2 * rank + 2]))
    message = expect_error(
        ConfigError, lambda: fully_shard_slots(GPTMoEModel(CONFIG, ep_group=group))
    )
    report(
        "fsdp_without_expert_mesh_refused", "expected an expert_mesh" in message, message=message
    )
    # An optimizer whose state is not the parameter's shape (one value per expert row).
    opt = torch.optim.Adagrad(model.parameters())  # state from construction, no step yet
    attach_optimizer(opt)
    index = [id(p) for p in model.parameters()].index(id(rows))
    summed = opt.state_dict()["state"][index]["sum"]
    report(
        "adagrad_state_attached",
        type(summed).__name__ == "DTensor" and summed.shape[0] == CONFIG.num_experts,
    )
    opt.state[rows]["per_row"] = torch.zeros(rows.shape[0])
    message = expect_error(IntegrationError, lambda: opt.state_dict())
    report(
        "odd_optimizer_state_refused", "cannot be checkpointed exactly" in message, message=message
    )


def misuse(group: dist.ProcessGroup) -> None:
    import copy

    message = expect_error(
        ConfigError,
        lambda: register_expert_shards(nn.Linear(3, 3), ["weight"], num_experts=4, group=group),
    )
    report(
        "register_wrong_shape_refused", "expected 2 experts on dim 0" in message, message=message
    )
    message = expect_error(
        ConfigError,
        lambda: register_fsdp_experts([nn.Linear(3, 3)], DeviceMesh.from_group(group, "cpu")),
    )
    report("fsdp_unregistered_refused", "register_expert_shards" in message, message=message)
    # A deep copy of an expert-sharded module: its optimizer still finds the experts.
    experts = nn.Linear(3, 2, bias=False)
    register_expert_shards(experts, ["weight"], num_experts=4, group=group)
    twin = copy.deepcopy(experts)
    opt = torch.optim.AdamW(twin.parameters())
    twin.weight.grad = torch.ones_like(twin.weight)
    opt.step()
    state = opt.state_dict()["state"][0]["exp_avg"]
    report(
        "deepcopy_keeps_optimizer_exposure",
        type(state).__name__ == "DTensor" and tuple(state.shape) == (4, 3),
        sd=type(twin.state_dict()["weight"]).__name__,
    )


def expect_error(kind: type[Exception], fn: Callable[[], object]) -> str:
    try:
        fn()
    except kind as exc:
        return str(exc)
    return "no error"


# ------------------------------------------------------------------------------------ FSDP


@dataclass(frozen=True)
class FsdpLayout:
    """FSDP2 DP x EP: this rank's EP group, the dense data-parallel mesh and the mesh of
    the ranks holding the same experts."""

    ep: dist.ProcessGroup
    mesh: DeviceMesh
    expert_mesh: DeviceMesh


def world_layout(*, dp: int, ep: int) -> FsdpLayout:
    """DP x EP over every rank (a collective: every rank makes every group)."""
    from torch.distributed.device_mesh import init_device_mesh

    d = dist.get_rank() // ep
    groups = [
        cast(dist.ProcessGroup, dist.new_group([dd * ep + e for e in range(ep)]))
        for dd in range(dp)
    ]
    mesh = init_device_mesh("cpu", (dp * ep,))
    expert_mesh = init_device_mesh("cpu", (dp, ep), mesh_dim_names=("dp", "ep"))["dp"]
    return FsdpLayout(groups[d], mesh, expert_mesh)


def ep_only_layout(group: dist.ProcessGroup, alone: dist.ProcessGroup) -> FsdpLayout:
    """DP=1 x EP over ``group``'s ranks (``alone``: a group of this rank only); makes no
    group."""
    return FsdpLayout(
        group, DeviceMesh.from_group(group, "cpu"), DeviceMesh.from_group(alone, "cpu")
    )


def fsdp_model(layout: FsdpLayout) -> GPTMoEModel:
    from moe_overlap.integrations.fsdp import fully_shard_slots

    model = GPTMoEModel(FSDP_CONFIG, ep_group=layout.ep)
    fully_shard_slots(model, mesh=layout.mesh, expert_mesh=layout.expert_mesh)
    return model


def phase_fsdp_save(root: Path) -> None:
    rank, world = dist.get_rank(), ep_world()
    ref = fsdp_model(world_layout(dp=2, ep=2))
    expect = train(ref, optimizer(ref), range(4), rank, world)
    torch.save(from_step(expect, 2), root / f"fsdp_expect{rank}.pt")
    model = fsdp_model(world_layout(dp=2, ep=2))
    opt = optimizer(model)
    train(model, opt, range(2), rank, world)
    sd = model.state_dict()
    key = "decoder.layers.1.experts.fc1.weight"
    v = sd[key]
    report(
        "fsdp_experts_2d",
        v.shape[0] == FSDP_CONFIG.num_experts and getattr(v, "device_mesh").ndim == 2,  # noqa: B009
        shape=list(v.shape),
    )
    save(model, opt, root / "fsdp", world)


def phase_fsdp_resume(root: Path) -> None:
    rank, world = dist.get_rank(), ep_world()
    model = fsdp_model(world_layout(dp=2, ep=2))
    opt = optimizer(model)
    load(model, opt, root / "fsdp", world)
    report("fsdp_loaded_equals_saved", equal_to_saved(model, opt, root / "fsdp") == [])
    got = train(model, opt, range(2, 4), rank, world)
    bad = same(got, torch.load(root / f"fsdp_expect{rank}.pt"))
    report("fsdp_resume_bit_identical", bad == [], differs=bad[:5])


def ep_world() -> dist.ProcessGroup:
    group = dist.group.WORLD
    assert group is not None
    return group
