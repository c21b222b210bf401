"""The frontier of exact schedules: step time against peak memory, searched in the planner's model.

    python benchmarks/frontier.py --out DIR            # several minutes on one CPU core
    python benchmarks/frontier.py --out DIR --quick    # a smaller space, under a minute
    python benchmarks/frontier.py --out DIR --one-event --wgrad-share mlp=0.5 pre_dispatch=0

For the three configurations of ``benchmarks/results/round9/results.json`` that the
planner was validated on (hidden 4096, 4096 tokens, 4 MoE layers: expert FFN 2048 with 4
and 8 microbatches, the main configuration; expert FFN 4096 with 4, where the all-to-all is
about as long as the compute) it searches exact schedules
(:func:`moe_overlap.plan.search_schedules`) from each row's measured serial profile, with
the machine's ``comm_contention`` fitted on the main configuration's overlapped step (as
``plan_validate.py`` does) and the activation model fitted on that row's measured peaks
(serial, fill/drain, serial with recomputation). Writes ``DIR/frontier.json`` (every
frontier schedule with its issue order, today's schedules, the validation, the targets),
``DIR/frontier.md`` (the tables) and, with matplotlib (the ``demo`` extra),
``DIR/frontier.png``. Standard library and moe_overlap only (CPU).

``--one-event`` times every order as the engine runs it (one event per microbatch:
:attr:`moe_overlap.plan.SearchSpace.one_event`); ``--wgrad-share`` sets the share of a
slot's backward that a delayed weight gradient moves out of it (the benchmark slice,
``benchmarks/moe_slice.py``, delays the experts' weights only: ``pre_dispatch=0``).
Both are written into ``frontier.json``'s ``space``, which ``bench_schedules.py`` replays
with. ``--contention-by-kind`` searches with a contention per communication kind
(:attr:`moe_overlap.plan.Costs.contention_by_kind`, e.g. the coefficients
``explain_prediction.py --offline`` fits on a recorded overlapped step) instead of the one
factor; ``--compute-contention-by-kind`` adds the compute stream's
(:attr:`moe_overlap.plan.Costs.compute_contention_by_kind`); ``frontier.json`` records them
and ``bench_schedules.py`` predicts with them.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from moe_overlap import ConfigError
from moe_overlap.plan import (
    ActivationModel,
    Costs,
    Layout,
    Recompute,
    SearchPoint,
    SearchResult,
    SearchSpace,
    costs_from_profile,
    fit_activations,
    fit_contention,
    load_profile,
    parse_contention_by_kind,
    plan,
    search_schedules,
)
from moe_overlap.steps import Direction, Slot

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "benchmarks" / "results" / "round9" / "results.json"
Json = dict[str, Any]

#: (name, expert FFN, microbatches, the target) of each searched configuration.
CONFIGS = (
    ("main N=4", 2048, 4, "time"),
    ("main N=8", 2048, 8, "time"),
    ("comm~compute N=4", 4096, 4, "speedup"),
)
MEMORY_LIMIT = 1.25
XMAX = 1.7
TIME_TARGET = 1.10
SPEEDUP_TARGET = 1.55
TODAY = {
    "serial": "serial",
    "overlapped": "combined 1F1B (overlapped)",
    "fill_drain": "fill/drain",
    "serial_recompute": "serial + recompute",
    "fill_drain_recompute": "fill/drain + recompute",
}
_ALL = Recompute((Slot.PRE_DISPATCH, Slot.MLP))
#: Feature sets searched on their own: what each adds within the memory limit.
ABLATION: tuple[tuple[str, Callable[[SearchSpace], SearchSpace]], ...] = (
    (
        "any exact order of today's steps (no joins; recompute as today, or none)",
        lambda s: dataclasses.replace(
            s,
            chunks=(1,),
            delay_wgrad=(False,),
            recompute=(Recompute(), _ALL),
            early_recompute=(False,),
        ),
    ),
    (
        "+ recompute started early, in the communication's shadow",
        lambda s: dataclasses.replace(
            s, chunks=(1,), delay_wgrad=(False,), recompute=(Recompute(), _ALL)
        ),
    ),
    (
        "+ delayed weight gradients",
        lambda s: dataclasses.replace(s, chunks=(1,), recompute=(Recompute(), _ALL)),
    ),
)
ROLE = {-2: "y", -1: "a", 0: "b", 1: "f", 2: "g", 3: "h", 4: "i"}


def _row(results: Json, ffn: int, n: int) -> Json:
    for r in cast("list[Json]", results["results"]):
        if r["config"]["ffn"] == ffn and r["microbatches"] == n:
            return r
    raise SystemExit(f"frontier: no row with ffn {ffn} and {n} microbatches in {SOURCE}")


def _costs(row: Json, contention: float = 0.0) -> Costs:
    profile = load_profile(
        cast("list[dict[str, object]]", row["order_search"]["serial_slot_durations"])
    )
    return costs_from_profile(
        profile, num_layers=row["config"]["num_layers"], comm_contention=contention
    )


def _measured(row: Json) -> dict[str, float]:
    s = row["step_ms"]
    return {
        "serial": s["serial"],
        "overlapped": s["overlapped"],
        "fill_drain": row["fill_drain"]["overlapped_ms"],
        "fill_drain_recompute": row["fill_drain_recompute"]["overlapped_ms"],
        "compute_only": s["compute_only"],
        "comm_only": s["comm_only"],
    }


def _params(config: Json, ffn: int) -> float:
    """Parameters of a layer (attention projections and the local experts)."""
    h = float(config["hidden"])
    return 4.0 * h * h + float(config["local_experts"]) * 3.0 * h * ffn


def template(point: SearchPoint, microbatches: int) -> list[str]:
    """The steps issued while one microbatch in the middle (``b``) runs its backward, one
    line per layer of it; the others named by their distance (``f``: the next, ``g``: the
    one after, ``a``: the one before)."""
    mb = max(0, microbatches // 2 - 1)
    order = [s for s in point.order if s is not None]
    mine = [
        k
        for k, s in enumerate(order)
        if s.microbatch == mb and s.direction is not Direction.FORWARD
    ]
    lo = next(k for k in mine if order[k].slot is Slot.POST_PROCESS)
    hi = mine[-1]
    lines: list[list[str]] = [[]]
    for s in order[lo : hi + 1]:
        starts_layer = (
            s.microbatch == mb
            and s.slot is Slot.COMBINE
            and s.direction is Direction.BACKWARD
            and s.chunk in (None, 0)
        )
        if starts_layer and lines[-1]:
            lines.append([])
        role = ROLE.get(s.microbatch - mb, f"m{s.microbatch}")
        layer = "" if s.layer is None else f"L{s.layer}."
        chunk = "" if s.chunk is None else f"[{s.chunk}]"
        d = "R" if s.recompute else s.direction.value
        lines[-1].append(f"{role}.{layer}{s.slot.value}{chunk}.{d}")
    return [" ".join(line) for line in lines]


def _point_json(p: SearchPoint, *, order: bool = False) -> Json:
    out: Json = {
        "schedule": p.schedule,
        "step_ms": p.step_ms,
        "memory": p.memory,
        "comp_ms": p.comp_ms,
        "comm_ms": p.comm_ms,
        "chunks": p.graph.chunks,
        "delay_wgrad": p.graph.delay_wgrad,
        "recomputed": len(p.graph.recompute),
    }
    if order:  # the issue order, steps space-separated, "|" for a join
        out["order"] = " ".join("|" if s is None else str(s) for s in p.order)
    return out


def _targets(kind: str, res: SearchResult, measured: dict[str, float], limit: float | None) -> Json:
    serial = res.today["serial"]
    model_max = max(serial.comp_ms, serial.comm_ms)
    measured_max = max(measured["compute_only"], measured["comm_only"])
    fits = [p for p in res.frontier if limit is None or p.memory <= limit + 1e-9]
    best = min(fits, key=lambda p: p.step_ms)
    out: Json = {
        "kind": kind,
        "memory_limit": limit,
        "best": best.schedule,
        "best_ms": best.step_ms,
        "best_memory": best.memory,
        "model_compute_ms": serial.comp_ms,
        "model_comm_ms": serial.comm_ms,
        "measured_compute_ms": measured["compute_only"],
        "measured_comm_ms": measured["comm_only"],
    }
    if kind == "time":
        out["model_goal_ms"] = TIME_TARGET * model_max
        out["measured_goal_ms"] = TIME_TARGET * measured_max
        out["best_over_model_max"] = best.step_ms / model_max
        out["best_over_measured_max"] = best.step_ms / measured_max
    else:
        out["model_goal_ms"] = serial.step_ms / SPEEDUP_TARGET
        out["measured_goal_ms"] = measured["serial"] / SPEEDUP_TARGET
        out["best_speedup_model"] = serial.step_ms / best.step_ms
    out["reached_model"] = best.step_ms <= out["model_goal_ms"]
    out["reached_measured_ms"] = best.step_ms <= out["measured_goal_ms"]
    return out


def _best(frontier: list[SearchPoint]) -> Json:
    """The fastest point within the memory limit, and at any memory."""
    within = [p for p in frontier if p.memory <= MEMORY_LIMIT + 1e-9]
    a = min(within, key=lambda p: p.step_ms)
    b = min(frontier, key=lambda p: p.step_ms)
    return {
        "within_ms": a.step_ms,
        "within_memory": a.memory,
        "within": a.schedule,
        "any_ms": b.step_ms,
        "any_memory": b.memory,
        "any": b.schedule,
    }


def _table(cfg: Json) -> list[str]:
    lines = [
        f"**{cfg['name']}** (expert FFN {cfg['ffn']}, {cfg['microbatches']} microbatches): "
        f"the model's compute / comm {cfg['targets']['model_compute_ms']:.1f} / "
        f"{cfg['targets']['model_comm_ms']:.1f} ms (measured alone: "
        f"{cfg['targets']['measured_compute_ms']:.1f} / {cfg['targets']['measured_comm_ms']:.1f})",
        "",
        "| schedule | step ms | memory x serial | chunks | weight gradients | recomputed slots |",
        "|---|---|---|---|---|---|",
    ]
    today_names = {v["schedule"] for v in cfg["today"].values()}
    for p in cfg["frontier"]:
        if p["schedule"] in today_names:
            name = f"today: {TODAY[p['schedule']]}"
        else:
            name = p["schedule"].split(" recompute=")[-1]
            name = "searched: " + name.replace(" +local search", ", then local search")
        wgrad = "delayed" if p["delay_wgrad"] else "in backward"
        lines.append(
            f"| {name} | {p['step_ms']:.1f} | {p['memory']:.3f} | {p['chunks']} | {wgrad} "
            f"| {p['recomputed']} |"
        )
    lines.append("")
    lines.append("What each feature adds (the fastest schedule found with it):")
    lines.append("")
    lines.append("| features | within 1.25x memory: ms (memory) | at any memory: ms (memory) |")
    lines.append("|---|---|---|")
    for a in cfg["ablation"]:
        lines.append(
            f"| {a['features']} | {a['within_ms']:.1f} ({a['within_memory']:.3f}x) "
            f"| {a['any_ms']:.1f} ({a['any_memory']:.3f}x) |"
        )
    lines.append("")
    lines.append("Today's schedules in the same model (not on the frontier unless listed above):")
    lines.append("")
    lines.append("| schedule | step ms | memory x serial | measured ms |")
    lines.append("|---|---|---|---|")
    for key, t in cfg["today"].items():
        m = t.get("measured_ms")
        lines.append(
            f"| {TODAY[key]} | {t['step_ms']:.1f} | {t['memory']:.3f} | "
            f"{'' if m is None else f'{m:.1f}'} |"
        )
    return lines


def _png(configs: list[Json], path: Path) -> Path | None:
    try:
        matplotlib: Any = importlib.import_module("matplotlib")
        matplotlib.use("Agg")
        plt: Any = importlib.import_module("matplotlib.pyplot")
    except ImportError:
        print("frontier: no PNG without matplotlib; pip install 'moe-overlap[demo]'")
        return None
    fig, axes = plt.subplots(1, len(configs), figsize=(5.2 * len(configs), 4.6))
    marks = {
        "serial": ("s", "black"),
        "overlapped": ("o", "tab:blue"),
        "fill_drain": ("D", "tab:orange"),
        "serial_recompute": ("v", "tab:grey"),
        "fill_drain_recompute": ("^", "tab:purple"),
    }
    for ax, cfg in zip(axes, configs, strict=True):
        tried = cfg["tried"]
        ax.scatter(
            [m for _, m in tried],
            [t for t, _ in tried],
            s=4,
            c="lightgrey",
            label="searched schedules",
        )
        fr = cfg["frontier"]
        ax.step(
            [p["memory"] for p in fr] + [XMAX],
            [p["step_ms"] for p in fr] + [fr[-1]["step_ms"]],
            where="post",
            c="tab:green",
            lw=1.8,
            label="frontier (exact schedules)",
        )
        for key, t in cfg["today"].items():
            shape, colour = marks[key]
            ax.scatter(
                [t["memory"]],
                [t["step_ms"]],
                marker=shape,
                c=colour,
                s=46,
                zorder=3,
                label=f"today: {TODAY[key]}",
            )
        goal = cfg["targets"]["model_goal_ms"]
        what = "1.10 x max(compute, comm), or 1.55x faster than serial (comm~compute)"
        ax.axhline(goal, c="tab:red", ls="--", lw=1, label=f"target in the model: {what}")
        if cfg["targets"]["memory_limit"] is not None:
            ax.axvline(MEMORY_LIMIT, c="tab:red", ls=":", lw=1, label="memory limit 1.25x serial")
        top = cfg["today"]["overlapped"]["step_ms"] * 1.08
        ax.set_ylim(min(goal, min(p["step_ms"] for p in fr)) * 0.97, top)
        ax.set_xlim(0.8, XMAX)
        ax.set_xlabel("peak memory (x the serial step's)")
        ax.set_ylabel("predicted step time (ms)")
        serial = cfg["today"]["serial"]["step_ms"]
        ax.set_title(f"{cfg['name']} (serial {serial:.0f} ms, above the chart)", fontsize=10)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8)
    fig.suptitle(
        "Exact schedules searched in the planner's model: step time against peak memory (H200 profiles)",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0.13, 1, 0.95))
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _shares(
    p: argparse.ArgumentParser, given: list[str] | None
) -> tuple[tuple[Slot, float], ...] | None:
    """``--wgrad-share``'s ``SLOT=SHARE`` words as the search space's pairs (``None``: not
    given); a bad word is the parser's one-line error."""
    if given is None:
        return None
    out: dict[Slot, float] = {}
    for word in given:
        name, _, value = word.partition("=")
        try:
            slot, share = Slot(name), float(value)
        except ValueError:
            p.error(f"--wgrad-share: expected SLOT=SHARE (mlp or pre_dispatch), got {word!r}")
        if slot not in (Slot.MLP, Slot.PRE_DISPATCH) or not 0.0 <= share <= 1.0 or slot in out:
            p.error(
                f"--wgrad-share: expected mlp or pre_dispatch, once each, with a share in "
                f"[0, 1], got {word!r}"
            )
        out[slot] = share
    return tuple(out.items())


