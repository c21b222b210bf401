"""Where a compute-only step of the MoE slice spends its GPU time (torch.profiler).

``PYTHONPATH=src python3 benchmarks/profile_step.py [--out DIR]``: one warm-up step, then
one profiled serial step with the loopback replaced by a device copy; prints the kernels
by total CUDA time and writes the table to ``DIR/profile.txt``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from moe_overlap import StreamPair, combined_1f1b, make_streams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_slice import LoopbackMode, MoESliceModel, SliceConfig, make_microbatches


def main() -> None:
    p = argparse.ArgumentParser(description="profile one compute-only step")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--rows", type=int, default=25)
    args = p.parse_args()
    device = torch.device("cuda")
    cfg = SliceConfig(loopback=LoopbackMode.DEVICE)
    model = MoESliceModel(cfg, dtype=torch.bfloat16, device=device)
    mbs = make_microbatches(4, cfg, dtype=torch.bfloat16, device=device)
    comp = make_streams(device).comp
    serial = StreamPair(comp=comp, comm=comp)
    combined_1f1b(model, mbs, overlap=False, streams=serial)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        combined_1f1b(model, mbs, overlap=False, streams=serial)
        torch.cuda.synchronize()
    averages: Any = prof.key_averages()
    table = str(
        averages.table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=60)
    )
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile.txt").write_text(table)


if __name__ == "__main__":
    main()
