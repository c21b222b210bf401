"""A/B of the schedule's host cost: ``bench_host.py`` against two library trees, interleaved.

``python benchmarks/ab_host.py --a /tmp/base/src --b src --rounds 7`` runs
``benchmarks/bench_host.py`` (this tree's) with ``PYTHONPATH`` set to each ``src`` folder
in turn, ``rounds`` times, and prints the median and minimum microseconds per node of
each, and B's difference from A. Interleaving keeps a slow moment of the machine from
landing on one side only. CPU only, about 10 s a round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent / "bench_host.py"
KEYS = ("overlapped_us_per_node", "serial_us_per_node")


def _one(src: str, repeats: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": src}
    out = subprocess.run(
        [sys.executable, str(BENCH), "--repeats", str(repeats)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    data: dict[str, float] = json.loads(out.stdout)
    return {k: data[k] for k in KEYS}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="interleaved host-cost A/B of two library trees")
    p.add_argument("--a", required=True, help="the baseline's src folder")
    p.add_argument("--b", required=True, help="the candidate's src folder")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--repeats", type=int, default=60)
    args = p.parse_args(argv)
    runs: dict[str, list[dict[str, float]]] = {"a": [], "b": []}
    for _ in range(args.rounds):
        runs["a"].append(_one(args.a, args.repeats))
        runs["b"].append(_one(args.b, args.repeats))
    summary: dict[str, dict[str, float]] = {}
    for side in ("a", "b"):
        for key in KEYS:
            values = [r[key] for r in runs[side]]
            summary.setdefault(side, {})[f"{key}_median"] = statistics.median(values)
            summary[side][f"{key}_min"] = min(values)
    for key in KEYS:
        a = summary["a"][f"{key}_median"]
        b = summary["b"][f"{key}_median"]
        summary.setdefault("b_minus_a", {})[f"{key}_median"] = b - a
        summary.setdefault("b_over_a", {})[f"{key}_median"] = b / a
    print(
        json.dumps({"a_src": args.a, "b_src": args.b, "rounds": args.rounds, **summary}, indent=1)
    )


if __name__ == "__main__":
    main()