def _by_kind(
    p: argparse.ArgumentParser, words: list[str] | None, *, compute: bool = False
) -> dict[tuple[Slot, Direction], float] | None:
    """``--contention-by-kind``'s (``compute``: ``--compute-contention-by-kind``'s) ``KIND=C``
    words as a coefficient per (slot, direction) (:func:`parse_contention_by_kind`); a bad
    word is the parser's one-line error."""
    if words is None:
        return None
    flag = "--compute-contention-by-kind" if compute else "--contention-by-kind"
    try:
        return parse_contention_by_kind(flag, words, compute=compute)
    except ConfigError as e:
        p.error(str(e))


def _per_kind(
    costs: Costs,
    by_kind: dict[tuple[Slot, Direction], float] | None,
    compute: dict[tuple[Slot, Direction], float] | None,
) -> Costs:
    """``costs`` with the coefficients per kind in place of the one factor."""
    return costs.replace(
        comm_contention=0.0, contention_by_kind=by_kind, compute_contention_by_kind=compute
    )


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="folder to write into (required)")
    p.add_argument("--quick", action="store_true", help="a smaller space (default: off)")
    p.add_argument(
        "--one-event",
        action="store_true",
        help="time orders as the engine runs them, one event per microbatch (default: off)",
    )
    p.add_argument(
        "--wgrad-share",
        nargs="+",
        default=None,
        metavar="SLOT=SHARE",
        help="share of a slot's backward a delayed weight gradient takes, per slot "
        "(mlp, pre_dispatch; a slot not named: 0; default: mlp=0.5 pre_dispatch=0.35)",
    )
    p.add_argument(
        "--contention-by-kind",
        nargs="+",
        default=None,
        metavar="KIND=C",
        help="a contention coefficient per communication kind (dispatch.F, dispatch.B, "
        "combine.F, combine.B; a kind not named: 0) instead of the one fitted factor "
        "(default: the one factor)",
    )
    p.add_argument(
        "--compute-contention-by-kind",
        nargs="+",
        default=None,
        metavar="KIND=C",
        help="a coefficient per compute kind (pre_dispatch.F, mlp.B, mlp.W, mlp.R, ...; a kind "
        "not named: 0): its nodes slowed while an all-to-all runs (default: none)",
    )
    args = p.parse_args()
    shares = _shares(p, cast("list[str] | None", args.wgrad_share))
    by_kind = _by_kind(p, cast("list[str] | None", args.contention_by_kind))
    compute = _by_kind(p, cast("list[str] | None", args.compute_contention_by_kind), compute=True)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    results = cast(Json, json.loads(SOURCE.read_text()))
    main_row = _row(results, 2048, 4)
    contention = fit_contention(
        _costs(main_row), Layout(microbatches=4), "combined_1f1b", _measured(main_row)["overlapped"]
    )
    print(f"comm_contention {contention:.4f}, fitted on main N=4's overlapped step")
    mem = main_row["memory"]
    suffix = "free_input_True"
    peak = {
        (k[: -len(suffix)].rstrip("_") or "overlapped"): v["peak_GB"]
        for k, v in mem.items()
        if k.endswith(suffix)
    }
    config = main_row["config"]
    base = ActivationModel.of_layer(hidden=config["hidden"], moe_ffn=2048, top_k=config["top_k"])
    memory, unit_gb = fit_activations(
        base,
        _costs(main_row, contention),
        4,
        serial=peak["serial"],
        fill_drain=peak["fill_drain"],
        serial_recompute=peak["serial_recompute"],
    )
    print(
        f"activation unit {unit_gb:.4f} GB, static {memory.static_units:.1f} units, "
        f"a recomputed slot drops {memory.recompute_saves:.3f} of its activations"
    )
    space = SearchSpace(
        memory_caps=(None, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3),
        rules=("oldest", "critical", "forward"),
    )
    if args.quick:
        space = SearchSpace(
            chunks=(1, 2),
            in_flight=(2, 3),
            memory_caps=(None, 1.2),
            rules=("oldest", "critical"),
            slack_ms=(0.0,),
            improve_passes=0,
        )
    space = dataclasses.replace(
        space, one_event=args.one_event, wgrad_share=shares or space.wgrad_share
    )
    configs: list[Json] = []
    started = time.monotonic()
    for name, ffn, n, kind in CONFIGS:
        row = _row(results, ffn, n)
        costs = _costs(row, contention)
        model = (
            base
            if ffn == 2048
            else ActivationModel.of_layer(
                hidden=config["hidden"], moe_ffn=ffn, top_k=config["top_k"]
            )
        )
        # the static part grows with the parameters (and their gradients)
        static = memory.static_units * _params(config, ffn) / _params(config, 2048)
        model = ActivationModel(
            units=model.units,
            static_units=static,
            recompute_saves=memory.recompute_saves,
            wgrad_keeps=memory.wgrad_keeps,
        )
        per_kind = by_kind is not None or compute is not None
        searched = _per_kind(costs, by_kind, compute) if per_kind else costs
        res = search_schedules(searched, n, model, space)
        ablation: list[Json] = []
        for label, narrow in ABLATION:
            sub = search_schedules(searched, n, model, narrow(space))
            ablation.append({"features": label, **_best(sub.frontier)})
        ablation.append(
            {
                "features": "+ partial recompute and chunked all-to-all (the whole space)",
                **_best(res.frontier),
            }
        )
        measured = _measured(row)
        today: Json = {}
        for key, t in res.today.items():
            entry = _point_json(t)
            entry["measured_ms"] = measured.get(key)
            if key in ("serial", "overlapped", "fill_drain"):
                sched = {"overlapped": "combined_1f1b"}.get(key, key)
                entry["plan_ms"] = plan(costs, Layout(microbatches=n), sched).step_ms
            if key in peak and ffn == 2048 and n == 4:
                entry["measured_memory"] = peak[key] / peak["serial"]
            today[key] = entry
        limit = MEMORY_LIMIT if kind == "time" else None
        targets = _targets(kind, res, measured, limit)
        if kind != "time":  # also the best point within the memory limit
            targets["best_within_limit"] = _targets("speedup", res, measured, MEMORY_LIMIT)
        best = next(q for q in res.frontier if q.schedule == targets["best"])
        configs.append(
            {
                "name": name,
                "ffn": ffn,
                "microbatches": n,
                "today": today,
                "frontier": [_point_json(q) for q in res.frontier],
                "tried": sorted({(round(t, 1), round(m, 3)) for t, m in res.tried}),
                "targets": targets,
                "best_template": template(best, n),
                "best_order": _point_json(best, order=True)["order"],
                "ablation": ablation,
            }
        )
        print(
            f"{name}: {len(res.tried)} schedules, frontier of {len(res.frontier)}, "
            f"best {targets['best_ms']:.1f} ms at {targets['best_memory']:.3f}x memory "
            f"({time.monotonic() - started:.0f} s)"
        )
    summary: Json = {
        "command": " ".join(
            [
                "python benchmarks/frontier.py --out DIR",
                *(["--quick"] if args.quick else []),
                *(["--one-event"] if args.one_event else []),
                *(["--wgrad-share", *args.wgrad_share] if args.wgrad_share else []),
                *(
                    ["--contention-by-kind", *args.contention_by_kind]
                    if args.contention_by_kind
                    else []
                ),
                *(
                    ["--compute-contention-by-kind", *args.compute_contention_by_kind]
                    if args.compute_contention_by_kind
                    else []
                ),
            ]
        ),
        "source": str(SOURCE.relative_to(ROOT)),
        "comm_contention": contention,
        "contention_by_kind": None
        if by_kind is None
        else {f"{k[0].value}.{k[1].value}": c for k, c in by_kind.items()},
        "compute_contention_by_kind": None
        if compute is None
        else {f"{k[0].value}.{k[1].value}": c for k, c in compute.items()},
        "activations": {
            "unit_gb": unit_gb,
            "static_units_main": memory.static_units,
            "recompute_saves": memory.recompute_saves,
            "wgrad_keeps": memory.wgrad_keeps,
            "units_per_layer_main": {s.value: u for s, u in base.units.items()},
        },
        "space": {
            "chunks": space.chunks,
            "chunk_overhead_ms": space.chunk_overhead_ms,
            "wgrad_share": {s.value: v for s, v in space.wgrad_share},
            "one_event": space.one_event,
            "recompute_cost": space.recompute_cost,
            "recompute": [str(r) for r in space.recompute],
            "in_flight": space.in_flight,
            "memory_caps": space.memory_caps,
            "rules": space.rules,
            "slack_ms": space.slack_ms,
            "improve_passes": space.improve_passes,
            "improve_window": space.improve_window,
        },
        "configs": configs,
    }
    (out / "frontier.json").write_text(json.dumps(summary, separators=(",", ":")) + "\n")
    md: list[str] = []
    for cfg in configs:
        md += _table(cfg)
        t = cfg["targets"]
        md.append("")
        md.append(
            f"Best {'within 1.25x memory' if t['memory_limit'] else 'at any memory'}: "
            f"{t['best_ms']:.1f} ms at {t['best_memory']:.3f}x, `{t['best']}`; per layer "
            f"of the middle microbatch's backward:"
        )
        md.append("")
        md += [f"    {line}" for line in cfg["best_template"]]
        md.append("")
    (out / "frontier.md").write_text("\n".join(md) + "\n")
    png = _png(configs, out / "frontier.png")
    print(f"wrote {out / 'frontier.json'}, {out / 'frontier.md'}" + (f", {png}" if png else ""))


if __name__ == "__main__":
    main()
