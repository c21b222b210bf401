"""The all-to-all in K chunks under the experts (issue 27, part 2): step time against K.

``PYTHONPATH=src python benchmarks/bench_a2a_chunks.py [--out DIR] [--chunks 1 2 4]``

The reference model (:class:`moe_overlap.models.GPTMoEModel`, bf16, SDPA attention, every
layer MoE, the all-to-all emulated by the one-device loopback: every dispatched row goes
device -> pinned host -> device) with ``moe_a2a_chunks=K`` for each K, one model per K
with the same weights. Every variant (K x serial / overlapped / fill-drain) runs one step
per round, the variants interleaved and rotated round by round; warm-up rounds, then
timed rounds; figure = median, spread = (max - min) / min. Also checks, under
deterministic algorithms, that each K's overlapped step is bit-identical to its own serial
step (losses and gradients), next to the serial step against itself. Writes
``DIR/a2a_chunks.json``. ``--tiny``: a CPU smoke run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from moe_overlap import Microbatch, StreamPair, combined_1f1b, make_streams
from moe_overlap.models import GPTMoEConfig, GPTMoEModel

JsonDict = dict[str, object]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _microbatches(
    n: int, config: GPTMoEConfig, batch: int, seq: int, device: torch.device
) -> list[Microbatch]:
    g = torch.Generator().manual_seed(0)
    xs = [
        torch.randint(0, config.vocab_size, (batch, seq), generator=g).to(device) for _ in range(n)
    ]
    return [Microbatch(input_ids=x, labels=x.roll(-1, 1)) for x in xs]


def _grads(model: GPTMoEModel) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="tiny sizes (CPU smoke run)")
    p.add_argument("--out", type=Path, default=None, help="default: /tmp/bench_a2a_chunks")
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--moe-ffn", type=int, default=2048)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if args.tiny:
        args.hidden, args.moe_ffn, args.experts, args.topk = 64, 32, 8, 2
        args.layers, args.batch, args.seq, args.warmup, args.iters = 2, 2, 32, 1, 2
    out = args.out if args.out is not None else Path("/tmp/bench_a2a_chunks")
    out.mkdir(parents=True, exist_ok=True)
    base = GPTMoEConfig(
        vocab_size=1024,
        hidden_size=args.hidden,
        num_layers=args.layers,
        first_k_dense=0,
        num_attention_heads=max(1, args.hidden // 128),
        num_experts=args.experts,
        moe_ffn_hidden_size=args.moe_ffn,
        moe_router_topk=args.topk,
        dispatcher="loopback",
        attention="sdpa",
        dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
    )
    models = {
        k: GPTMoEModel(dataclasses.replace(base, moe_a2a_chunks=k), device=device)
        for k in args.chunks
    }
    first = models[args.chunks[0]]
    for m in models.values():
        m.load_state_dict(first.state_dict())
    mbs = _microbatches(args.microbatches, base, args.batch, args.seq, device)
    pair = make_streams(device)
    serial = StreamPair(comp=pair.comp, comm=pair.comp)

    def step(model: GPTMoEModel, mode: str) -> list[torch.Tensor]:
        overlap = mode != "serial"
        return combined_1f1b(
            model,
            mbs,
            overlap=overlap,
            fill_drain=mode == "fill_drain",
            streams=pair if overlap else serial,
        )

    def bound(model: GPTMoEModel, mode: str) -> Callable[[], object]:
        return lambda: step(model, mode)

    variants: dict[str, Callable[[], object]] = {
        f"K{k}_{mode}": bound(m, mode)
        for k, m in models.items()
        for mode in ("serial", "overlapped", "fill_drain")
    }
    names = list(variants)
    samples: dict[str, list[float]] = {n: [] for n in names}
    t0 = time.perf_counter()
    for r in range(args.warmup + args.iters):
        for j in range(len(names)):
            name = names[(r + j) % len(names)]
            for m in models.values():
                m.zero_grad(set_to_none=False)
            _sync(device)
            start = time.perf_counter()
            variants[name]()
            _sync(device)
            if r >= args.warmup:
                samples[name].append((time.perf_counter() - start) * 1e3)
        print(
            f"round {r + 1}/{args.warmup + args.iters} ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    # Exactness under deterministic algorithms (warn-only): the default mode's atomics
    # (index_add, attention backward) differ run to run. The serial step runs twice: the floor.
    exact: dict[str, bool] = {}
    floor: dict[str, bool] = {}
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        for k, m in models.items():
            got: list[list[torch.Tensor]] = []
            for mode in ("serial", "serial", "overlapped"):
                m.zero_grad(set_to_none=True)
                losses = step(m, mode)
                _sync(device)
                got.append([*(x.detach().float() for x in losses), *_grads(m)])
            floor[f"K{k}"] = all(torch.equal(a, b) for a, b in zip(got[0], got[1], strict=True))
            exact[f"K{k}"] = all(torch.equal(a, b) for a, b in zip(got[0], got[2], strict=True))
    finally:
        torch.use_deterministic_algorithms(was)
    med = {n: statistics.median(v) for n, v in samples.items()}
    spread = {n: (max(v) - min(v)) / min(v) for n, v in samples.items()}
    res: JsonDict = {
        "env": {
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "argv": sys.argv,
        },
        "config": {k: str(v) for k, v in dataclasses.asdict(base).items()},
        "tokens_per_microbatch": args.batch * args.seq,
        "microbatches": args.microbatches,
        "warmup": args.warmup,
        "iters": args.iters,
        "step_ms": med,
        "samples": samples,
        "spread": spread,
        "overlapped_bit_identical_to_serial": exact,
        "serial_bit_identical_run_to_run": floor,
    }
    path = out / "a2a_chunks.json"
    path.write_text(json.dumps(res, indent=1))
    print(f"{'K':>3} {'serial':>9} {'overlapped':>11} {'fill/drain':>11} {'spread%':>8} exact")
    for k in args.chunks:
        row = [med[f"K{k}_{mode}"] for mode in ("serial", "overlapped", "fill_drain")]
        sp = max(spread[f"K{k}_{mode}"] for mode in ("serial", "overlapped", "fill_drain"))
        print(
            f"{k:>3} {row[0]:9.1f} {row[1]:11.1f} {row[2]:11.1f} {100 * sp:8.1f} {exact[f'K{k}']}"
        )
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
