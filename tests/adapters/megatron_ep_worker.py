"""One rank of the Megatron-Core expert-parallel test: ``python -m tests.adapters.megatron_ep_worker``.

Reads ``RANK``, ``WORLD_SIZE`` (the expert-parallel degree) and ``MASTER_*``. Megatron-Core
runs on the CPU through the test-only shim (``_megatron_cpu``), its model-parallel state
with expert parallelism over every rank: each rank holds its share of the experts and the
model's own all-to-all token dispatcher exchanges the tokens over gloo. Two copies of the
same ``GPTModel`` (two MoE layers, 4 experts, 2 per rank): one trained by its own
``forward`` and ``backward()`` per microbatch, the other by ``combined_1f1b`` through
``MegatronMoEAdapter`` (overlapped, fill/drain, with both slots recomputed, and
releasing slot inputs early; each from zeroed gradients). Prints one JSON line per schedule: losses and every
gradient of this rank bit-identical or not.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe_overlap import Microbatch, ScheduleOptions, combined_1f1b
from moe_overlap.adapters.megatron import MegatronMoEAdapter
from tests.adapters._megatron import BATCH, MICROBATCHES, SEQ, VOCAB, local_gpt, tiny_config
from tests.adapters._megatron_cpu import megatron_on_cpu
from tests.gloo_ranks import exit_worker


def build() -> nn.Module:
    config = tiny_config(expert_model_parallel_size=dist.get_world_size())
    torch.manual_seed(0)
    return local_gpt(config)


def microbatches() -> list[Microbatch]:
    g = torch.Generator().manual_seed(10 + dist.get_rank())  # each rank its own data
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1).expand(BATCH, 1, SEQ, SEQ)
    out: list[Microbatch] = []
    for _ in range(MICROBATCHES):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        out.append(
            Microbatch(
                input_ids=ids[:, :-1].contiguous(),
                labels=ids[:, 1:].contiguous(),
                position_ids=torch.arange(SEQ).expand(BATCH, SEQ),
                attention_mask=causal,
            )
        )
    return out


def own_step(model: nn.Module, mbs: list[Microbatch]) -> list[Tensor]:
    losses = []
    for mb in mbs:
        per_token = model(mb.input_ids, mb.position_ids, mb.attention_mask, labels=mb.labels)
        loss = per_token.float().sum() / per_token.numel()
        loss.backward()
        losses.append(loss.detach())
    return losses


def grads(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def main() -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    with megatron_on_cpu(expert_parallel=world):
        ref, model = build(), build()
        adapter = MegatronMoEAdapter(model)
        mbs = microbatches()
        want = own_step(ref, mbs)
        want_grads = grads(ref)
        runs: dict[str, dict[str, Any]] = {
            "overlapped": {},
            "fill_drain": {"fill_drain": True},
            "recompute": {"options": ScheduleOptions(recompute=("pre_dispatch", "mlp"))},
            # Across ranks the all-to-all returns fresh buffers: inputs may be released.
            "free_input": {"options": ScheduleOptions(free_input=True), "fill_drain": True},
        }
        local = sum(1 for n, _ in model.named_parameters() if "local_experts" in n)
        for name, kwargs in runs.items():
            for p in model.parameters():
                p.grad = None
            kwargs.setdefault("options", adapter.schedule_options())
            got = combined_1f1b(adapter, mbs, **kwargs)
            got_grads = grads(model)
            print(
                json.dumps(
                    {
                        "run": name,
                        "rank": rank,
                        "losses": all(torch.equal(a, b) for a, b in zip(got, want, strict=True)),
                        "grads": list(got_grads) == list(want_grads)
                        and all(torch.equal(got_grads[k], want_grads[k]) for k in want_grads),
                        "differ": [
                            k for k in want_grads if not torch.equal(got_grads[k], want_grads[k])
                        ][:5],
                        "local_expert_params": local,
                        "ep": world,
                    }
                ),
                flush=True,
            )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    exit_worker(main)
