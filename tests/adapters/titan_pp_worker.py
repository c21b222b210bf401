"""One rank of the torchtitan pipeline tests: ``python -m tests.adapters.titan_pp_worker``.

Reads ``RANK``, ``WORLD_SIZE``, ``MASTER_*`` and ``TITAN_PP_CASE`` (JSON: ``ep`` the
expert-parallel degree, 1 or 2; ``runs``, each a ``schedule`` (torchtitan's name),
``delay`` (delayed weight gradients) and ``ac`` (torchtitan's ``SelectiveAC`` on every
chunk)). The pipeline degree is ``WORLD_SIZE / ep``. Prints one JSON line per run with
this rank's verdict.

Everything pipeline-side is torchtitan's own: its module-FQN split
(``_generate_llm_fqn_per_model_part``, then ``_pipeline_module_split``, which deep-copies
the model per stage and builds torch's ``PipelineStage`` s, V-shaped for DualPipeV), its
schedule builder (``_build_pipeline_schedule``: ``scale_grads=False``, its loss returning
``(loss, metrics)`` with ``global_valid_tokens``) and its ``CrossEntropyLoss``; with
``ep=2`` each chunk is parallelized by torchtitan (``chunk.parallelize(parallel_dims)``, as
``pipeline_llm`` runs its parallelize function per chunk) on a ``pp x ep`` mesh. Each stage's
chunk is then wrapped (``stage.submod = TorchtitanMoEStage(TorchtitanMoEAdapter(chunk))``)
and the same schedule runs twice: as torch executes it, and prepared by
``prepare_schedule``. Verdicts: bit-identical losses and gradients (and
``tokens_per_expert_E``); and torch's execution of torchtitan's raw chunks (no adapter),
bit for bit too. With ``ac`` the references run without checkpointing (see
:func:`run_case`) and the counts are compared doubled. The two references depend on
the schedule only (not on ``delay`` or ``ac``): they are stepped once per schedule name
and each run of that schedule is compared with them.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe_overlap.adapters.torchtitan import TorchtitanMoEAdapter, TorchtitanMoEStage
from moe_overlap.integrations.pipelining import prepare_schedule
from tests.adapters._titan import batch, build, causal_stand_in
from tests.gloo_ranks import exit_worker

FAMILY = "deepseek_v3"
LAYERS = 4
MICROBATCHES = 4


def dims_for(pp: int, ep: int) -> Any:
    """torchtitan's ``ParallelDims`` on CPU for ``pp x ep``, meshes built."""
    import torchtitan.distributed.parallel_dims as titan_dims
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    parallelism = ParallelismConfig(
        pipeline_parallel_degree=pp, expert_parallel_degree=ep, spmd_backend="partial_dtensor"
    )
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    titan_dims.device_type = "cpu"
    dims = ParallelDims.from_config(parallelism, pp * ep)
    dims.build_mesh()
    return dims


def whole_model(ep: int) -> nn.Module:
    """The test model (every rank the same weights); with ``ep > 1`` its config carries
    torchtitan's expert-parallel sharding configs."""
    if ep == 1:
        return causal_stand_in(build(FAMILY, layers=LAYERS))
    import importlib

    from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config

    from tests.adapters._titan import FAMILIES, shrink

    module, flavor = FAMILIES[FAMILY]
    config = shrink(importlib.import_module(module).model_registry(flavor).model, layers=LAYERS)
    set_deepseek_v3_sharding_config(config, enable_sp=True, enable_ep=True)
    torch.manual_seed(0)
    model = cast(nn.Module, config.build())
    cast(Any, model).init_states(buffer_device=torch.device("cpu"))
    return causal_stand_in(model)


def split(
    model: nn.Module, dims: Any, schedule: str, ep: int, *, ac: bool
) -> tuple[list[Any], list[nn.Module]]:
    """torchtitan's stages and chunks of ``model`` for ``schedule`` (2 stages per rank),
    parallelized as torchtitan's parallelize functions do: expert parallelism, then
    selective activation checkpointing (``ac``)."""
    from torchtitan.distributed.pipeline_parallel import (
        _generate_llm_fqn_per_model_part,
        _pipeline_module_split,
    )

    pp = dims.pp
    names = _generate_llm_fqn_per_model_part(2 * pp, LAYERS, 1, 1)
    stages, chunks = _pipeline_module_split(
        model, dims.get_mesh("pp"), schedule, torch.device("cpu"), names
    )
    for chunk in chunks:
        if ep > 1:
            cast(Any, chunk).parallelize(dims)
        if ac:
            from torchtitan.distributed.activation_checkpoint import SelectiveAC

            SelectiveAC(SelectiveAC.Config()).apply(chunk)
    return stages, chunks


