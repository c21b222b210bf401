"""How long ``pair_overlap_f_b`` takes, before and after its wait-graph check (CPU only).

For ``ScheduleInterleaved1F1B`` (the schedule ``prepare_schedule(..., pair=True)`` and the
planner's ``combined_1f1b`` at pp > 1 pair) at each pp and microbatch count: the library's
pairing (``after``: each trial checked on the wait graph, torch confirming refusals and the
result) and the old one (``before``: torch's whole send/recv placement per trial,
``tests/integrations/_pairing_reference.py``), which is quadratic or worse in microbatches,
so it runs only up to ``--before-up-to`` microbatches; where both run, their pairs must be
the same (exit 1 otherwise). ``after`` is the best of 3 runs, ``before`` one run, each
after a garbage collection, in this process; the order's construction (``schedule_order``)
is not timed.

    python benchmarks/bench_pairing.py
    python benchmarks/bench_pairing.py --pp 4 --microbatches 256 --before-up-to 256
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TypeVar

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_ROOT / "src"), str(_ROOT)]  # this tree's library, and tests/ (the old pairing)

SCHEDULE = "ScheduleInterleaved1F1B"
T = TypeVar("T")


def main(argv: list[str] | None = None) -> int:
    from tests.integrations._pairing_reference import pair_overlap_f_b_reference

    from moe_overlap.integrations.pipelining import pair_overlap_f_b, schedule_order, stage_rank

    p = argparse.ArgumentParser(description="Time pair_overlap_f_b before and after (CPU).")
    p.add_argument("--pp", type=int, nargs="+", default=[4, 8])
    p.add_argument("--vpp", type=int, default=2, help="stages per pipeline rank")
    p.add_argument("--microbatches", type=int, nargs="+", default=[32, 64, 128, 256, 1024])
    p.add_argument(
        "--before-up-to",
        type=int,
        default=64,
        help="time the old pairing only up to this many microbatches (it is quadratic)",
    )
    args = p.parse_args(argv)
    print(f"{SCHEDULE}, vpp={args.vpp}: seconds to pair (after: best of 3; before: one run)")
    print(f"{'pp':>3} {'microbatches':>12} {'pairs':>6} {'before s':>9} {'after s':>8} {'x':>6}")
    differ: list[tuple[int, int]] = []
    for pp in args.pp:
        rank_of = stage_rank(SCHEDULE, pp)
        stages = pp * args.vpp
        for n_mb in args.microbatches:
            order = schedule_order(SCHEDULE, pp=pp, stages_per_rank=args.vpp, n_microbatches=n_mb)
            runs = [
                _timed(partial(pair_overlap_f_b, order, num_stages=stages, stage_to_rank=rank_of))
                for _ in range(3)
            ]
            after, after_s = runs[0][0], min(seconds for _, seconds in runs)
            pairs = sum(
                1 for acts in after.values() for a in acts if a is not None and a.sub_actions
            )
            before_s = float("nan")
            if n_mb <= args.before_up_to:
                before, before_s = _timed(
                    partial(
                        pair_overlap_f_b_reference, order, num_stages=stages, stage_to_rank=rank_of
                    )
                )
                if before != after:
                    differ.append((pp, n_mb))
            shown = "skipped" if before_s != before_s else f"{before_s:.2f}"
            ratio = "" if before_s != before_s else f"{before_s / after_s:.0f}"
            print(f"{pp:>3} {n_mb:>12} {pairs:>6} {shown:>9} {after_s:>8.2f} {ratio:>6}")
    if differ:
        print(f"DIFFERENT PAIRS (pp, microbatches): {differ}", file=sys.stderr)
        return 1
    return 0


def _timed(call: Callable[[], T]) -> tuple[T, float]:
    """``call()`` and its seconds, after a garbage collection."""
    gc.collect()
    start = time.perf_counter()
    done = call()
    return done, time.perf_counter() - start


if __name__ == "__main__":
    raise SystemExit(main())
