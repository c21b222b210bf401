"""The README's headline figures, generated from a ``bench_overlap.py`` results.json.

Usage: ``python benchmarks/readme_table.py`` rewrites the part of ``README.md`` between
``<!-- bench:begin -->`` and ``<!-- bench:end -->`` from ``benchmarks/results/results.json``
(its first row, the main configuration; the efficiency range from the rows of the sweep)
and points the timeline figure at the ``timeline.png`` beside that results.json;
``--check`` changes nothing and exits 1 when the README is stale.

Refused (exit 2): results from the CPU, results timed with fewer warm-ups or timed steps
than the method asks (``MIN_WARMUP`` / ``MIN_ITERS``, as in ``bench_overlap.py``), results
without spreads (timed before the method), and a timeline that is not from the same run
(its title's median must be the main row's). Standard library only: no torch needed.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
import textwrap
from pathlib import Path
from typing import cast

ROOT = Path(__file__).resolve().parents[1]
BEGIN = "<!-- bench:begin -->"
END = "<!-- bench:end -->"
#: As in ``bench_overlap.py`` (not imported: that module needs torch).
MIN_WARMUP, MIN_ITERS = 2, 5

Json = dict[str, object]


class ResultsError(Exception):
    """The results cannot back the README's figures."""


def _d(x: object, what: str) -> Json:
    if not isinstance(x, dict):
        raise ResultsError(f"{what}: expected an object, got {type(x).__name__}")
    return {str(k): v for k, v in cast("dict[object, object]", x).items()}


def _f(x: object, what: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise ResultsError(f"{what}: expected a number, got {x!r}")
    return float(x)


def _rows(doc: Json) -> list[Json]:
    rows = doc.get("results")
    if not isinstance(rows, list) or not rows:
        raise ResultsError("results.json has no rows")
    return [_d(r, f"results[{i}]") for i, r in enumerate(cast("list[object]", rows))]


def validate(doc: Json) -> None:
    """Raise :class:`ResultsError` unless every row was timed by the method on a GPU."""
    env = _d(doc.get("env"), "env")
    if env.get("device") in (None, "cpu"):
        raise ResultsError(
            f"results.json is from device {env.get('device')!r} ({env.get('argv')}): the "
            "README shows device results; run bench_overlap.py on the GPU"
        )
    for i, r in enumerate(_rows(doc)):
        if "warmup" not in r or "step_ms_spread" not in r:
            raise ResultsError(
                f"row {i} has no warm-up count or spreads: timed before the method "
                "(bench_overlap.py of issue 27 on)"
            )
        warmup, iters = _f(r.get("warmup"), "warmup"), _f(r.get("iters"), "iters")
        if warmup < MIN_WARMUP or iters < MIN_ITERS:
            raise ResultsError(
                f"row {i}: {warmup:g} warm-ups and {iters:g} timed steps; the method asks "
                f"for at least {MIN_WARMUP} and {MIN_ITERS}"
            )


def timeline_of(results_path: Path, row: Json) -> Path:
    """The timeline PNG beside ``results_path``, checked to come from the same run."""
    png = results_path.parent / "timeline.png"
    trace = results_path.parent / "timeline_trace.json"
    if not png.is_file() or not trace.is_file():
        raise ResultsError(f"no timeline.png and timeline_trace.json beside {results_path}")
    events = json.loads(trace.read_text()).get("traceEvents", [])
    title = str(events[0]["args"]["name"]) if events else ""
    overlapped = _f(_d(row["step_ms"], "step_ms")["overlapped"], "overlapped")
    want = f"({overlapped:.1f} ms median)"
    if want not in title:
        raise ResultsError(
            f"{trace} is not from this run: its title {title!r} lacks {want!r} (main row)"
        )
    return png


def _pct(x: object) -> str:
    return f"{100 * _f(x, 'spread'):.1f} %"


def _range(xs: list[float]) -> str:
    lo, hi = min(xs), max(xs)
    return f"{lo:.2f}" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}\u2013{hi:.2f}"


def _wrap(text: str) -> str:
    return textwrap.fill(text, width=90, break_long_words=False, break_on_hyphens=False)


def _link(target: Path, readme: Path) -> str:
    return Path(os.path.relpath(target.resolve(), readme.resolve().parent)).as_posix()


