"""One rank of the Megatron-Core pipeline test: ``python -m tests.adapters.megatron_pp_worker``.

Reads ``RANK``, ``WORLD_SIZE`` (the pipeline degree, two stages per rank), ``MASTER_*``
and ``MEGATRON_PP_SCHEDULES`` (JSON list of torch schedule names: ``DualPipeV``,
``Interleaved1F1B``). Prints one JSON line per schedule with this rank's verdict.

Megatron-Core runs on the CPU through the test-only shim (``_megatron_cpu``), or with
``MEGATRON_PP_DEVICE=cuda`` on the GPU, unpatched, in bf16 (NCCL, one rank). Each stage is
a ``GPTModel`` built for it (``pre_process`` on the first stage, ``post_process`` on the
last, the stage's layers), the same weights for every copy (seeded per stage). The same
torch schedule runs three ways: torch's execution of ``MegatronMoEStage`` s, the same
prepared by ``prepare_schedule``, and torch's execution of the raw ``GPTModel`` chunks
called as Megatron-Core's own pipeline calls them (``set_input_tensor`` on later stages).
Verdicts: losses and every gradient bit-identical, both comparisons.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from moe_overlap.adapters.megatron import MegatronMoEAdapter, MegatronMoEStage
from moe_overlap.integrations.pipelining import prepare_schedule
from tests.adapters._megatron import BATCH, SEQ, VOCAB, local_gpt, tiny_config
from tests.adapters._megatron_cpu import megatron_on_cpu
from tests.gloo_ranks import exit_worker

LAYERS_PER_STAGE, MICROBATCHES = 1, 4
DEVICE = torch.device(os.environ.get("MEGATRON_PP_DEVICE", "cpu"))


def chunk(stage: int, stages: int) -> nn.Module:
    """Stage ``stage``'s ``GPTModel`` (one MoE layer; embedding on the first, final norm
    and output layer on the last)."""
    cuda = DEVICE.type == "cuda"
    config = tiny_config(
        num_layers=LAYERS_PER_STAGE,
        bf16=cuda,
        params_dtype=torch.bfloat16 if cuda else torch.float32,
    )
    torch.manual_seed(1000 + stage)
    if cuda:
        rnd: Any = importlib.import_module("megatron.core.tensor_parallel.random")
        rnd.model_parallel_cuda_manual_seed(1000 + stage)
    model = local_gpt(config, pre_process=stage == 0, post_process=stage == stages - 1)
    # In bf16 the whole model, as Megatron-Core's Float16Module casts it: the local norms
    # are built with fp32 weights, and CUDA's layer_norm takes no mixed dtypes.
    return model.to(DEVICE, torch.bfloat16) if cuda else model.to(DEVICE)


class RawStage(nn.Module):
    """A ``GPTModel`` chunk called as Megatron-Core's pipeline calls it: token ids on the
    first stage, else the previous stage's hidden states through ``set_input_tensor``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor, position_ids: Tensor, attention_mask: Tensor) -> Tensor:
        m: Any = self.model
        if m.pre_process:
            out: Tensor = m(x, position_ids, attention_mask)
            return out
        m.set_input_tensor(x)
        out = m(None, position_ids, attention_mask)
        return out


def loss_fn(logits: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def build(name: str, pp: int, rank: int, kind: str) -> tuple[Any, list[Any], list[nn.Module]]:
    from torch.distributed.pipelining import (
        PipelineStage,
        ScheduleDualPipeV,
        ScheduleInterleaved1F1B,
    )

    n = 2 * pp
    mine = [rank, n - 1 - rank] if name == "DualPipeV" else [rank, rank + pp]
    chunks = [chunk(s, n) for s in mine]
    mods: list[nn.Module] = [
        RawStage(c) if kind == "raw" else MegatronMoEStage(MegatronMoEAdapter(c)) for c in chunks
    ]
    stages = [PipelineStage(m, s, n, DEVICE) for m, s in zip(mods, mine, strict=True)]
    cls: Any = ScheduleDualPipeV if name == "DualPipeV" else ScheduleInterleaved1F1B
    return cls(stages, MICROBATCHES, loss_fn=loss_fn), stages, chunks


def step(schedule: Any, stages: list[Any], x: Tensor, y: Tensor, **kwargs: Tensor) -> list[Tensor]:
    first = any(s.is_first for s in stages)
    last = any(s.is_last for s in stages)
    losses: list[Tensor] = []
    args = (x,) if first else ()
    schedule.step(*args, target=y if last else None, losses=losses if last else None, **kwargs)
    return [loss.detach() for loss in losses]


def grads(chunks: list[nn.Module]) -> dict[str, Tensor]:
    return {
        f"{i}:{n}": p.grad.clone()
        for i, c in enumerate(chunks)
        for n, p in c.named_parameters()
        if p.grad is not None
    }


def same(p: dict[str, Tensor], q: dict[str, Tensor]) -> bool:
    return list(p) == list(q) and all(torch.equal(p[k], q[k]) for k in p)


def run(name: str, pp: int, rank: int) -> dict[str, object]:
    start = time.perf_counter()
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (BATCH * MICROBATCHES, SEQ + 1), generator=g)
    ids = ids.to(DEVICE)
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    kw = {
        "position_ids": torch.arange(SEQ, device=DEVICE)
        .expand(BATCH * MICROBATCHES, SEQ)
        .contiguous(),
        "attention_mask": torch.ones(SEQ, SEQ, dtype=torch.bool, device=DEVICE)
        .triu(1)
        .expand(BATCH * MICROBATCHES, 1, SEQ, SEQ)
        .contiguous(),
    }
    sched, stages, chunks = build(name, pp, rank, "adapted")
    ref = step(sched, stages, x, y, **kw)
    ours, our_stages, our_chunks = build(name, pp, rank, "adapted")
    overlap = prepare_schedule(ours, pair=name != "DualPipeV")
    got = step(ours, our_stages, x, y, **kw)
    raw_sched, raw_stages, raw_chunks = build(name, pp, rank, "raw")
    raw = step(raw_sched, raw_stages, x, y, **kw)
    a, b, r = grads(our_chunks), grads(chunks), grads(raw_chunks)
    return {
        "schedule": name,
        "rank": rank,
        "bit_identical": len(got) == len(ref)
        and all(torch.equal(p, q) for p, q in zip(got, ref, strict=True))
        and same(a, b),
        "vs_megatron_ok": all(torch.equal(p, q) for p, q in zip(ref, raw, strict=True))
        and same(b, r),
        "differ": [k for k in a if k in b and not torch.equal(a[k], b[k])][:5],
        "grads": len(a),
        "losses": [float(v) for v in got],
        "paired": overlap.paired,
        "pending": sum(s.submod.pending_wgrad for s in our_stages),
        "seconds": round(time.perf_counter() - start, 2),
    }


def main() -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if DEVICE.type == "cuda":  # Megatron-Core unpatched: its own model-parallel state
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world)
        ps: Any = importlib.import_module("megatron.core.parallel_state")
        ps.initialize_model_parallel(1, 1)
        runs: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        runs = megatron_on_cpu()
    with runs:
        for name in json.loads(os.environ["MEGATRON_PP_SCHEDULES"]):
            print(json.dumps(run(name, world, rank)), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    exit_worker(main)
