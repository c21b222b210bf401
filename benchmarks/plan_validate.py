"""The planner against measured steps: predictions from each run's serial profile only.

For every row of a ``bench_overlap.py`` results.json (its ``serial_slot_durations``) the
planner predicts the serial, overlapped (``combined_1f1b``) and fill/drain steps, and for
each ``pp_nccl.py`` pp_results.json the one-GPU pipeline step (DualPipeV, or interleaved
1F1B with its forwards and backwards paired). One figure is fitted, not
predicted: the machine's ``comm_contention`` (how much longer a copy runs under kernels),
fitted on one step (``--calibrate``, default the first row's overlapped step) and used for
every other point. Writes ``predicted_ms`` / ``measured_ms`` per point as JSON::

    python benchmarks/plan_validate.py                       # the committed round-9 files
    python benchmarks/plan_validate.py --bench R/results.json --pp R/pp_results.json ...

Standard library and moe_overlap only (CPU; no GPU needed).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import cast

from moe_overlap.plan import Costs, Layout, costs_from_profile, fit_contention, load_profile, plan

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
ROUND = RESULTS / "round9"
#: The one-GPU pipeline runs: DualPipeV (5 timed steps) and paired interleaved 1F1B (one
#: timed step, from the rerun with the gradient diagnostic).
PP_RUNS = (
    RESULTS / "round10" / "pp_dualpipev" / "pp_results.json",
    RESULTS / "round10b" / "pp_results.json",
)
Json = dict[str, object]


def _d(x: object) -> Json:
    assert isinstance(x, dict)
    return cast(Json, x)


def bench_points(results: Json) -> list[tuple[str, Costs, Layout, str, float]]:
    """``(name, costs, layout, schedule, measured_ms)`` for each row and schedule."""
    out: list[tuple[str, Costs, Layout, str, float]] = []
    for row in cast("list[object]", results["results"]):
        r = _d(row)
        config, search, step_ms = _d(r["config"]), _d(r["order_search"]), _d(r["step_ms"])
        profile = load_profile(cast("list[dict[str, object]]", search["serial_slot_durations"]))
        n = cast(int, r["microbatches"])
        costs = costs_from_profile(profile, num_layers=cast(int, config["num_layers"]))
        layout = Layout(microbatches=n)
        name = f"H{config['hidden']} F{config['ffn']} T{config['tokens']} N={n}"
        measured = {
            "serial": step_ms["serial"],
            "combined_1f1b": step_ms["overlapped"],
            "fill_drain": _d(r["fill_drain"])["overlapped_ms"],
        }
        for schedule, ms in measured.items():
            out.append((name, costs, layout, schedule, cast(float, ms)))
    return out


def pp_points(pp: Json) -> list[tuple[str, Costs, Layout, str, float]]:
    """The one-GPU DualPipeV step of ``pp_nccl.py`` (PP=1, two stages on the rank)."""
    rank = _d(cast("list[object]", pp["ranks"])[0])
    profile = load_profile(cast("list[dict[str, object]]", rank["serial_slot_durations"]))
    layers_per_stage = len({k[0] for k in profile if k[0] is not None})
    costs = costs_from_profile(profile, num_layers=2 * layers_per_stage * cast(int, pp["pp"]))
    # pp_nccl's "interleaved" is torch's interleaved 1F1B with its forwards and backwards
    # paired: the planner's combined_1f1b with two stages per rank.
    dual = pp["schedule"] == "dualpipev"
    layout = Layout(
        pp=cast(int, pp["pp"]), vpp=1 if dual else 2, microbatches=cast(int, pp["microbatches"])
    )
    return [
        (
            f"pp_nccl {pp['schedule']} PP={pp['pp']} N={pp['microbatches']}",
            costs,
            layout,
            "dualpipev" if dual else "combined_1f1b",
            cast(float, rank["overlapped_step_ms"]),
        )
    ]


def _shown(path: Path) -> str:
    path = path.resolve()
    return str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--bench", type=Path, default=ROUND / "results.json")
    p.add_argument("--pp", type=Path, nargs="*", default=list(PP_RUNS))
    p.add_argument("--calibrate", type=int, default=1, help="index of the point to fit on")
    p.add_argument("--out", type=Path, default=ROUND / "plan_validation.json")
    args = p.parse_args()
    points = bench_points(json.loads(args.bench.read_text()))
    for path in cast("list[Path]", args.pp):
        points += pp_points(json.loads(path.read_text()))
    calibrate: int = args.calibrate
    name, costs, layout, schedule, measured = points[calibrate]
    contention = fit_contention(costs, layout, schedule, measured)
    print(f"comm_contention {contention:.4f}, fitted on {name} {schedule} ({measured:.1f} ms)")
    rows: list[Json] = []
    print(f"{'point':34s} {'schedule':14s} {'predicted':>9s} {'measured':>9s} {'error':>7s}")
    for i, (name, costs, layout, schedule, measured) in enumerate(points):
        predicted = plan(costs.replace(comm_contention=contention), layout, schedule).step_ms
        error = predicted / measured - 1
        fitted = i == calibrate
        rows.append(
            {
                "point": name,
                "schedule": schedule,
                "predicted_ms": predicted,
                "measured_ms": measured,
                "error": error,
                "fitted_on": fitted,
            }
        )
        mark = "  (fitted)" if fitted else ""
        print(
            f"{name:34s} {schedule:14s} {predicted:9.1f} {measured:9.1f} {100 * error:+6.1f}%{mark}"
        )
    others = [abs(cast(float, r["error"])) for r in rows if not r["fitted_on"]]
    print(f"largest error of the {len(others)} predicted points: {100 * max(others):.1f} %")
    summary: Json = {
        "bench": str(
            args.bench.relative_to(ROOT) if args.bench.is_relative_to(ROOT) else args.bench
        ),
        "pp": [_shown(p) for p in cast("list[Path]", args.pp)],
        "comm_contention": contention,
        "points": rows,
    }
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