def render(doc: Json, results_path: Path, readme: Path) -> str:
    """The README's block (between the markers, markers excluded) for ``doc``."""
    validate(doc)
    env = _d(doc["env"], "env")
    rows = _rows(doc)
    row = rows[0]
    c = _d(row["config"], "config")
    m = _d(row["step_ms"], "step_ms")
    sp = _d(row["step_ms_spread"], "step_ms_spread")
    fd = _d(row["fill_drain"], "fill_drain")
    n = row["microbatches"]
    device = str(env["device"]).removeprefix("NVIDIA ")
    dtype = {"torch.bfloat16": "bf16", "torch.float32": "fp32"}.get(str(c["dtype"]), c["dtype"])
    comm = {
        "host": "a real round trip of the dispatched tokens through pinned host memory on "
        "the comm stream",
        "device": "one device-side copy",
    }.get(str(c.get("loopback")), f"loopback {c.get('loopback')}")
    sweep = [r for r in rows if r["microbatches"] == n]
    effs = [_f(r["efficiency"], "efficiency") for r in sweep]
    ovmax = [_f(r["overlapped_over_max"], "overlapped_over_max") for r in sweep]
    cap = max(_f(m["compute_only"], "compute_only"), _f(m["comm_only"], "comm_only"))
    bound = _f(row["bound_ms"], "bound_ms")
    skipped = doc.get("skipped")
    n_skipped = len(cast("list[object]", skipped)) if isinstance(skipped, list) else 0
    png = timeline_of(results_path, row)
    res = _link(results_path, readme)
    others = {r["warmup"] for r in rows[1:]}
    warmups = f"{row['warmup']} warm-ups" + (
        f" ({', '.join(map(str, sorted(others, key=str)))} after the first configuration)"
        if others and others != {row["warmup"]}
        else ""
    )
    lines = [
        _wrap(
            f"One overlapped step on an {device} ({c['num_layers']} MoE layers, hidden "
            f"{c['hidden']}, expert FFN {c['ffn']}, {c['num_experts']} experts / "
            f"{c['local_experts']} local, top-{c['top_k']}, {c['tokens']} tokens per microbatch, "
            f"{n} microbatches, {dtype}; the all-to-all emulated by {comm}), per stream, forward "
            "blue, backward orange:"
        ),
        "",
        f"![timeline of one overlapped step on an {device}]({_link(png, readme)})",
        "",
        "| (same configuration) | ms (median) | spread |",
        "|---|---|---|",
        "| serial step (comm on the compute stream, no interleave) "
        f"| {_f(m['serial'], 'serial'):.1f} | {_pct(sp['serial'])} |",
        f"| overlapped step (`combined_1f1b`) | {_f(m['overlapped'], 'overlapped'):.1f} "
        f"| {_pct(sp['overlapped'])} |",
        "| overlapped step with the fill and the drain overlapped too (`fill_drain=True`) "
        f"| {_f(fd['overlapped_ms'], 'fill_drain'):.1f} | {_pct(fd['spread'])} |",
        f"| compute only / comm only | {_f(m['compute_only'], 'compute_only'):.1f} / "
        f"{_f(m['comm_only'], 'comm_only'):.1f} "
        f"| {_pct(sp['compute_only'])} / {_pct(sp['comm_only'])} |",
        f"| critical-path bound from measured node durations | {bound:.1f} | |",
        "",
        _wrap(
            f"Overlap efficiency (bound / overlapped) is {_range(effs)} across the "
            f"{len(sweep)} configurations of the sweep at {n} microbatches "
            f"({_f(row['efficiency'], 'efficiency'):.2f} here); this step is "
            f"{_f(row['speedup'], 'speedup'):.2f}x faster than serial and "
            f"{_f(row['overlapped_over_max'], 'overlapped_over_max'):.2f} x max(compute, comm) "
            f"({_range(ovmax)} across the sweep; target 1.1), where the critical-path bound "
            f"alone is {bound / cap:.2f} x. Measured {env['date']}, torch {env['torch']}: "
            f"{warmups} and {row['iters']} timed steps of every variant, the variants "
            "interleaved; median, "
            f"spread = (max \u2212 min) / min; {n_skipped} configuration"
            f"{'' if n_skipped == 1 else 's'} skipped by the time budget. "
            f"Generated from [`{res}`]({res}) by "
            "`python benchmarks/readme_table.py`."
        ),
    ]
    return "\n".join(lines)


def replace_block(text: str, block: str) -> str:
    """``text`` with the part between the markers replaced by ``block``."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ResultsError(f"the README needs one {BEGIN} line and one {END} line after it")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{block}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results" / "results.json")
    p.add_argument("--readme", type=Path, default=ROOT / "README.md")
    p.add_argument("--check", action="store_true", help="exit 1 when the README is stale")
    args = p.parse_args(argv)
    try:
        doc = _d(json.loads(args.results.read_text()), str(args.results))
        old = args.readme.read_text()
        new = replace_block(old, render(doc, args.results, args.readme))
    except ResultsError as exc:
        print(f"readme_table: {exc}", file=sys.stderr)
        return 2
    if new == old:
        print(f"{args.readme}: up to date with {args.results}")
        return 0
    if args.check:
        diff = difflib.unified_diff(
            old.splitlines(), new.splitlines(), "README (now)", "README (from results)", lineterm=""
        )
        print(f"{args.readme} is stale against {args.results}:", file=sys.stderr)
        print("\n".join(diff), file=sys.stderr)
        print("regenerate: python benchmarks/readme_table.py", file=sys.stderr)
        return 1
    args.readme.write_text(new)
    print(f"{args.readme}: updated from {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
