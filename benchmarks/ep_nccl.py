"""Expert parallelism over NCCL (or gloo on CPU): exactness and overlap with a real all-to-all.

Runs the reference model (:class:`moe_overlap.models.GPTMoEModel`) with EP = the number
of processes, one process per GPU, and on every rank:

1. checks that ``combined_1f1b`` gives losses and gradients bit-identical to plain
   per-microbatch ``backward()`` (deterministic settings);
2. times the serial step (comm on the compute stream, no interleave) and the overlapped
   step, computes the critical-path bound from per-node durations, and measures the
   all-to-all bandwidth of the dispatch-sized exchange.

Launch::

    torchrun --nproc-per-node 8 benchmarks/ep_nccl.py --out ep_results      # 8 GPUs, NCCL
    python benchmarks/ep_nccl.py --nproc 2 --device cpu --tiny                # 2 CPU ranks, gloo

NVLink multicast stays off (``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``,
``NVSHMEM_DISABLE_NVLS=1``),
as the device documentation asks.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist

from moe_overlap import Microbatch, StreamPair, combined_1f1b, make_streams
from moe_overlap.models import GPTMoEConfig, GPTMoEModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from node_timing import Clock, NodeRecorder, critical_path_ms, overlapped_runs

_SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

# torch.distributed leaves these unannotated; give them types once, here.
_all_reduce = cast("Callable[..., object]", dist.all_reduce)  # pyright: ignore[reportUnknownMemberType]
_all_to_all_single = cast(
    "Callable[..., object]",
    dist.all_to_all_single,  # pyright: ignore[reportUnknownMemberType]
)
_barrier = cast("Callable[[], object]", dist.barrier)  # pyright: ignore[reportUnknownMemberType]


def config_for(world: int, *, tiny: bool, dtype: torch.dtype) -> GPTMoEConfig:
    """A DeepSeek-like slice per rank (8 local experts, top-8), or a tiny CPU one."""
    if tiny:
        return GPTMoEConfig(
            num_experts=4 * world,
            hidden_size=32,
            moe_ffn_hidden_size=16,
            moe_router_topk=2,
            num_layers=3,
            first_k_dense=1,
            dtype=dtype,
        )
    return GPTMoEConfig(
        vocab_size=32000,
        hidden_size=4096,
        num_layers=4,
        first_k_dense=0,
        num_attention_heads=32,
        ffn_hidden_size=8192,
        num_experts=8 * world,
        moe_ffn_hidden_size=2048,
        moe_router_topk=8,
        attention="sdpa",
        dtype=dtype,
    )


def microbatches(
    config: GPTMoEConfig, n: int, *, batch: int, seq: int, device: torch.device, seed: int
) -> list[Microbatch]:
    """Synthetic next-token batches, different on every rank (data parallel over EP)."""
    gen = torch.Generator().manual_seed(seed)
    out: list[Microbatch] = []
    for _ in range(n):
        ids = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=gen)
        pos = torch.arange(seq).expand(batch, seq)
        out.append(
            Microbatch(
                input_ids=ids[:, :-1].to(device),
                position_ids=pos.to(device),
                labels=ids[:, 1:].to(device),
            )
        )
    return out


def plain_step(model: GPTMoEModel, mbs: list[Microbatch]) -> list[torch.Tensor]:
    """Reference: ``loss.backward()`` per microbatch, in order."""
    losses: list[torch.Tensor] = []
    for mb in mbs:
        assert mb.input_ids is not None
        loss = model(mb.input_ids, mb.position_ids, mb.labels)
        loss.backward()
        losses.append(loss.detach().float())
    return losses


def check_exact(
    config: GPTMoEConfig, mbs: list[Microbatch], device: torch.device
) -> dict[str, object]:
    """Bit-identity of ``combined_1f1b`` and plain backward on this rank."""
    group = dist.group.WORLD
    ref = GPTMoEModel(config, ep_group=group, device=device)
    model = GPTMoEModel(config, ep_group=group, device=device)
    want = plain_step(ref, mbs)
    got = combined_1f1b(model, mbs, options=model.schedule_options())
    losses_equal = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    mismatched = [
        name
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True)
        if (p.grad is None) != (q.grad is None)
        or (p.grad is not None and q.grad is not None and not torch.equal(p.grad, q.grad))
    ]
    return {
        "losses_equal": losses_equal,
        "grads_equal": not mismatched,
        "mismatched": mismatched,
        "params": sum(1 for _ in model.parameters()),
    }


def time_step(fn: Callable[[], object], device: torch.device, repeats: int) -> list[float]:
    """Milliseconds of ``fn`` per repeat, all ranks aligned by a barrier first."""
    clock = Clock(device)
    times: list[float] = []
    for _ in range(repeats):
        _barrier()
        start = clock.mark()
        fn()
        end = clock.mark()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(Clock.ms(start, end))
    return times


def a2a_bandwidth(
    config: GPTMoEConfig, tokens: int, device: torch.device, repeats: int
) -> dict[str, float]:
    """GB/s of one dispatch-sized all_to_all_single (tokens * top-k rows of hidden)."""
    world = dist.get_world_size()
    rows = tokens * config.moe_router_topk
    rows -= rows % world
    buf = torch.randn(rows, config.hidden_size, dtype=config.dtype, device=device)
    out = torch.empty_like(buf)
    times = time_step(lambda: _all_to_all_single(out, buf), device, repeats + 1)[1:]
    ms = statistics.median(times)
    sent = buf.numel() * buf.element_size() * (world - 1) / world
    return {"bytes_sent_per_rank": sent, "ms": ms, "GBps_per_rank": sent / ms / 1e6}


def bench(
    config: GPTMoEConfig, mbs: list[Microbatch], device: torch.device, repeats: int
) -> dict[str, object]:
    """Serial vs overlapped step and the critical-path bound, on this rank."""
    model = GPTMoEModel(config, ep_group=dist.group.WORLD, device=device)
    options = model.schedule_options()
    pair = make_streams(device)
    serial_streams = StreamPair(comp=pair.comp, comm=pair.comp)

    def serial() -> object:
        return combined_1f1b(model, mbs, overlap=False, options=options, streams=serial_streams)

    def overlapped() -> object:
        return combined_1f1b(model, mbs, options=options, streams=pair)

    serial()  # warm-up
    overlapped()
    model.zero_grad(set_to_none=True)
    serial_ms = time_step(serial, device, repeats)
    overlapped_ms = time_step(overlapped, device, repeats)
    recorder = NodeRecorder(device)
    recorder.start()
    combined_1f1b(model, mbs, options=options, streams=serial_streams, on_plan=recorder)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    bound = critical_path_ms(overlapped_runs(len(mbs)), recorder.shapes, recorder.durations())
    over = statistics.median(overlapped_ms)
    return {
        "serial_ms": statistics.median(serial_ms),
        "overlapped_ms": over,
        "bound_ms": bound,
        "efficiency": bound / over,
        "serial_samples": serial_ms,
        "overlapped_samples": overlapped_ms,
    }


def worker(args: argparse.Namespace) -> None:
    """One rank: set up the group, check exactness, benchmark, report from rank 0."""
    os.environ.update(_SAFE_ENV)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if cuda:
        torch.cuda.set_device(local)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    try:
        dtype = torch.bfloat16 if cuda else torch.float32
        config = config_for(world, tiny=args.tiny, dtype=dtype)
        batch, seq = (2, 16) if args.tiny else (1, args.tokens)
        mbs = microbatches(
            config, args.microbatches, batch=batch, seq=seq, device=device, seed=rank
        )
        report: dict[str, object] = {"rank": rank, "world": world, "device": str(device)}
        # Explicit attention math for the exactness check: fused attention backward
        # kernels need not be deterministic.
        report["exact"] = check_exact(dataclasses.replace(config, attention="math"), mbs, device)
        if not args.skip_bench:
            report["step"] = bench(config, mbs, device, args.repeats)
            report["a2a"] = a2a_bandwidth(config, batch * seq, device, args.repeats)
        ok = torch.tensor(
            [1.0 if report["exact"]["grads_equal"] and report["exact"]["losses_equal"] else 0.0],  # type: ignore[index]
            device=device,
        )
        _all_reduce(ok, op=dist.ReduceOp.MIN)
        report["all_ranks_exact"] = bool(ok.item() == 1.0)
        print(json.dumps(report), flush=True)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"ep{world}_rank{rank}.json").write_text(json.dumps(report, indent=2))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def spawn(args: argparse.Namespace, argv: list[str]) -> int:
    """Start ``--nproc`` copies of this script as ranks (when not under torchrun)."""
    port = _free_port()
    procs: list[subprocess.Popen[bytes]] = []
    for rank in range(args.nproc):
        env = {
            **os.environ,
            **_SAFE_ENV,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(args.nproc),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        procs.append(subprocess.Popen([sys.executable, __file__, *argv], env=env))
    return max(p.wait() for p in procs)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--nproc", type=int, default=None, help="spawn this many ranks locally")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--tiny", action="store_true", help="tiny model (CPU smoke test)")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per microbatch per rank")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--skip-bench", action="store_true", help="exactness only")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    if "RANK" not in os.environ:
        if args.nproc is None:
            args.nproc = max(torch.cuda.device_count(), 1) if args.device != "cpu" else 2
        rest = [a for a in argv if not a.startswith("--nproc")]
        if "--nproc" in argv:
            i = argv.index("--nproc")
            rest = argv[:i] + argv[i + 2 :]
        return spawn(args, rest)
    worker(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
