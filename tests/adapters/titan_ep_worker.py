"""One rank of the torchtitan adapter's EP=2 test: ``python -m tests.adapters.titan_ep_worker``.

Reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``; prints one JSON line
per case with this rank's verdict.

Expert parallelism is torchtitan's own, applied as its trainer and
``parallelize_deepseekv3`` apply it, less FSDP (which the adapter refuses) and on CPU:

1. the model config gets torchtitan's sharding configs
   (``set_deepseek_v3_sharding_config(enable_ep=True)``: what
   ``DeepSeekV3Model.Config.update_from_config`` does; that method itself imports
   ``torchtitan.trainer``, whose data loader needs ``torchdata``, left out on purpose);
2. ``set_spmd_backend("partial_dtensor")`` (what the trainer does with
   ``parallelism.spmd_backend``): DTensor on the model-parallel axes only;
3. ``ParallelDims.from_config(ParallelismConfig(expert_parallel_degree=2, ...))`` and its
   ``build_mesh()``, with ``parallel_dims.device_type`` set to ``"cpu"`` (torchtitan falls
   back to ``"cuda"`` when no accelerator is found);
4. ``model.parallelize(parallel_dims)``: what ``parallelize_deepseekv3`` calls for EP. The
   routed experts become DTensors ``Shard(0)`` over the ``ep`` mesh, and
   ``RoutedExperts.parallelize`` wires that mesh into the model's
   ``AllToAllTokenDispatcher`` (the registry's ``moe_comm_backend="standard"``), whose
   dispatch and combine run ``all_to_all_single`` over gloo.

The registry's flex attention has no backward on CPU: every model gets the test stand-in
(:func:`tests.adapters._titan.causal_stand_in`).
"""

from __future__ import annotations

import importlib
import json
import os
import time
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe_overlap import Microbatch, combined_1f1b
from moe_overlap.adapters.torchtitan import TorchtitanMoEAdapter
from tests.adapters._titan import FAMILIES, batch, build, causal_stand_in, shrink
from tests.gloo_ranks import exit_worker

FAMILY = "deepseek_v3"
LAYERS = 3
MICROBATCHES = 3
LOSS_ATOL = 1e-5
GRAD_RTOL = 1e-4
EXPERT_GRAD_RTOL = 4 * 2**-8
"""torchtitan's ``GroupedExperts`` run their grouped GEMMs in bfloat16, so an expert's
weight gradient is rounded to bfloat16 once per grouped GEMM: under EP both ranks' tokens
meet in one, at EP=1 each rank's are rounded apart and summed. (Forward is per token, so
the losses stay bit-equal.)"""


def parallel_dims(world: int) -> Any:
    """torchtitan's ``ParallelDims`` for EP=2 on CPU, meshes built, backend set."""
    import torchtitan.distributed.parallel_dims as titan_dims
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    parallelism = ParallelismConfig(expert_parallel_degree=world, spmd_backend="partial_dtensor")
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    titan_dims.device_type = "cpu"
    dims = ParallelDims.from_config(parallelism, world)
    dims.build_mesh()
    return dims


def ep_model(dims: Any, *, seed: int = 0) -> nn.Module:
    """:func:`tests.adapters._titan.build`'s model with torchtitan's expert parallelism."""
    from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config

    module, flavor = FAMILIES[FAMILY]
    config = shrink(importlib.import_module(module).model_registry(flavor).model, layers=LAYERS)
    set_deepseek_v3_sharding_config(config, enable_sp=True, enable_ep=True)
    torch.manual_seed(seed)
    model = cast(nn.Module, config.build())
    cast(Any, model).init_states(buffer_device=torch.device("cpu"))
    causal_stand_in(model)
    cast(Any, model).parallelize(dims)
    return model


def instance_forwards(model: nn.Module) -> list[str]:
    """The modules carrying a ``forward`` on the instance (what ``Module.parallelize`` sets
    on the modules with a sharding config): the adapter honours the no-op ones as they are."""
    return [n for n, m in model.named_modules() if "forward" in m.__dict__]


def local(t: Tensor) -> Tensor:
    """A DTensor's local shard; a plain tensor as it is."""
    to_local = getattr(t, "to_local", None)
    return cast(Tensor, to_local()) if callable(to_local) else t


def is_sharded(t: Tensor) -> bool:
    return callable(getattr(t, "to_local", None))