def titan_schedule(stages: list[Any], schedule: str, pp: int) -> Any:
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed.pipeline_parallel import _build_pipeline_schedule

    parallelism = ParallelismConfig(
        pipeline_parallel_degree=pp,
        pipeline_parallel_schedule=schedule,
        pipeline_parallel_microbatch_size=2,
    )
    return _build_pipeline_schedule(
        parallelism=parallelism,
        local_batch_size=2 * MICROBATCHES,
        stages=stages,
        loss_fn=CrossEntropyLoss(CrossEntropyLoss.Config()),
    )


def data(model: nn.Module, dp_rank: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The step's batch (token ids, labels, positions) and its labelled-token count."""
    mbs = batch(model, MICROBATCHES, seed=100 + dp_rank)
    x = torch.cat([m["input_ids"] for m in mbs])
    y = torch.cat([m["labels"] for m in mbs])
    pos = torch.cat([m["position_ids"] for m in mbs])
    return x, y, pos, (y != -100).sum()


def step(schedule: Any, stages: list[Any], x: Tensor, y: Tensor, **kwargs: object) -> list[Tensor]:
    """One training step as torchtitan's trainer takes it (losses from the last stage)."""
    first = any(s.is_first for s in stages)
    last = any(s.is_last for s in stages)
    losses: list[Tensor] = []
    args = (x,) if first else ()
    schedule.step(*args, target=y if last else None, losses=losses if last else None, **kwargs)
    return [loss.detach() for loss in losses]


def local(t: Tensor) -> Tensor:
    to_local = getattr(t, "to_local", None)
    return cast(Tensor, to_local()) if callable(to_local) else t


def state(chunks: list[nn.Module]) -> dict[str, Tensor]:
    """Every gradient and ``tokens_per_expert_E`` of this rank's chunks."""
    out: dict[str, Tensor] = {}
    for i, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            if p.grad is not None:
                out[f"{i}:{name}"] = local(p.grad).clone()
        for name, b in chunk.named_buffers():
            if name.endswith("tokens_per_expert_E"):
                out[f"{i}:{name}"] = local(b).clone()
    return out


def expert_parallel(chunks: list[nn.Module]) -> list[str]:
    """What shows torchtitan's expert parallelism in ``chunks``: each token dispatcher's
    class and mesh, the expert weights' class, and the modules with an instance forward
    (``parallelize``'s wrappers, kept)."""
    found: set[str] = set()
    for chunk in chunks:
        for name, m in chunk.named_modules():
            d = getattr(m, "token_dispatcher", None)
            if d is not None:
                found.add(f"{type(d).__name__} {getattr(d, 'ep_mesh', None)}")
                w = m.get_submodule("inner_experts").get_parameter("w1_EFD")
                found.add(type(w).__name__)
            if "forward" in vars(m) and not name.endswith("_checkpoint_wrapped_module"):
                found.add("instance forward")
    return sorted(found)


def unwrapped(found: dict[str, Tensor]) -> dict[str, Tensor]:
    """``found`` under the names without torch's checkpoint wrapper."""
    return {k.replace("._checkpoint_wrapped_module", ""): v for k, v in found.items()}


def worst(a: dict[str, Tensor], b: dict[str, Tensor]) -> tuple[float, float, str]:
    """Largest relative difference of dense and of expert gradients, and where."""
    dense, expert, where = 0.0, 0.0, ""
    for k in a:
        d = float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-30))
        if "inner_experts" in k:
            expert = max(expert, d)
        elif d > dense:
            dense, where = d, k
    return dense, expert, where


def adapted(
    model: nn.Module, dims: Any, run: dict[str, Any], *, delay: bool
) -> tuple[Any, list[Any], list[nn.Module]]:
    """torchtitan's schedule over its stages, each chunk wrapped in a stage module."""
    name, ep = run["schedule"], dims.ep
    stages, chunks = split(model, dims, name, ep, ac=run["ac"])
    for s, chunk in zip(stages, chunks, strict=True):
        s.submod = TorchtitanMoEStage(TorchtitanMoEAdapter(chunk, delay_wgrad_compute=delay))
    return titan_schedule(stages, name, dims.pp), stages, chunks


