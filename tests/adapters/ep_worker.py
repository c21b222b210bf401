"""One rank of the transformers adapter's EP=2 tests: ``python -m tests.adapters.ep_worker``.

Reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``; prints one JSON line
per case with this rank's verdict. The reference is the full (unsharded) model's own
forward on this rank's data; its expert grads are summed over ranks (every rank's tokens
reach the experts) and sliced to this rank's experts.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe_overlap.adapters.transformers import (
    TransformersMoEAdapter,
    expert_parameter_names,
    gather_experts,
    shard_experts,
)
from tests.adapters import families
from tests.adapters._hf import compare, grads, microbatches, mixtral, qwen2_moe, reference_step
from tests.gloo_ranks import exit_worker


def _family(name: str, causal_lm: str) -> Callable[..., nn.Module]:
    def build(**kwargs: object) -> nn.Module:
        del kwargs
        return families.build(name, causal_lm)

    return build


CASES: dict[str, tuple[Callable[..., nn.Module], dict[str, object], bool]] = {
    "mixtral_aux": (mixtral, {"aux": True}, False),
    "mixtral_delay": (mixtral, {}, True),
    "qwen2_moe_mixed_aux_delay": (qwen2_moe, {"aux": True}, True),
    "deepseek_v3": (_family("deepseek_v3", "DeepseekV3ForCausalLM"), {}, False),
    "deepseek_v3_delay": (_family("deepseek_v3", "DeepseekV3ForCausalLM"), {}, True),
    "gpt_oss": (_family("gpt_oss", "GptOssForCausalLM"), {}, False),
    "gpt_oss_delay": (_family("gpt_oss", "GptOssForCausalLM"), {}, True),
}


def _reference(
    model: nn.Module, rank: int, world: int, data_seed: int
) -> tuple[list[Tensor], dict[str, Tensor]]:
    ref = copy.deepcopy(model)
    losses = reference_step(ref, microbatches(3, seed=data_seed))
    g = grads(ref)
    for name in expert_parameter_names(ref):
        dist.all_reduce(g[name])
        local = g[name].shape[0] // world
        g[name] = g[name][rank * local : (rank + 1) * local]
    return losses, g


def main() -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.group.WORLD
    try:
        for name, (build, kwargs, delay) in CASES.items():
            model = build(**kwargs)
            seed = 100 + rank
            losses, ref = _reference(model, rank, world, seed)
            result = compare(
                model,
                microbatches(3, seed=seed),
                delay=delay,
                ref_grads=ref,
                ref_losses=losses,
                ep_group=group,
            )
            row = {"case": name, "rank": rank, "ok": result.ok, **dataclasses.asdict(result)}
            print(json.dumps(row))
        model = qwen2_moe()
        full = {k: v.clone() for k, v in model.state_dict().items()}
        shard_experts(model, group)
        adapter = TransformersMoEAdapter(model, ep_group=group, self_check=False)
        # The parameter holds the local experts (its state dict entry is the global DTensor).
        local = model.get_parameter("model.layers.0.mlp.experts.gate_up_proj").shape[0]
        back = gather_experts(model, group)
        exact = list(back) == list(full) and all(torch.equal(back[k], full[k]) for k in full)
        print(
            json.dumps(
                {
                    "case": "shard_gather",
                    "rank": rank,
                    "ok": exact,
                    "local_experts": local,
                    "num_local_experts": adapter.decoder.layers[0].num_local_experts,
                }
            )
        )
    finally:
        dist.barrier()  # leave together: a rank tearing gloo down alone can abort the other
        dist.destroy_process_group()


if __name__ == "__main__":
    exit_worker(main)