def grads(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter's gradient (its local shard under EP)."""
    out: dict[str, Tensor] = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        out[name] = local(p.grad).clone()
    return out


def counts(model: nn.Module) -> dict[str, Tensor]:
    """Every MoE's ``tokens_per_expert_E`` (torchtitan's load-balancing count)."""
    return {n: b.clone() for n, b in model.named_buffers() if n.endswith("tokens_per_expert_E")}


def microbatches(model: nn.Module, rank: int) -> list[Microbatch]:
    return [
        Microbatch(input_ids=d["input_ids"], position_ids=d["position_ids"], labels=d["labels"])
        for d in batch(model, MICROBATCHES, seed=100 + rank)
    ]


def touched(model: nn.Module) -> list[str]:
    """What construction left on the model: parameters with gradients, nonzero counts."""
    found = [n for n, p in model.named_parameters() if p.grad is not None]
    return found + [n for n, b in counts(model).items() if bool(b.any())]


def reset(model: nn.Module) -> None:
    """No gradients, zero ``tokens_per_expert_E`` (as built)."""
    for p in model.parameters():
        p.grad = None
    for name, b in model.named_buffers():
        if name.endswith("tokens_per_expert_E"):
            b.zero_()


def plain_step(adapter: TorchtitanMoEAdapter, mbs: list[Microbatch]) -> list[Tensor]:
    losses: list[Tensor] = []
    for mb in mbs:
        assert mb.input_ids is not None
        loss = adapter.forward(mb.input_ids, mb.position_ids, mb.labels)
        torch.autograd.backward(loss)
        losses.append(loss.detach().float())
    return losses


def main() -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        start = time.perf_counter()
        dims = parallel_dims(world)
        over_model, plain_model = ep_model(dims), ep_model(dims)
        ref_model = causal_stand_in(build(FAMILY, layers=LAYERS))
        built = time.perf_counter() - start
        mbs = microbatches(over_model, rank)

        moe = over_model.get_submodule("layers.1.moe.routed_experts")
        dispatcher: object = cast(Any, moe).token_dispatcher
        w1 = moe.get_submodule("inner_experts").get_parameter("w1_EFD")
        ref_w1 = ref_model.get_parameter("layers.1.moe.routed_experts.inner_experts.w1_EFD")
        # The EP model holds this rank's slice of the same global experts as the EP=1 one.
        n_local = local(w1).shape[0]
        same_weights = all(
            torch.equal(
                local(p),
                ref_model.get_parameter(n)[rank * n_local : (rank + 1) * n_local]
                if is_sharded(p)
                else ref_model.get_parameter(n),
            )
            for n, p in over_model.named_parameters()
        )
        # The parallelized models as they are: torchtitan's forward wrappers on moe and
        # routed_experts stay (no-ops under EP alone: the adapter checks and honours them).
        # The self-check's float32 copies drop them (they call the original modules).
        wrapped = instance_forwards(over_model)
        over = TorchtitanMoEAdapter(over_model, self_check=True)
        self_check_touched = touched(over_model)
        plain = TorchtitanMoEAdapter(plain_model, self_check=False)
        ref = TorchtitanMoEAdapter(ref_model)
        reset(over_model)

        t0 = time.perf_counter()
        lp = plain_step(plain, mbs)
        plain_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        lo = combined_1f1b(over, mbs, options=over.schedule_options())
        overlap_s = time.perf_counter() - t0
        go, gp = grads(over_model), grads(plain_model)
        co, cp = counts(over_model), counts(plain_model)
        bit = (
            all(torch.equal(x, y) for x, y in zip(lo, lp, strict=True))
            and list(go) == list(gp)
            and all(torch.equal(go[k], gp[k]) for k in go)
            and list(co) == list(cp)
            and all(torch.equal(co[k], cp[k]) for k in co)
        )
        print(
            json.dumps(
                {
                    "case": "overlap_vs_plain",
                    "rank": rank,
                    "ok": bit and same_weights,
                    "bit_identical": bit,
                    "same_weights": same_weights,
                    "instance_forwards": wrapped,
                    "self_check": over.self_check_report.structures,
                    "self_check_touched": self_check_touched,
                    "dispatcher": type(dispatcher).__name__,
                    "ep_mesh": str(getattr(dispatcher, "ep_mesh", None)),
                    "expert_weight": type(w1).__name__,
                    "placements": str(getattr(w1, "placements", None)),
                    "local_experts": n_local,
                    "global_experts": int(ref_w1.shape[0]),
                    "num_local_experts": over.decoder.layers[1].num_local_experts,
                    "pending_after": over.pending_wgrad + plain.pending_wgrad,
                    "losses": [float(x) for x in lo],
                    "build_s": round(built, 2),
                    "overlap_s": round(overlap_s, 2),
                    "plain_s": round(plain_s, 2),
                }
            )
        )

        # EP=1: the same global model, the adapter's plain path on this rank's data; its
        # gradients summed over the ranks (every rank's tokens reach every expert, and
        # each rank's dense gradients are of its own data only).
        lr = plain_step(ref, mbs)
        gr = grads(ref_model)
        gsum = {}
        for k, g in go.items():
            if is_sharded(over_model.get_parameter(k)):
                dist.all_reduce(gr[k])
                gr[k] = gr[k][rank * n_local : (rank + 1) * n_local]
                gsum[k] = g
            else:
                gsum[k] = g.clone()
                dist.all_reduce(gsum[k])
                dist.all_reduce(gr[k])
        loss_diff = max(abs(float(x) - float(y)) for x, y in zip(lo, lr, strict=True))
        rel = {
            k: float((gsum[k] - gr[k]).abs().max() / gr[k].abs().max().clamp_min(1e-30))
            for k in gsum
        }
        experts = [k for k in rel if is_sharded(over_model.get_parameter(k))]
        dense = [k for k in rel if k not in experts]
        worst = max(dense, key=lambda k: rel[k])
        worst_expert = max(experts, key=lambda k: rel[k])
        cr = counts(ref_model)
        same_counts = list(co) == list(cr) and all(torch.equal(co[k], cr[k]) for k in co)
        print(
            json.dumps(
                {
                    "case": "ep2_vs_ep1",
                    "rank": rank,
                    "ok": loss_diff <= LOSS_ATOL
                    and rel[worst] <= GRAD_RTOL
                    and rel[worst_expert] <= EXPERT_GRAD_RTOL
                    and same_counts,
                    "loss_diff": loss_diff,
                    "grad_rel_diff": rel[worst],
                    "worst_grad": worst,
                    "expert_grad_rel_diff": rel[worst_expert],
                    "worst_expert_grad": worst_expert,
                    "same_counts": same_counts,
                    "total_s": round(time.perf_counter() - start, 2),
                }
            )
        )
    finally:
        dist.barrier()  # leave together: a rank tearing gloo down alone can abort the other
        dist.destroy_process_group()


if __name__ == "__main__":
    exit_worker(main)
