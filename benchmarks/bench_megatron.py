"""Megatron-Core's own EP overlap and ``MegatronMoEAdapter`` on the same model, side by side.

Usage (two or more GPUs of one host; Megatron-Core 0.19 importable)::

    CUBLAS_WORKSPACE_CONFIG=:4096:8 torchrun --nproc-per-node 2 \\
        benchmarks/bench_megatron.py --out DIR

One ``GPTModel`` (local layer spec, bf16, ``--layers`` MoE layers, ``--experts`` experts
over the expert-parallel group of every rank, top-``--topk``, all-to-all dispatcher, built
with ``overlap_moe_expert_parallel_comm=True``) and ``--microbatches`` microbatches of
``--batch`` x ``--seq`` random tokens per rank. Two parts:

1. **Exactness** (deterministic algorithms): one step of Megatron-Core's own overlap
   (``forward_backward_no_pipelining``, which runs its combined-1F1B schedule for this
   config), then one step of ``combined_1f1b(MegatronMoEAdapter(model), ...)`` overlapped
   and with fill and drain, each from zeroed gradients; losses and every gradient are
   compared with Megatron-Core's, bit for bit. A difference is reported (with the largest
   one per parameter) and the run exits 1 after timing.
2. **Timing**: ``--iters`` steps of each variant after ``--warmup``, interleaved round by
   round; CUDA-event milliseconds per step, median and spread ((max - min) / min), the
   slowest rank's per step. Variants: Megatron-Core's overlap; the adapter serial (comm on
   the compute stream), overlapped, overlapped with fill and drain.

Rank 0 prints a table and writes ``DIR/bench_megatron_results.json``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe_overlap import Microbatch, ScheduleOptions, StreamPair, combined_1f1b, make_streams


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Megatron-Core's EP overlap vs MegatronMoEAdapter")
    p.add_argument("--out", type=Path, default=Path("."))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--expert-ffn", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    return p.parse_args()


def _mc(name: str) -> Any:
    return importlib.import_module(name)


# torch's distributed and seeding functions are partly untyped; give them their use here.
_seed = cast("Callable[[int], object]", torch.manual_seed)  # pyright: ignore[reportUnknownMemberType]
_all_reduce = cast("Callable[..., object]", dist.all_reduce)  # pyright: ignore[reportUnknownMemberType]
_barrier = cast("Callable[[], object]", dist.barrier)  # pyright: ignore[reportUnknownMemberType]
_event = cast("Callable[..., Any]", torch.cuda.Event)


def _build(a: argparse.Namespace) -> nn.Module:
    specs, gpt = _mc("megatron.core.models.gpt.gpt_layer_specs"), _mc("megatron.core.models.gpt")
    tc = _mc("megatron.core.transformer.transformer_config")
    config = tc.TransformerConfig(
        num_layers=a.layers,
        hidden_size=a.hidden,
        num_attention_heads=a.heads,
        ffn_hidden_size=4 * a.hidden,
        num_moe_experts=a.experts,
        moe_router_topk=a.topk,
        moe_ffn_hidden_size=a.expert_ffn,
        moe_token_dispatcher_type="alltoall",
        expert_model_parallel_size=dist.get_world_size(),
        overlap_moe_expert_parallel_comm=True,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
    )
    _seed(0)
    _mc("megatron.core.tensor_parallel.random").model_parallel_cuda_manual_seed(0)
    spec = specs.get_gpt_layer_local_spec(num_experts=a.experts, moe_grouped_gemm=False)
    model: nn.Module = gpt.GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=a.vocab,
        max_sequence_length=a.seq,
        position_embedding_type="rope",
    )
    return model.cuda()


def _microbatches(a: argparse.Namespace) -> list[Microbatch]:
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    causal = torch.ones(a.seq, a.seq, dtype=torch.bool, device="cuda").triu(1)
    mask = causal.expand(a.batch, 1, a.seq, a.seq)
    positions = torch.arange(a.seq, device="cuda").expand(a.batch, a.seq).contiguous()
    out: list[Microbatch] = []
    for _ in range(a.microbatches):
        ids = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g).cuda()
        out.append(
            Microbatch(
                input_ids=ids[:, :-1].contiguous(),
                labels=ids[:, 1:].contiguous(),
                position_ids=positions,
                attention_mask=mask,
            )
        )
    return out


def _megatron_step(model: nn.Module, mbs: list[Microbatch]) -> list[Tensor]:
    """Megatron-Core's own combined-1F1B step; the adapter's default loss (the mean of the
    per-token loss), which Megatron-Core divides by the number of microbatches."""
    schedules = _mc("megatron.core.pipeline_parallel.schedules")
    losses: list[Tensor] = []

    def loss_func(per_token: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        loss = per_token.float().sum() / per_token.numel()
        losses.append(loss.detach().clone())
        return loss, {"lm loss": loss.detach()}

    def forward_step(
        data: Iterator[Microbatch], m: Any, return_schedule_plan: bool = False
    ) -> tuple[object, Callable[..., object]]:
        mb = next(data)
        call = m.build_schedule_plan if return_schedule_plan else m
        out = call(mb.input_ids, mb.position_ids, mb.attention_mask, labels=mb.labels)
        return out, loss_func

    schedules.forward_backward_no_pipelining(
        forward_step_func=forward_step,
        data_iterator=iter(mbs),
        model=[model],
        num_microbatches=len(mbs),
        seq_length=0,
        micro_batch_size=0,
        forward_only=False,
    )
    return losses


def _ours(adapter: Any, mbs: list[Microbatch], kind: str) -> list[Tensor]:
    pair = make_streams(torch.device("cuda"))
    return combined_1f1b(
        adapter,
        mbs,
        overlap=kind != "serial",
        fill_drain=kind == "fill_drain",
        streams=pair if kind != "serial" else StreamPair(comp=pair.comp, comm=pair.comp),
        options=ScheduleOptions(free_input=False),
        loss_scale=1.0 / len(mbs),
    )


def _grads(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _zero(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def main() -> int:
    a = _args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    ps = _mc("megatron.core.parallel_state")
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=dist.get_world_size())
    from moe_overlap.adapters.megatron import MegatronMoEAdapter

    model = _build(a)
    adapter = MegatronMoEAdapter(model)
    mbs = _microbatches(a)
    variants: dict[str, Callable[[], list[Tensor]]] = {
        "Megatron-Core overlap": lambda: _megatron_step(model, mbs),
        "adapter serial": lambda: _ours(adapter, mbs, "serial"),
        "adapter overlapped": lambda: _ours(adapter, mbs, "overlapped"),
        "adapter fill/drain": lambda: _ours(adapter, mbs, "fill_drain"),
    }
    inexact: list[str] = []
    found = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        _zero(model)
        want_losses = variants["Megatron-Core overlap"]()
        torch.cuda.synchronize()
        want = _grads(model)
        for name in ("adapter overlapped", "adapter fill/drain"):
            _zero(model)
            got_losses = variants[name]()
            torch.cuda.synchronize()
            got = _grads(model)
            if not all(torch.equal(x, y) for x, y in zip(got_losses, want_losses, strict=True)):
                inexact.append(f"{name}: losses {got_losses} vs {want_losses}")
            for n, g in want.items():
                if n not in got or not torch.equal(got[n], g):
                    d = float((got[n].float() - g.float()).abs().max()) if n in got else "none"
                    inexact.append(f"{name}: gradient of {n} differs (max {d})")
    finally:
        torch.use_deterministic_algorithms(found)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(a.warmup + a.iters):
        for name, run in variants.items():
            _zero(model)
            start, end = _event(enable_timing=True), _event(enable_timing=True)
            _barrier()
            start.record()
            run()
            end.record()
            torch.cuda.synchronize()
            ms = torch.tensor(float(start.elapsed_time(end)), device="cuda")
            _all_reduce(ms, op=dist.ReduceOp.MAX)
            if i >= a.warmup:
                times[name].append(float(ms))
    if rank == 0:
        rows = {
            name: {
                "median_ms": statistics.median(t),
                "spread": (max(t) - min(t)) / min(t),
                "samples": t,
            }
            for name, t in times.items()
        }
        print(f"{'variant':<24} {'ms (median)':>12} {'spread':>8}")
        for name, t in times.items():
            spread = 100 * (max(t) - min(t)) / min(t)
            print(f"{name:<24} {statistics.median(t):>12.2f} {spread:>7.1f}%")
        print("bit-identical to Megatron-Core's own step:", "no" if inexact else "yes")
        for line in inexact[:20]:
            print("  ", line)
        a.out.mkdir(parents=True, exist_ok=True)
        result = {
            "command": " ".join(sys.argv),
            "when": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "torch": torch.__version__,
            "megatron_core": str(_mc("megatron.core.package_info").__version__),
            "device": torch.cuda.get_device_name(),
            "ranks": dist.get_world_size(),
            "args": {k: str(v) for k, v in vars(a).items()},
            "bit_identical": not inexact,
            "differences": inexact,
            "variants": rows,
        }
        (a.out / "bench_megatron_results.json").write_text(json.dumps(result, indent=1))
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return 1 if inexact else 0


if __name__ == "__main__":
    raise SystemExit(main())
