"""A/B of the schedule's host work in Python calls: deterministic where timings are noise.

``python benchmarks/ab_calls.py --a /tmp/base/src --b src`` runs ``bench_host.py``'s trivial
model (8 layers, 8 microbatches) under a call counter (``sys.setprofile``) with
``PYTHONPATH`` set to each ``src`` folder in turn and prints the function calls (Python and
C) per node of a serial and an overlapped ``combined_1f1b`` step, and the functions whose call counts differ most (``--modes``: also ``fill_drain``, and
today's orders run as node schedules, ``node:serial`` / ``node:overlapped`` /
``node:fill_drain``: the same steps through the schedule runner's data path; ``hand``: the
overlapped order driven by hand, one ``ModelChunkSchedulePlan.run`` per macro step, as
Megatron-Core's loop drives plans). A call
count is the same on every machine and every run, so a change of the per-node path shows
even on a loaded 2-core machine; what each call costs is ``ab_host.py``'s to measure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
STEPS = 5
_CHILD = f"""
import gc, json, re, sys
sys.path.insert(0, {str(HERE)!r})
import torch
import bench_host as bh
from moe_overlap import Microbatch, ModelChunkSchedulePlan, combined_1f1b, make_streams

torch.set_num_threads(1)
model = bh.TrivialModel(8)
mbs = [Microbatch(decoder_input=torch.randn(4)) for _ in range(8)]
streams = make_streams("cpu")
out = {{}}


def hand():
    # Megatron-Core's loop by hand: F0 | F1+B0 | ... | B(N-1), one plan run per macro step.
    back, loss = None, None
    for i, mb in enumerate(mbs):
        plan = ModelChunkSchedulePlan(model, mb, index=i, streams=streams)
        grad = torch.ones_like(loss) if back is not None else None
        loss = ModelChunkSchedulePlan.run(plan, back, b_grad=grad)
        back = plan
    ModelChunkSchedulePlan.run(None, back, b_grad=torch.ones_like(loss))


def runner(mode):
    if mode == "hand":
        return hand
    if not mode.startswith("node:"):
        kw = dict(overlap=mode != "serial", fill_drain=mode == "fill_drain")
        return lambda: combined_1f1b(model, mbs, streams=streams, **kw)
    from moe_overlap.plan import ScheduleGraph, node_schedule, today_orders

    graph = ScheduleGraph(microbatches=len(mbs), moe=(True,) * len(model.decoder.layers))
    schedule = node_schedule(today_orders(graph)[mode[len("node:"):]])
    return lambda: combined_1f1b(model, mbs, streams=streams, schedule=schedule)


for name in MODES:
    step = runner(name)
    for _ in range(3):  # warm: first-call caches and memoized checks
        step()
    counts = {{}}

    def count(frame, event, arg):
        # Every call, Python or C, added up by name (cProfile's table keeps one entry per
        # name and line, so generated functions sharing one would overwrite each other).
        if event == "call":
            code = frame.f_code
            key = code.co_filename.split("moe_overlap/")[-1] + ":" + code.co_name
        elif event == "c_call":
            key = "~:" + getattr(arg, "__qualname__", repr(arg))
        else:
            return
        counts[key] = counts.get(key, 0) + 1

    gc.collect()
    gc.disable()  # a collection's finalizers would be counted wherever it happens to run
    sys.setprofile(count)
    for _ in range({STEPS}):
        step()
    sys.setprofile(None)
    gc.enable()
    out[name] = {{re.sub(r" at 0x[0-9a-f]+", "", k): v for k, v in counts.items()}}
print(json.dumps(out))
"""
NODES_PER_STEP = 8 * (8 * 4 + 2) * 2  # microbatches x (4 slots x layers + pre/post) x F/B


MODES = (
    "serial",
    "overlapped",
    "fill_drain",
    "node:serial",
    "node:overlapped",
    "node:fill_drain",
    "hand",
)


def _calls(src: str, modes: list[str]) -> dict[str, dict[str, int]]:
    env = {**os.environ, "PYTHONPATH": src, "PYTHONHASHSEED": "0"}  # set orders decide some paths
    child = f"MODES = {modes!r}\n" + _CHILD
    out = subprocess.run(
        [sys.executable, "-c", child], capture_output=True, text=True, env=env, check=True
    )
    data: dict[str, dict[str, int]] = json.loads(out.stdout)
    return data


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Python calls per node of two library trees")
    p.add_argument("--a", required=True, help="the baseline's src folder")
    p.add_argument("--b", required=True, help="the candidate's src folder")
    p.add_argument("--top", type=int, default=10, help="how many differing functions to list")
    p.add_argument(
        "--modes",
        nargs="+",
        default=["serial", "overlapped"],
        choices=MODES,
        help="steps to count (node:...: today's orders as node schedules; trees that have them)",
    )
    args = p.parse_args(argv)
    a, b = _calls(args.a, args.modes), _calls(args.b, args.modes)
    summary: dict[str, object] = {"a_src": args.a, "b_src": args.b}
    for mode in args.modes:
        ta, tb = sum(a[mode].values()), sum(b[mode].values())
        per = STEPS * NODES_PER_STEP
        diff = {k: b[mode].get(k, 0) - a[mode].get(k, 0) for k in set(a[mode]) | set(b[mode])}
        top = sorted(diff.items(), key=lambda kv: -abs(kv[1]))[: args.top]
        summary[mode] = {
            "a_calls_per_node": ta / per,
            "b_calls_per_node": tb / per,
            "b_over_a": tb / ta,
            "most_changed": {k: v for k, v in top if v},
        }
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
