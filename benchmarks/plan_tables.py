"""The planner's tables in ``docs/planning.md``: DeepSeek-V3-like and Qwen3-235B-like
layouts at 64-2048 GPUs, and where the overlap stops paying.

Usage: ``python benchmarks/plan_tables.py`` rewrites the part of ``docs/planning.md``
between ``<!-- plan:begin -->`` and ``<!-- plan:end -->`` and writes
``benchmarks/results/plan_tables.json``; ``--check`` changes nothing and exits 1 when the
page is stale (from the saved JSON, recomputing the first layout of each model). About a
minute on one core (torch's send/recv placement checks each pairing of combined 1F1B).
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path
from typing import Any

from moe_overlap.plan import Costs, Layout, Machine, ModelSpec, costs_from_model, plan

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "planning.md"
OUT = ROOT / "benchmarks" / "results" / "plan_tables.json"
BEGIN, END = "<!-- plan:begin -->", "<!-- plan:end -->"

#: (GPUs, EP, PP, DP): EP within a node up to 8 GPUs, then across nodes; PP across nodes.
LAYOUTS = ((64, 8, 8, 1), (256, 32, 8, 1), (1024, 64, 16, 1), (2048, 64, 16, 2))
MODELS = (("deepseek-v3-671b", "h800"), ("qwen3-235b-a22b", "h100"))
SEQ = 4096
SCHEDULES = ("serial", "combined_1f1b", "dualpipev")


def _layout(ep: int, pp: int, dp: int) -> Layout:
    """Two stages per pipeline rank for every schedule (interleaved for serial and combined
    1F1B, a V for DualPipeV), 2 x PP microbatches per pipeline."""
    return Layout(ep=ep, pp=pp, dp=dp, vpp=2, microbatches=2 * pp)


def _comm_share(costs: Costs) -> float:
    """Milliseconds of all-to-all per millisecond of compute, over one microbatch."""
    comm = comp = 0.0
    for (_layer, slot, _direction), ms in costs.times.items():
        if slot.value in ("dispatch", "combine"):
            comm += ms
        else:
            comp += ms
    return comm / comp


def _scaled(costs: Costs, factor: float) -> Costs:
    times = {
        k: ms * factor if k[1].value in ("dispatch", "combine") else ms
        for k, ms in costs.times.items()
    }
    return costs.replace(times=times)


def model_rows(name: str, machine_name: str) -> list[dict[str, object]]:
    model = ModelSpec.preset(name, seq_len=SEQ)
    machine = Machine.preset(machine_name)
    rows: list[dict[str, object]] = []
    for gpus, ep, pp, dp in LAYOUTS:
        layout = _layout(ep, pp, dp)
        costs = costs_from_model(model, machine, layout)
        row: dict[str, object] = {"gpus": gpus, "ep": ep, "pp": pp, "dp": dp}
        for schedule in SCHEDULES:
            p = plan(costs, layout, schedule)
            row[schedule] = {
                "step_ms": p.step_ms,
                "bubble_fraction": p.bubble_fraction,
                "peak_activation_GB": p.peak_activation_bytes / 1e9,
            }
        row["comm_per_compute"] = _comm_share(costs)
        row["microbatches"] = layout.microbatches
        rows.append(row)
        print(f"{name} {gpus} GPUs done", flush=True)
    return rows


def break_even(name: str, machine_name: str) -> list[dict[str, float]]:
    """Speed-ups over serial as the all-to-all is scaled, at the 256-GPU layout."""
    model = ModelSpec.preset(name, seq_len=SEQ)
    machine = Machine.preset(machine_name)
    _, ep, pp, dp = LAYOUTS[1]
    layout = _layout(ep, pp, dp)
    unscaled = costs_from_model(model, machine, layout)
    out: list[dict[str, float]] = []
    for factor in (0.05, 0.25, 0.5, 1.0, 2.0, 4.0):
        costs = _scaled(unscaled, factor)
        serial = plan(costs, layout, "serial").step_ms
        point = {"comm_per_compute": _comm_share(costs)}
        for schedule in ("combined_1f1b", "dualpipev"):
            point[schedule] = serial / plan(costs, layout, schedule).step_ms
        out.append(point)
    return out


def _block(data: Any) -> str:
    lines = [BEGIN, ""]
    for (name, machine_name), rows in zip(MODELS, data["models"].values(), strict=True):
        lines += [
            f"**{name}-like on {machine_name.upper()}** (sequence {SEQ}, one sequence per "
            "microbatch, 2 x PP microbatches, two stages per pipeline rank):",
            "",
            "| GPUs | EP x PP x DP | comm / compute | serial s | combined 1F1B | DualPipeV | "
            "bubble serial / comb. / DPV | peak activations GB serial / comb. / DPV |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            s, c, d = r["serial"], r["combined_1f1b"], r["dualpipev"]
            lines.append(
                f"| {r['gpus']} | {r['ep']} x {r['pp']} x {r['dp']} | "
                f"{r['comm_per_compute']:.2f} | {s['step_ms'] / 1e3:.2f} | "
                f"{s['step_ms'] / c['step_ms']:.2f}x | {s['step_ms'] / d['step_ms']:.2f}x | "
                f"{100 * s['bubble_fraction']:.0f} / {100 * c['bubble_fraction']:.0f} / "
                f"{100 * d['bubble_fraction']:.0f} % | "
                f"{s['peak_activation_GB']:.0f} / {c['peak_activation_GB']:.0f} / "
                f"{d['peak_activation_GB']:.0f} |"
            )
        lines.append("")
    lines += [
        "**Where the overlap stops paying** (the 256-GPU layout, every all-to-all scaled):",
        "",
        "| model | comm / compute | combined 1F1B vs serial | DualPipeV vs serial |",
        "|---|---|---|---|",
    ]
    for name, points in data["break_even"].items():
        for pt in points:
            lines.append(
                f"| {name} | {pt['comm_per_compute']:.2f} | {pt['combined_1f1b']:.2f}x | "
                f"{pt['dualpipev']:.2f}x |"
            )
    lines += ["", END]
    return "\n".join(lines)


def _stale_rows(data: Any) -> list[str]:
    """The first layout of each model recomputed against ``data`` (the rest would take a
    minute): what differs."""
    out: list[str] = []
    for (name, machine_name), rows in zip(MODELS, data["models"].values(), strict=True):
        saved = rows[0]
        _, ep, pp, dp = LAYOUTS[0]
        layout = _layout(ep, pp, dp)
        model = ModelSpec.preset(name, seq_len=SEQ)
        costs = costs_from_model(model, Machine.preset(machine_name), layout)
        for schedule in SCHEDULES:
            ms = plan(costs, layout, schedule).step_ms
            want = saved[schedule]["step_ms"]
            if abs(ms - want) > 1e-6 * want:
                out.append(f"{name} {schedule}: {ms} ms now, {want} ms in {OUT.name}")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument(
        "--check",
        action="store_true",
        help="exit 1 when docs/planning.md differs from the saved JSON, or the first layout "
        "of each model no longer predicts what the JSON holds",
    )
    args = p.parse_args()
    text = PAGE.read_text(encoding="utf-8")
    start, end = text.index(BEGIN), text.index(END) + len(END)
    if args.check:
        data: Any = json.loads(OUT.read_text(encoding="utf-8"))
        new = text[:start] + _block(data) + text[end:]
        stale = _stale_rows(data)
        for line in stale:
            print(line)
        if new != text:
            sys.stdout.writelines(
                difflib.unified_diff(text.splitlines(True), new.splitlines(True), "page", "new")
            )
        return 1 if stale or new != text else 0
    data = {
        "seq_len": SEQ,
        "models": {f"{m}@{g}": model_rows(m, g) for m, g in MODELS},
        "break_even": {m: break_even(m, g) for m, g in MODELS},
    }
    PAGE.write_text(text[:start] + _block(data) + text[end:], encoding="utf-8")
    OUT.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {PAGE}\nwrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
