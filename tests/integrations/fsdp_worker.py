"""One gloo rank of the FSDP2 tests: combined_1f1b on a model sharded by fully_shard_slots.

``FSDP_CASE`` (JSON): ``dp`` x ``ep`` ranks (ranks ``d * ep + e``), ``microbatches``,
``layer_level`` (fully_shard the layers instead) or ``delay`` (delayed weight
gradients): both must be refused, under the macro schedule and a node schedule;
``schedules``: names of :data:`SCHEDULES` (node schedules, the schedule's recompute), each
against plain ``backward()`` (:func:`run_schedules`); or ``{"cases": {name: case}}``: each
case in turn in the one process group (every case the same world size; each builds its own
models, so it runs as it would alone), its rows carrying ``case``. Prints one JSON line per
case: the losses overlapped, one after the other and with plain ``backward()`` on the same
sharding, whether every local gradient shard is bit-identical across the three, and
whether it is within float32 rounding of single-process training of the whole data.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh

from moe_overlap import ConfigError, Microbatch, ScheduleOptions, combined_1f1b
from moe_overlap.integrations.fsdp import fully_shard_slots
from moe_overlap.models import GPTMoEConfig, GPTMoEModel
from moe_overlap.plan import ScheduleGraph, node_schedule, today_orders
from moe_overlap.steps import (
    ChunkShape,
    LayerShape,
    NodeSchedule,
    PairKind,
    PairOrder,
    ScheduleOrder,
    Slot,
)
from tests.engine.test_node_schedule import random_order, with_recomputes
from tests.gloo_ranks import exit_worker

CONFIG = GPTMoEConfig(
    hidden_size=32,
    num_layers=4,
    first_k_dense=1,
    num_experts=4,
    ffn_hidden_size=64,
    moe_ffn_hidden_size=16,
    moe_shared_expert_hidden_size=16,
    seed=2,
)


def data(rank: int, n: int) -> list[Microbatch]:
    g = torch.Generator().manual_seed(50 + rank)
    out = []
    for _ in range(n):
        x = torch.randint(0, 128, (2, 8), generator=g)
        out.append(Microbatch(input_ids=x, labels=x.roll(-1, 1)))
    return out


def local(grad: Tensor | None) -> Tensor | None:
    if grad is None:
        return None
    to_local: Any = getattr(grad, "to_local", None)
    if callable(to_local):
        return cast(Tensor, to_local())
    return grad


def main() -> None:
    config: dict[str, Any] = json.loads(os.environ["FSDP_CASE"])
    dist.init_process_group("gloo")
    if "cases" not in config:
        run_case("", config, Layout(config["dp"], config["ep"]))
        return
    layouts: dict[tuple[int, int], Layout] = {}
    for name, case in config["cases"].items():
        key = (case["dp"], case["ep"])
        layouts.setdefault(key, Layout(*key))
        run_case(name, case, layouts[key])
        dist.barrier()  # the next case starts together (a refused one returns early)


class Layout:
    """The groups and meshes of ``dp`` x ``ep`` ranks (ranks ``d * ep + e``)."""

    def __init__(self, dp: int, ep: int) -> None:
        world = dist.get_world_size()
        assert world == dp * ep
        ep_groups = [dist.new_group([dd * ep + ee for ee in range(ep)]) for dd in range(dp)]
        self.ep_group: Any = ep_groups[dist.get_rank() // ep] if ep > 1 else None
        self.mesh = init_device_mesh("cpu", (world,))
        self.expert_mesh = (
            init_device_mesh("cpu", (dp, ep), mesh_dim_names=("dp", "ep"))["dp"] if ep > 1 else None
        )


def run_case(case_name: str, case: dict[str, Any], layout: Layout) -> None:
    """One case on this rank; prints its JSON line."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ep, n = case["ep"], case["microbatches"]
    e = rank % ep
    ep_group, mesh, expert_mesh = layout.ep_group, layout.mesh, layout.expert_mesh

    config = dataclasses.replace(CONFIG, delay_wgrad_compute=bool(case.get("delay")))

    def build() -> GPTMoEModel:
        model = GPTMoEModel(config, ep_group=ep_group)
        if case.get("layer_level"):
            from torch.distributed.fsdp import fully_shard

            for layer in model.layer_list:
                fully_shard(layer)
        else:
            fully_shard_slots(model, mesh=mesh, expert_mesh=expert_mesh)
        return model

    mbs = data(rank, n)
    if case.get("schedules"):
        run_schedules(case_name, case["schedules"], build, mbs)
        return
    if case.get("layer_level") or case.get("delay"):
        # Refused by the macro schedule and by a node schedule (3 microbatches in flight,
        # W steps with delayed weight gradients) alike.
        node = random_order(shape(delay=config.delay_wgrad_compute), n, seed=2, in_flight=3)
        refused: dict[str, str] = {}
        for key, schedule in (("refused", None), ("refused_node", node)):
            model = build()
            try:
                combined_1f1b(model, mbs, options=model.schedule_options(), schedule=schedule)
            except ConfigError as exc:
                refused[key] = str(exc)
                continue
            raise AssertionError(f"the misplaced FSDP was not refused ({key})")
        print(json.dumps({"case": case_name, "rank": rank, **refused}), flush=True)
        return

    runs: dict[str, tuple[list[float], list[Tensor | None]]] = {}
    for name in ("overlap", "sequential", "plain"):
        model = build()
        if name == "plain":
            losses = []
            for mb in mbs:
                loss = model(mb.input_ids, labels=mb.labels)
                loss.backward()
                losses.append(loss.detach())
        else:
            losses = combined_1f1b(model, mbs, overlap=name == "overlap")
        runs[name] = ([float(v) for v in losses], [local(p.grad) for p in model.parameters()])

    def same(a: list[Tensor | None], b: list[Tensor | None]) -> bool:
        return all(
            (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
            for x, y in zip(a, b, strict=True)
        )

    # Single process, all ranks' data: the mean over replicas of each one's summed losses.
    ref = GPTMoEModel(CONFIG)
    for r in range(world):
        for mb in data(r, n):
            (ref(mb.input_ids, labels=mb.labels) / world).backward()
    close = closeness(runs["overlap"][1], ref, build(), ep_rank=e, ep=ep)
    print(
        json.dumps(
            {
                "case": case_name,
                "rank": rank,
                "losses": runs["overlap"][0],
                "plain_losses": runs["plain"][0],
                "overlap_vs_sequential": same(runs["overlap"][1], runs["sequential"][1]),
                "overlap_vs_plain": same(runs["overlap"][1], runs["plain"][1]),
                "close_to_single_process": close,
            }
        ),
        flush=True,
    )


_RECOMPUTE = (Slot.PRE_DISPATCH, Slot.MLP)
_RC_OPTIONS = ScheduleOptions(recompute=_RECOMPUTE)


def shape(*, delay: bool = False) -> ChunkShape:
    """The step shape of :data:`CONFIG`'s model (with delayed weight gradients: ``delay``)."""
    return ChunkShape(
        layers=tuple(
            LayerShape(index=i, is_moe=i >= CONFIG.first_k_dense, delay_wgrad=delay)
            for i in range(CONFIG.num_layers)
        )
    )


def in_flight(schedule: NodeSchedule) -> int:
    """The most microbatches started and not finished at once in ``schedule``."""
    first: dict[int | None, int] = {}
    last: dict[int | None, int] = {}
    for k, s in enumerate(schedule.steps):
        first.setdefault(s.microbatch, k)
        last[s.microbatch] = k
    return max(sum(first[m] <= k <= last[m] for m in first) for k in range(len(schedule.steps)))


def _planner_fill_drain(n: int) -> NodeSchedule:
    """The planner's fill/drain order with every pre-dispatch and mlp recomputed."""
    moe = tuple(layer.is_moe for layer in shape().layers)
    recompute = frozenset(
        (m, layer, s) for m in range(n) for layer in range(len(moe)) for s in _RECOMPUTE
    )
    graph = ScheduleGraph(microbatches=n, moe=moe, recompute=recompute)
    return node_schedule(today_orders(graph)["fill_drain"])


def _early_r_steps() -> ScheduleOptions:
    """Recompute with the ``R`` steps first in the mixed pair (under the forward's work)."""
    megatron = str(PairOrder.megatron(PairKind.MIXED))
    mixed = PairOrder(PairKind.MIXED, "b.mlp.R b.pre_dispatch.R " + megatron)
    return dataclasses.replace(_RC_OPTIONS, order=ScheduleOrder(mixed=mixed))


Run = Callable[[GPTMoEModel, list[Microbatch]], list[Tensor]]
SCHEDULES: dict[str, Run] = {
    "node": lambda m, mbs: combined_1f1b(
        m, mbs, schedule=random_order(shape(), len(mbs), seed=0, in_flight=3)
    ),
    "node_recompute": lambda m, mbs: combined_1f1b(
        m,
        mbs,
        options=_RC_OPTIONS,
        schedule=with_recomputes(
            random_order(shape(), len(mbs), seed=1, in_flight=3), shape(), seed=1
        ),
    ),
    "planner_fill_drain_recompute": lambda m, mbs: combined_1f1b(
        m, mbs, options=_RC_OPTIONS, schedule=_planner_fill_drain(len(mbs))
    ),
    "recompute": lambda m, mbs: combined_1f1b(m, mbs, options=_RC_OPTIONS),
    "recompute_fill_drain": lambda m, mbs: combined_1f1b(
        m, mbs, options=_RC_OPTIONS, fill_drain=True
    ),
    "recompute_early_r": lambda m, mbs: combined_1f1b(m, mbs, options=_early_r_steps()),
}
"""Each way to run the step that a ``schedules`` case compares with plain ``backward()``."""


def run_schedules(
    case_name: str, names: list[str], build: Callable[[], GPTMoEModel], mbs: list[Microbatch]
) -> None:
    """Each of ``names`` (:data:`SCHEDULES`) on a fresh FSDP2 model against plain
    per-microbatch ``backward()`` on the same sharding; prints one JSON line: per name,
    whether the losses and every local gradient shard are bit-identical (or the error)."""
    model = build()
    plain = []
    for mb in mbs:
        loss = model(mb.input_ids, labels=mb.labels)
        loss.backward()
        plain.append(loss.detach())
    want = [local(p.grad) for p in model.parameters()]
    exact: dict[str, bool | str] = {}
    for name in names:
        model = build()
        try:
            losses = SCHEDULES[name](model, mbs)
        except Exception as exc:  # reported, the test names it
            exact[name] = f"{type(exc).__name__}: {exc}"
            continue
        got = [local(p.grad) for p in model.parameters()]
        exact[name] = all(torch.equal(a, b) for a, b in zip(losses, plain, strict=True)) and all(
            (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
            for x, y in zip(got, want, strict=True)
        )
    schedule = random_order(shape(), len(mbs), seed=1, in_flight=3)
    row = {"case": case_name, "rank": dist.get_rank(), "exact": exact}
    print(
        json.dumps(row | {"in_flight": in_flight(with_recomputes(schedule, shape(), seed=1))}),
        flush=True,
    )


def closeness(
    grads: list[Tensor | None], ref: GPTMoEModel, sharded: nn.Module, *, ep_rank: int, ep: int
) -> bool:
    """Each local shard against the same rows of the single-process gradient."""
    from moe_overlap.blocks import GroupedExperts

    experts = {
        id(p) for m in ref.modules() if isinstance(m, GroupedExperts) for p in m.parameters()
    }
    ok = True
    for (name, p), full, grad in zip(
        sharded.named_parameters(), ref.parameters(), grads, strict=True
    ):
        assert grad is not None, name
        want = full.grad
        assert want is not None, name
        if id(full) in experts and ep > 1:  # this EP rank's experts, then its FSDP shard
            per = want.shape[0] // ep
            want = want[ep_rank * per : (ep_rank + 1) * per]
        placements: Any = getattr(p, "placements", None)
        if placements is not None:  # dim-0 shard of this rank in p's mesh
            mesh: Any = cast(Any, p).device_mesh
            size, index = mesh.size(), mesh.get_local_rank()
            rows = -(-want.shape[0] // size)
            want = want[index * rows : (index + 1) * rows]
        if want.shape != grad.shape or not torch.allclose(grad, want, rtol=1e-4, atol=1e-6):
            ok = False
    return ok


if __name__ == "__main__":
    exit_worker(main)
