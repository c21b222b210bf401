"""The all-to-all in K chunks under the experts (issue 27, part 2): step time against K.

``PYTHONPATH=src python benchmarks/bench_a2a_chunks.py [--out DIR] [--chunks 1 2 4]``

The reference model (:class:`moe_overlap.models.GPTMoEModel`, bf16, SDPA attention, every
layer MoE, the all-to-all emulated by the one-device loopback: every dispatched row goes
device -> pinned host -> device) with ``moe_a2a_chunks=K`` for each K, one model per K
with the same weights. Every variant (K x serial / overlapped / fill-drain) runs one step
per round, the variants interleaved and rotated round by round; warm-up rounds, then
timed rounds; figure = median, spread = (max - min) / min. Writes ``DIR/a2a_chunks.json``.
``--tiny``: a CPU smoke run.

Exactness first, under deterministic kernels only (``bench_overlap.deterministic_kernels``:
``torch.use_deterministic_algorithms(True)``, not warn-only; ``CUBLAS_WORKSPACE_CONFIG``;
SDPA off cuDNN attention, or with ``--exact-attention math`` its math backend only): for
each K, its serial step twice and its overlapped and fill/drain steps, from zero gradients;
every one must be bit-identical to K's first serial step (losses and gradients). The chunked
all-to-all changes the experts' matrix shapes, so each K is compared with its own serial
step, not with K=1. A step that is not bit-identical fails the benchmark: the exactness
results are written, the differences printed to stderr, and the process exits 1 without
timing, or with ``--continue-after-inexact`` after timing. ``MOE_OVERLAP_BENCH_PERTURB``
(``K2_overlapped``, ``1`` = the first checked) adds one ulp to a step's first gradient: the
failure path's test.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

# Deterministic cuBLAS for the exactness pass (read when CUDA starts; :4096:8 is Hopper's
# default workspace size, so the timed steps are unchanged).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch
from torch import Tensor

from moe_overlap import Microbatch, StreamPair, combined_1f1b, make_streams
from moe_overlap.models import GPTMoEConfig, GPTMoEModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_overlap import (
    add_ulp,
    compare,
    describe,
    deterministic_kernels,
    perturb_target,
    snapshot,
)

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


MODES = ("serial", "overlapped", "fill_drain")


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
    p.add_argument(
        "--exact-attention",
        choices=("sdpa", "math"),
        default="sdpa",
        help="attention kernels of the exactness pass: sdpa = SDPA's deterministic backends "
        "(never cuDNN); math = SDPA's math backend only",
    )
    p.add_argument(
        "--continue-after-inexact",
        action="store_true",
        help="time the steps even when the exactness pass failed (still exits 1)",
    )
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

    def step(model: GPTMoEModel, mode: str) -> list[Tensor]:
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
        f"K{k}_{mode}": bound(m, mode) for k, m in models.items() for mode in MODES
    }
    checked = [f"K{k}_{mode}" for k in args.chunks for mode in MODES[1:]]
    perturb = perturb_target(checked)
    env: JsonDict = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "argv": sys.argv,
    }
    res: JsonDict = {
        "env": env,
        "config": {k: str(v) for k, v in dataclasses.asdict(base).items()},
        "tokens_per_microbatch": args.batch * args.seq,
        "microbatches": args.microbatches,
    }
    path = out / "a2a_chunks.json"
    exact = exactness(models, step, device, attention=args.exact_attention, perturb=perturb)
    res["exactness"] = exact
    failed = cast("list[str]", exact["failed"])
    rows = cast("dict[str, JsonDict]", exact["variants"])
    for name in failed:
        ref = f"{name.split('_')[0]}_serial"
        print(
            f"bench_a2a_chunks: EXACTNESS FAILED ({exact['kernels']}): "
            + describe(name, ref, rows[name]),
            file=sys.stderr,
            flush=True,
        )
    if failed and not args.continue_after_inexact:
        path.write_text(json.dumps(res, indent=1))
        raise SystemExit(
            f"bench_a2a_chunks: {', '.join(failed)} not bit-identical to their serial steps "
            f"under deterministic kernels; not timed (--continue-after-inexact); wrote {path}"
        )
    if not failed:
        print(f"exact: {len(rows)} of {len(rows)} steps bit-identical ({exact['kernels']})")
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
    med = {n: statistics.median(v) for n, v in samples.items()}
    spread = {n: (max(v) - min(v)) / min(v) for n, v in samples.items()}
    res |= {
        "warmup": args.warmup,
        "iters": args.iters,
        "step_ms": med,
        "samples": samples,
        "spread": spread,
    }
    path.write_text(json.dumps(res, indent=1))
    print(f"{'K':>3} {'serial':>9} {'overlapped':>11} {'fill/drain':>11} {'spread%':>8} exact")
    for k in args.chunks:
        row = [med[f"K{k}_{mode}"] for mode in MODES]
        sp = max(spread[f"K{k}_{mode}"] for mode in MODES)
        ok = not any(name.startswith(f"K{k}_") for name in failed)
        print(f"{k:>3} {row[0]:9.1f} {row[1]:11.1f} {row[2]:11.1f} {100 * sp:8.1f} {ok}")
    print(f"wrote {path}", flush=True)
    if failed:
        raise SystemExit(
            f"bench_a2a_chunks: {', '.join(failed)} not bit-identical to their serial steps "
            "under deterministic kernels (timed anyway: --continue-after-inexact)"
        )


def exactness(
    models: dict[int, GPTMoEModel],
    step: Callable[[GPTMoEModel, str], list[Tensor]],
    device: torch.device,
    *,
    attention: str,
    perturb: str | None,
) -> JsonDict:
    """For each K: its serial step twice, its overlapped and fill/drain steps, from zero
    gradients under deterministic kernels, each compared with K's first serial step.
    ``failed``: the steps not bit-identical (``K<k>_serial (run to run)``: the second serial
    step)."""
    rows: dict[str, JsonDict] = {}
    first = True
    with deterministic_kernels(device, attention) as kernels:
        for k, m in models.items():

            def run(mode: str, model: GPTMoEModel = m) -> tuple[list[Tensor], dict[str, Tensor]]:
                model.zero_grad(set_to_none=True)
                losses = step(model, mode)
                _sync(device)
                return snapshot(model, losses)

            want = run("serial")
            rows[f"K{k}_serial (run to run)"] = compare(run("serial"), want)
            for mode in MODES[1:]:
                name = f"K{k}_{mode}"
                got = run(mode)
                if perturb == name or (perturb == "1" and first):
                    add_ulp(next(iter(got[1].values())))
                first = False
                rows[name] = compare(got, want)
            m.zero_grad(set_to_none=True)
    return {
        "kernels": kernels,
        "attention": attention,
        "reference": "each K's first serial step",
        "perturbed": perturb,
        "variants": rows,
        "failed": [k for k, r in rows.items() if not r["bit_identical"]],
    }


if __name__ == "__main__":
    main()