def main() -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    case: dict[str, Any] = json.loads(os.environ["TITAN_PP_CASE"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ep = int(case["ep"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    dims = dims_for(world // ep, ep)
    model = whole_model(ep)
    cache: dict[str, References] = {}
    for run in case["runs"]:
        print(json.dumps(run_case(model, dims, run, rank, cache)), flush=True)
    dist.barrier()  # leave together (a failed rank exits at once: its peers time out)
    dist.destroy_process_group()


References = tuple[list[Tensor], dict[str, Tensor], list[Tensor], dict[str, Tensor]]
"""The two references' losses and states (:func:`state`, unwrapped) of one schedule."""


def references(
    model: nn.Module, dims: Any, name: str, x: Tensor, y: Tensor, pos: Tensor, kw: Any
) -> References:
    """The step of schedule ``name`` as torch executes the adapted stages (delayed weight
    gradients off) and as it executes torchtitan's own chunks. Neither depends on a run's
    ``delay`` or ``ac``: :func:`main` takes them once per schedule."""
    # torch's own execution of DualPipeV cannot run checkpointed stages (its split backward
    # runs a selectively checkpointed region's backward twice, which torch refuses): the
    # references run the same stages without checkpointing, which changes no value.
    plain_run = {"schedule": name, "ac": False}
    torch_sched, torch_stages, torch_chunks = adapted(model, dims, plain_run, delay=False)
    ref = step(torch_sched, torch_stages, x, y, position_ids=pos, **kw)
    raw_stages, raw_chunks = split(model, dims, name, dims.ep, ac=False)
    raw_sched = titan_schedule(raw_stages, name, dims.pp)
    raw = step(raw_sched, raw_stages, x, y, positions=pos, **kw)
    return ref, unwrapped(state(torch_chunks)), raw, unwrapped(state(raw_chunks))


def run_case(
    model: nn.Module,
    dims: Any,
    run: dict[str, Any],
    rank: int,
    cache: dict[str, References] | None = None,
) -> dict[str, Any]:
    """One step three ways: torch's execution of the adapted stages, the prepared
    schedule, torch's execution of torchtitan's own chunks (the two references taken
    once per schedule name in ``cache``; every run steps from the same ``model``)."""
    start = time.perf_counter()
    name = run["schedule"]
    x, y, pos, tokens = data(model, rank % dims.ep)  # torchtitan's mesh: pp outermost
    kw = {"loss_kwargs": {"global_valid_tokens": tokens}}
    cache = {} if cache is None else cache
    if name not in cache:
        cache[name] = references(model, dims, name, x, y, pos, kw)
    ref, b, raw, r = cache[name]
    b, r = dict(b), dict(r)  # the counts are doubled below for this run only
    ours, our_stages, our_chunks = adapted(model, dims, run, delay=run["delay"])
    overlap = prepare_schedule(ours, pair=name != "DualPipeV")
    got = step(ours, our_stages, x, y, position_ids=pos, **kw)
    a = unwrapped(state(our_chunks))
    if run["ac"]:  # recomputation counts every token twice, as under torchtitan's wrapper
        for refs in (b, r):
            refs.update({k: 2 * v for k, v in refs.items() if k.endswith("tokens_per_expert_E")})
    bit = (
        len(got) == len(ref)
        and all(torch.equal(p, q) for p, q in zip(got, ref, strict=True))
        and list(a) == list(b)
        and all(torch.equal(a[k], b[k]) for k in a)
    )
    dense, expert, where = worst(b, r)
    loss_diff = max((abs(float(p) - float(q)) for p, q in zip(ref, raw, strict=True)), default=0.0)
    return {
        **run,
        "rank": rank,
        "bit_identical": bit,
        "differ": [k for k in a if k in b and not torch.equal(a[k], b[k])][:5],
        "stages": [s.stage_index for s in our_stages],
        "modules": [[n for n, _ in s.submod.named_children()] for s in our_stages],
        "paired": overlap.paired,
        "losses": [float(v) for v in got],
        "states": len(a),
        "vs_torchtitan_ok": all(torch.equal(p, q) for p, q in zip(ref, raw, strict=True))
        and list(b) == list(r)
        and all(torch.equal(b[k], r[k]) for k in b),
        "vs_torchtitan": [loss_diff, dense, expert, where],
        "pending": sum(s.submod.pending_wgrad for s in our_stages),
        "ep": expert_parallel(our_chunks),
        "checkpointed": sum(
            type(m).__name__ == "CheckpointWrapper" for c in our_chunks for m in c.modules()
        ),
        "seconds": round(time.perf_counter() - start, 2),
    }


if __name__ == "__main__":
    exit_worker(main)
