"""CUDA graphs in the MoE slice at a host-bound size: exactness and host time per layer pair.

``PYTHONPATH=src python3 benchmarks/bench_slice_graphs.py [--out DIR]`` (CUDA). At H=256
(the size where issuing kernels is slower than running them), for the slice eager, with its
attention graphed and with attention and router graphed: one fill/drain step's loss and
every gradient against the eager step (bit-identical, bf16), host milliseconds per layer
pair of overlapped steps, and overlapped / fill-drain step times.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from moe_overlap import MoeOverlapError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_overlap import Bench, host_time, make_bench, median, step, time_ms
from moe_slice import SliceConfig


def _timed(b: Bench, *, fill_drain: bool) -> float:
    return median(time_ms(b, lambda: step(b, overlap=True, fill_drain=fill_drain)))


MODES = {"eager": None, "attn": False, "attn+router": True}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny sizes (CPU smoke run)")
    args = p.parse_args()
    # Bit-identity needs deterministic kernels (the slice's combine is an index_add).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    cfg = SliceConfig(hidden=256, ffn=128, tokens=256, head_dim=64)
    if args.tiny:
        cfg = SliceConfig(
            hidden=64,
            ffn=32,
            tokens=32,
            num_layers=2,
            num_experts=8,
            local_experts=4,
            top_k=2,
            head_dim=32,
        )
    ref = make_bench(cfg, args, 4)
    step(ref, overlap=True, fill_drain=True)
    want = [q.grad.clone() for q in ref.model.parameters() if q.grad is not None]
    report: dict[str, object] = {
        "config": {"hidden": cfg.hidden, "ffn": cfg.ffn, "tokens": cfg.tokens}
    }
    for mode, router in MODES.items():
        b = make_bench(cfg, args, 4)
        if router is not None:
            b.model.set_graphs(True, router=router)
        try:
            step(b, overlap=True, fill_drain=True)
        except MoeOverlapError as exc:  # recorded: a mode that cannot run says why
            report[mode] = {"error": str(exc).splitlines()[0]}
            print(mode, json.dumps(report[mode]), flush=True)
            continue
        got = [q.grad for q in b.model.parameters() if q.grad is not None]
        exact = len(got) == len(want) and all(
            torch.equal(g, w) for g, w in zip(got, want, strict=True)
        )
        for _ in range(3):  # every copy captured, the allocator warm
            step(b, overlap=True, fill_drain=True)
        host = host_time(b, graphs=router is not None, router=bool(router))
        if router is not None:  # host_time leaves the graphs off
            b.model.set_graphs(True, router=router)
        row = {
            "bit_identical_to_eager": exact,
            "host_ms_per_layer_pair": host["paired_host_ms_per_layer_pair"],
            "gpu_ms_per_layer_pair": host["paired_gpu_ms_per_layer_pair"],
            "overlapped_ms": _timed(b, fill_drain=False),
            "fill_drain_ms": _timed(b, fill_drain=True),
        }
        report[mode] = row
        print(mode, json.dumps(row), flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "slice_graphs.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
