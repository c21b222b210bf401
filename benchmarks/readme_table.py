"""The pages' measured figures, generated from the committed results so no two pages disagree.

Usage: ``python benchmarks/readme_table.py`` rewrites every generated block of ``README.md``,
``docs/*.md`` and ``benchmarks/README.md``: the part of a page between
``<!-- bench[:NAME]:begin -->`` and ``<!-- bench[:NAME]:end -->``. ``--check`` changes
nothing and exits 1 when a page is stale. The blocks:

- ``bench`` (the headline: the main configuration's serial, overlapped and fill/drain steps,
  compute and comm alone, the bound, the overlap efficiency) and ``bench:fill-drain`` (one
  sentence: fill/drain's time and memory), from :data:`HEADLINE`, the current
  ``bench_overlap.py`` results (its first row is the main configuration; the efficiency
  range is over its rows at the same microbatch count). A ``timeline.png`` with its
  ``timeline_trace.json`` beside that file is shown too, checked to come from the same run
  (its title's median must be the main row's).
- ``bench:choose``: each schedule and option against the default, time and peak memory,
  from :data:`HEADLINE`, :data:`A2A_CHUNKS`, :data:`PP_DUALPIPEV`, :data:`PP_INTERLEAVED`
  and :data:`TORCHTITAN`.
- ``bench:ep``: expert parallelism over NCCL from :data:`EP_RANKS`.

Each block names its files and the commands that wrote them. ``--results FILE --readme
PAGE`` renders only PAGE's ``bench`` block, from FILE.

Refused (exit 2): headline results from the CPU, timed with fewer warm-ups or timed steps
than the method asks (``MIN_WARMUP`` / ``MIN_ITERS``, as in ``bench_overlap.py``), without
spreads (timed before the method), and a timeline that is not from the same run. Standard
library only: no torch needed.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import cast

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
#: The current results: every headline figure of the pages comes from this one file.
HEADLINE = RESULTS / "round11" / "bench_overlap_results.json"
#: Chunked all-to-all (``bench_a2a_chunks.py``), the same round as the headline.
A2A_CHUNKS = RESULTS / "round11" / "a2a_chunks.json"
#: One-GPU DualPipeV through ``pp_nccl.py``: 2 warm-ups, 5 timed steps, bit-identical.
PP_DUALPIPEV = RESULTS / "round10" / "pp_dualpipev" / "pp_results.json"
PP_DUALPIPEV_COMMAND = (
    "torchrun --nproc-per-node 1 benchmarks/pp_nccl.py --loopback --microbatches 8 "
    "--layers-per-stage 2 --hidden 4096 --seq 4096 --warmup 2 --iters 5"
)
#: One-GPU paired interleaved 1F1B (one timed step; the log's first line is the JSON).
PP_INTERLEAVED = RESULTS / "round11" / "bench_pp_il1.log"
PP_INTERLEAVED_COMMAND = (
    "torchrun --nproc-per-node 1 benchmarks/pp_nccl.py --schedule interleaved --loopback "
    "--microbatches 8 --layers-per-stage 2 --hidden 4096 --seq 4096 --warmup 0 --iters 1"
)
#: torchtitan's DeepSeek-V3 slice through the adapter against torchtitan's own step.
TORCHTITAN = RESULTS / "torchtitan" / "bench_torchtitan.json"
#: Expert parallelism over NCCL, EP=2 on two H200s, one file per rank.
EP_RANKS = (RESULTS / "ep2_rank0.json", RESULTS / "ep2_rank1.json")
EP_COMMAND = "python3 benchmarks/ep_nccl.py --nproc 2 --tokens 4096 --repeats 5"
#: The pages searched for blocks.
PAGES = (
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "benchmarks" / "README.md",
)

BEGIN = "<!-- bench:begin -->"
END = "<!-- bench:end -->"
#: A block's first or last line (a marker is a line of its own; one quoted in prose is not).
_MARKER = re.compile(r"^<!-- bench(?::(?P<name>[a-z0-9-]+))?:(?P<edge>begin|end) -->$", re.M)
#: As in ``bench_overlap.py`` (not imported: that module needs torch).
MIN_WARMUP, MIN_ITERS = 2, 5

Json = dict[str, object]


class ResultsError(Exception):
    """The results cannot back the pages' figures."""


def _d(x: object, what: str) -> Json:
    if not isinstance(x, dict):
        raise ResultsError(f"{what}: expected an object, got {type(x).__name__}")
    return {str(k): v for k, v in cast("dict[object, object]", x).items()}


def _f(x: object, what: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise ResultsError(f"{what}: expected a number, got {x!r}")
    return float(x)


def _load(path: Path) -> Json:
    """A results file: JSON, or a log whose first line starting with ``{`` is the JSON."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ResultsError(f"cannot read {path}: {exc}") from exc
    if path.suffix != ".json":
        text = next((line for line in text.splitlines() if line.startswith("{")), "")
    try:
        return _d(json.loads(text), str(path))
    except json.JSONDecodeError as exc:
        raise ResultsError(f"{path}: not JSON ({exc})") from exc


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
                "(interleaved variants, medians with spreads)"
            )
        warmup, iters = _f(r.get("warmup"), "warmup"), _f(r.get("iters"), "iters")
        if warmup < MIN_WARMUP or iters < MIN_ITERS:
            raise ResultsError(
                f"row {i}: {warmup:g} warm-ups and {iters:g} timed steps; the method asks "
                f"for at least {MIN_WARMUP} and {MIN_ITERS}"
            )


def timeline_of(results_path: Path, row: Json) -> Path | None:
    """The timeline PNG beside ``results_path`` (checked to come from the same run), if any."""
    png = results_path.parent / "timeline.png"
    trace = results_path.parent / "timeline_trace.json"
    if not png.is_file() and not trace.is_file():
        return None
    if not png.is_file() or not trace.is_file():
        raise ResultsError(
            f"timeline.png and timeline_trace.json go together beside {results_path}"
        )
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


def _in_docs(page: Path) -> bool:
    return (ROOT / "docs") in page.resolve().parents


def _link(target: Path, page: Path) -> str:
    """``target`` as a page links it: a relative link, or (Sphinx pages) its repository path."""
    if _in_docs(page):
        try:
            return f"`{target.resolve().relative_to(ROOT).as_posix()}`"
        except ValueError:
            return f"`{target}`"
    rel = Path(os.path.relpath(target.resolve(), page.resolve().parent)).as_posix()
    return f"[`{rel}`]({rel})"


def _command(argv: object) -> str:
    """The command line a results file records, without its output directory."""
    if not isinstance(argv, list):
        return "?"
    words = [str(w) for w in cast("list[object]", argv)]
    kept: list[str] = []
    skip = False
    for w in words:
        if skip:
            skip = False
        elif w == "--out":
            skip = True
        else:
            kept.append(w)
    return "python3 " + " ".join(kept)


def _device(env: Json) -> str:
    return str(env.get("device", "?")).removeprefix("NVIDIA ")


def _dtype(c: Json) -> object:
    return {"torch.bfloat16": "bf16", "torch.float32": "fp32"}.get(str(c["dtype"]), c["dtype"])


def _config(c: Json, n: object) -> str:
    return (
        f"{c['num_layers']} MoE layers, hidden {c['hidden']}, expert FFN {c['ffn']}, "
        f"{c['num_experts']} experts / {c['local_experts']} local, top-{c['top_k']}, "
        f"{c['tokens']} tokens per microbatch, {n} microbatches, {_dtype(c)}"
    )


def _exactness(row: Json) -> str:
    """``every variant bit-identical ...`` from a row's exactness pass, or ``""`` without one."""
    if "exactness" not in row:
        return ""
    variants = _d(_d(row["exactness"], "exactness").get("variants"), "exactness.variants")
    same = sum(1 for v in variants.values() if _d(v, "variant").get("bit_identical") is True)
    return (
        f" Before the timing, {same} of {len(variants)} variants were bit-identical to the "
        "serial step (losses and every gradient, deterministic kernels)."
    )


# --- the blocks ---------------------------------------------------------------------------


def render(doc: Json, results_path: Path, readme: Path) -> str:
    """The headline block (``bench``) for ``doc``, as the page ``readme`` shows it."""
    validate(doc)
    env = _d(doc["env"], "env")
    rows = _rows(doc)
    row = rows[0]
    c = _d(row["config"], "config")
    m = _d(row["step_ms"], "step_ms")
    sp = _d(row["step_ms_spread"], "step_ms_spread")
    fd = _d(row["fill_drain"], "fill_drain")
    n = row["microbatches"]
    device = _device(env)
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
    others = {r["warmup"] for r in rows[1:]}
    warmups = f"{row['warmup']} warm-ups" + (
        f" ({', '.join(map(str, sorted(others, key=str)))} after the first configuration)"
        if others and others != {row["warmup"]}
        else ""
    )
    eff_here = _f(row["efficiency"], "efficiency")
    if len(sweep) > 1:
        efficiency = (
            f"Overlap efficiency (bound / overlapped) is {_range(effs)} across the "
            f"{len(sweep)} configurations of the sweep at {n} microbatches "
            f"({eff_here:.2f} here)"
        )
        over_max = f" ({_range(ovmax)} across the sweep)"
    else:
        efficiency = f"Overlap efficiency (bound / overlapped) is {eff_here:.2f}"
        over_max = ""
    lines = [
        _wrap(
            f"One step on an {device} ({_config(c, n)}; the all-to-all emulated by {comm})"
            + (", per stream, forward blue, backward orange:" if png else ":")
        ),
        "",
    ]
    if png is not None:
        lines += [f"![timeline of one overlapped step on an {device}]({_rel(png, readme)})", ""]
    lines += [
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
            f"{efficiency}; the overlapped step is "
            f"{_f(row['speedup'], 'speedup'):.2f}x faster than serial and takes "
            f"{_f(row['overlapped_over_max'], 'overlapped_over_max'):.2f} x max(compute, comm)"
            f"{over_max}, where the critical-path bound alone is {bound / cap:.2f} x."
            f"{_exactness(row)} Measured {env['date']}, torch {env['torch']}: "
            f"{warmups} and {row['iters']} timed steps of every variant, the variants "
            "interleaved; median, "
            f"spread = (max \u2212 min) / min; {n_skipped} configuration"
            f"{'' if n_skipped == 1 else 's'} skipped by the time budget. "
            + (f"Command: `{_command(env['argv'])}`; generated" if "argv" in env else "Generated")
            + f" from {_link(results_path, readme)} by "
            "`python benchmarks/readme_table.py`."
        ),
    ]
    return "\n".join(lines)


def _rel(target: Path, page: Path) -> str:
    return Path(os.path.relpath(target.resolve(), page.resolve().parent)).as_posix()


def render_fill_drain(page: Path) -> str:
    """One sentence: fill/drain's time and peak memory against the default schedule."""
    doc = _load(HEADLINE)
    validate(doc)
    row = _rows(doc)[0]
    m = _d(row["step_ms"], "step_ms")
    mem = _d(row["memory"], "memory")

    def peak(key: str) -> float:
        return _f(_d(mem[key], key)["peak_GB"], key)

    serial = peak("serial_free_input_True")
    fd = _f(_d(row["fill_drain"], "fill_drain")["overlapped_ms"], "fill_drain")
    ov = _f(m["overlapped"], "overlapped")
    rc = _f(_d(row["fill_drain_recompute"], "fill_drain_recompute")["overlapped_ms"], "rc")
    env = _d(doc["env"], "env")
    return _wrap(
        f"On the benchmark's main configuration ({_device(env)}) fill/drain took the step from "
        f"{ov:.1f} to {fd:.1f} ms ({ov / fd:.2f}x) at {peak('fill_drain_free_input_True') / serial:.2f}x "
        f"the serial step's peak memory, against {peak('free_input_True') / serial:.2f}x for "
        f"the default schedule; with recomputation, {rc:.1f} ms at "
        f"{peak('fill_drain_recompute_free_input_True') / serial:.2f}x (generated from "
        f"{_link(HEADLINE, page)} by `python benchmarks/readme_table.py`)."
    )


def _speedup(base: float, ms: float) -> str:
    return f"{base / ms:.2f}x"


def render_choose(page: Path) -> str:
    """Each schedule and option: time against the default, spread, peak memory."""
    doc = _load(HEADLINE)
    validate(doc)
    env = _d(doc["env"], "env")
    row = _rows(doc)[0]
    c = _d(row["config"], "config")
    m = _d(row["step_ms"], "step_ms")
    sp = _d(row["step_ms_spread"], "step_ms_spread")
    mem = _d(row["memory"], "memory")
    variants = _d(row["variants"], "variants")
    graphs = _d(row["graphs"], "graphs")
    base = _f(m["overlapped"], "overlapped")

    def peak(key: str) -> float | None:
        v = mem.get(key)
        return None if v is None else _f(_d(v, key)["peak_GB"], key)

    serial_peak = peak("serial_free_input_True") or 1.0

    def mem_cell(key: str) -> str:
        p = peak(key)
        return "not measured" if p is None else f"{p:.2f} ({p / serial_peak:.2f}x)"

    def timed(d: Json, what: str) -> tuple[float, float]:
        return _f(d["overlapped_ms"], what), _f(d["spread"], what)

    fd, fd_sp = timed(_d(row["fill_drain"], "fill_drain"), "fill_drain")
    rc, rc_sp = timed(_d(row["fill_drain_recompute"], "fill_drain_recompute"), "rc")
    dw, dw_sp = timed(_d(variants["delay_wgrad_compute"], "delay_wgrad"), "delay_wgrad")
    hp, hp_sp = timed(_d(variants["high_priority_comm"], "high_priority"), "high_priority")
    g_ov, g_ov_sp = timed(_d(graphs["overlapped"], "graphs"), "graphs")
    g_fd, g_fd_sp = timed(_d(graphs["fill_drain"], "graphs"), "graphs")
    search = _d(row["order_search"], "order_search")
    tried = _d(search["tried"], "tried")
    same_order = search["run_ms_found"] == search["run_ms_megatron"]
    serial = _f(m["serial"], "serial")

    def line(what: str, how: str, ms: str, vs: str, spread: str, memory: str) -> str:
        return f"| {what} | {how} | {ms} | {vs} | {spread} | {memory} |"

    table = [
        "| schedule or option | how | step ms | vs default | spread | peak GB (x serial) |",
        "|---|---|---|---|---|---|",
        line(
            "serial (no overlap)",
            "`combined_1f1b(..., overlap=False)`",
            f"{serial:.1f}",
            _speedup(base, serial),
            _pct(sp["serial"]),
            mem_cell("serial_free_input_True"),
        ),
        line(
            "**combined 1F1B (the default)**",
            "`combined_1f1b(model, microbatches)`",
            f"{base:.1f}",
            "1.00x",
            _pct(sp["overlapped"]),
            mem_cell("free_input_True"),
        ),
        line(
            "fill and drain overlapped too",
            "`fill_drain=True`",
            f"{fd:.1f}",
            _speedup(base, fd),
            _pct(fd_sp),
            mem_cell("fill_drain_free_input_True"),
        ),
        line(
            "fill/drain with recomputation (attention selectively, routed experts whole)",
            "`fill_drain=True` and `GPTMoEConfig.recompute` / `blocks.recompute`",
            f"{rc:.1f}",
            _speedup(base, rc),
            _pct(rc_sp),
            mem_cell("fill_drain_recompute_free_input_True"),
        ),
        line(
            "delayed expert weight gradients",
            "the layers' `mlp_wgrad()` lists them (`GPTMoEConfig.delay_wgrad_compute`)",
            f"{dw:.1f}",
            _speedup(base, dw),
            _pct(dw_sp),
            "not measured",
        ),
        line(
            "high-priority comm stream",
            "`streams=make_streams(device, high_priority_comm=True)`",
            f"{hp:.1f}",
            _speedup(base, hp),
            _pct(hp_sp),
            "not measured",
        ),
        line(
            "attention as CUDA graphs (default / fill/drain)",
            "`GraphedBlock`, `GPTMoEConfig.cuda_graph_modules`",
            f"{g_ov:.1f} / {g_fd:.1f}",
            f"{_speedup(base, g_ov)} / {_speedup(base, g_fd)}",
            f"{_pct(g_ov_sp)} / {_pct(g_fd_sp)}",
            f"{mem_cell('graphs_free_input_True')} / {mem_cell('fill_drain_graphs_free_input_True')}",
        ),
        line(
            "free-input policy off",
            "`ScheduleOptions(free_input=False)`",
            "not timed",
            "",
            "",
            mem_cell("free_input_False"),
        ),
        line(
            "step order searched from a serial profile",
            "`ScheduleOptions(order=search_order(...).order)`",
            "Megatron-Core's order" if same_order else "see the file",
            "1.00x" if same_order else "",
            "",
            "same as the default",
        ),
    ]
    head = _wrap(
        f"Measured on an {_device(env)} ({_config(c, row['microbatches'])}; the all-to-all "
        f"emulated through pinned host memory), {env['date']}, torch {env['torch']}. "
        "*vs default*: the default step's time over this one (above 1: faster); differences "
        "within the spreads are noise. Peak memory with free-input on unless said. "
        f"The order search replayed {sum(int(_f(v, 'tried')) for v in tried.values())} orders "
        + (
            "and found Megatron-Core's the shortest, so it ran unchanged."
            if same_order
            else "and found a shorter one."
        )
        + f" Command: `{_command(env.get('argv'))}`; file: {_link(HEADLINE, page)}."
    )
    parts = [head, "", *table, "", *_choose_chunks(page), "", *_choose_pp(page)]
    parts += ["", *_choose_torchtitan(page)]
    parts += [
        "",
        _wrap(
            "Not timed: early attention-memory release "
            "(`ScheduleOptions(ep_overlap_early_attn_memory_release=True)`), exact under "
            "stream delays like every composition (`benchmarks/stress_exact.py`). Generated "
            "by `python benchmarks/readme_table.py`."
        ),
    ]
    return "\n".join(parts)


def _choose_chunks(page: Path) -> list[str]:
    doc = _load(A2A_CHUNKS)
    env = _d(doc["env"], "env")
    c = _d(doc["config"], "config")
    ms = _d(doc["step_ms"], "step_ms")
    spread = _d(doc["spread"], "spread")
    failed = _d(doc.get("exactness", {}), "exactness").get("failed")
    ks = sorted({int(k[1:].split("_")[0]) for k in ms})
    base = _f(ms["K1_overlapped"], "K1_overlapped")
    rows = [
        f"| {k} | {_f(ms[f'K{k}_serial'], 'serial'):.1f} | "
        f"{_f(ms[f'K{k}_overlapped'], 'overlapped'):.1f} "
        f"({_speedup(base, _f(ms[f'K{k}_overlapped'], 'overlapped'))}) | "
        f"{_f(ms[f'K{k}_fill_drain'], 'fill_drain'):.1f} | "
        f"{max(_pct(spread[f'K{k}_{v}']) for v in ('serial', 'overlapped', 'fill_drain'))} |"
        for k in ks
    ]
    return [
        _wrap(
            "Chunked all-to-all under the experts (`GPTMoEConfig.moe_a2a_chunks` / "
            f"`TokenDispatcher(chunks=K)`): the reference model, hidden {c['hidden_size']}, "
            f"{c['num_experts']} experts top-{c['moe_router_topk']}, {doc['tokens_per_microbatch']} "
            f"tokens x {doc['microbatches']} microbatches, {_device(env)}; "
            + ("each K bit-identical to its own serial step; " if failed == [] else "")
            + f"command `{_command(env.get('argv'))}`, file {_link(A2A_CHUNKS, page)}:"
        ),
        "",
        "| K | serial ms | overlapped ms (vs K=1) | fill/drain ms | largest spread |",
        "|---|---|---|---|---|",
        *rows,
    ]


def _choose_pp(page: Path) -> list[str]:
    rows: list[str] = []
    for name, path, command in (
        ("DualPipeV", PP_DUALPIPEV, PP_DUALPIPEV_COMMAND),
        (
            "interleaved 1F1B, neighbours paired (`pair=True`)",
            PP_INTERLEAVED,
            PP_INTERLEAVED_COMMAND,
        ),
    ):
        doc = _load(path)
        r = _d(cast("list[object]", doc["ranks"])[0], "ranks[0]")
        torch_ms = _f(r["torch_step_ms"], "torch_step_ms")
        ours = _f(r["overlapped_step_ms"], "overlapped_step_ms")
        samples = r.get("overlapped_step_ms_samples")
        n = len(cast("list[object]", samples)) if isinstance(samples, list) else 1
        exact = "yes" if doc.get("bit_identical") is True else "no"
        rows.append(
            f"| {name} | {torch_ms:.1f} | {ours:.1f} | {torch_ms / ours:.2f}x | {n} | {exact} "
            f"| {_link(path, page)}: `{command}` |"
        )
    return [
        _wrap(
            "Pipeline schedules (`prepare_schedule`), both stages on one GPU, 4 MoE layers, "
            "hidden 4096, 8 microbatches of 4096 tokens, host-loopback all-to-all; memory "
            "not measured:"
        ),
        "",
        "| torch schedule | torch's execution ms | prepared ms | speed-up | timed steps "
        "| bit-identical | file and command |",
        "|---|---|---|---|---|---|---|",
        *rows,
    ]


def _choose_torchtitan(page: Path) -> list[str]:
    doc = _load(TORCHTITAN)
    timing = _d(cast("list[object]", doc["timing"])[0], "timing[0]")
    rows = _d(timing["rows"], "rows")
    peaks = _d(timing["peak_memory"], "peak_memory")
    own = _f(_d(rows["torchtitan"], "torchtitan")["median_ms"], "torchtitan")
    cells: list[str] = []
    for key, name in (
        ("torchtitan", "torchtitan's own step"),
        ("serial", "adapter, serial"),
        ("overlapped", "adapter, combined 1F1B"),
        ("fill_drain", "adapter, fill/drain"),
    ):
        r = _d(rows[key], key)
        ms = _f(r["median_ms"], key)
        p = peaks.get(key)
        gb = f"{_f(_d(p, key)['peak_gb'], key):.2f}" if p is not None else "not measured"
        cells.append(f"| {name} | {ms:.1f} | {own / ms:.2f}x | {_pct(r['spread'])} | {gb} |")
    args = _d(doc.get("args", {}), "args")
    budget = args.get("budget_s")
    moe = _d(timing["moe"], "moe")
    return [
        _wrap(
            f"torchtitan's DeepSeek-V3 through `TorchtitanMoEAdapter` ({timing['blocks']} MoE "
            f"blocks, dim {moe['dim']}, {moe['num_experts']} experts top-{moe['top_k']}, "
            f"{timing['tokens_per_microbatch']} tokens x {timing['microbatches']} microbatches, "
            f"{_dtype(doc)}, flex attention, host-loopback all-to-all), {_device(doc)}; "
            "command `python3 benchmarks/bench_torchtitan.py"
            + (f" --budget-s {float(str(budget)):g}" if budget is not None else "")
            + f"`, file {_link(TORCHTITAN, page)}:"
        ),
        "",
        "| step | ms | vs torchtitan's | spread | peak GB |",
        "|---|---|---|---|---|",
        *cells,
    ]


def render_ep(page: Path) -> str:
    """Expert parallelism over NCCL: exactness and the steps of every rank."""
    reports = [_load(p) for p in EP_RANKS]
    rows: list[str] = []
    for r in reports:
        step = _d(r["step"], "step")
        exact = _d(r["exact"], "exact")
        serial, ours = _f(step["serial_ms"], "serial"), _f(step["overlapped_ms"], "overlapped")
        a2a = _d(r["a2a"], "a2a")
        rows.append(
            f"| {r['rank']} | {'yes' if exact.get('grads_equal') and exact.get('losses_equal') else 'no'} "
            f"| {serial:.1f} | {ours:.1f} | {serial / ours:.2f}x "
            f"| {_f(step['efficiency'], 'efficiency'):.2f} "
            f"| {_f(a2a['bytes_sent_per_rank'], 'bytes') / 2**20:.0f} MiB in "
            f"{_f(a2a['ms'], 'ms'):.2f} ms |"
        )
    files = ", ".join(_link(p, page) for p in EP_RANKS)
    return "\n".join(
        [
            _wrap(
                f"EP={reports[0]['world']} over NCCL, one H200 per rank (the reference model: 4 "
                "MoE layers, hidden 4096, 8 local experts per rank, expert FFN 2048, top-8, "
                "4096 tokens per microbatch per rank, bf16); exact = losses and every gradient "
                "bit-identical to plain per-microbatch `backward()` on that rank:"
            ),
            "",
            "| rank | exact | serial ms | overlapped ms | speed-up | efficiency | one dispatch-sized all-to-all |",
            "|---|---|---|---|---|---|---|",
            *rows,
            "",
            _wrap(
                f"Command: `{EP_COMMAND}`; files {files}; generated by `python "
                "benchmarks/readme_table.py`."
            ),
        ]
    )


#: Block name -> renderer (the page the block is in -> its text).
BLOCKS: dict[str, Callable[[Path], str]] = {
    "": lambda page: render(_load(HEADLINE), HEADLINE, page),
    "fill-drain": render_fill_drain,
    "choose": render_choose,
    "ep": render_ep,
}


def blocks_in(text: str) -> list[str]:
    """The block names a page holds (``""`` for the headline), each checked to close once."""
    names: list[str] = []
    open_name: str | None = None
    for marker in _MARKER.finditer(text):
        name = marker["name"] or ""
        if marker["edge"] == "begin":
            if open_name is not None:
                raise ResultsError(f"block {name!r} begins inside block {open_name!r}")
            if name in names:
                raise ResultsError(f"block {name!r} appears twice")
            if name not in BLOCKS:
                raise ResultsError(f"unknown block {name!r}; known: {sorted(BLOCKS)}")
            open_name = name
            names.append(name)
        else:
            if open_name != name:
                raise ResultsError(f"block {name!r} ends without its begin")
            open_name = None
    if open_name is not None:
        raise ResultsError(f"block {open_name!r} has no end")
    return names


def _markers(name: str) -> tuple[str, str]:
    tag = f"bench:{name}" if name else "bench"
    return f"<!-- {tag}:begin -->", f"<!-- {tag}:end -->"


def replace_block(text: str, block: str, name: str = "") -> str:
    """``text`` with the lines between block ``name``'s marker lines replaced by ``block``."""
    begin, end = _markers(name)
    starts = [m.end() for m in re.finditer(f"^{re.escape(begin)}$", text, re.M)]
    ends = [m.start() for m in re.finditer(f"^{re.escape(end)}$", text, re.M)]
    if len(starts) != 1 or len(ends) != 1 or starts[0] > ends[0]:
        raise ResultsError(f"the page needs one {begin} line and one {end} line after it")
    return f"{text[: starts[0]]}\n{block}\n{text[ends[0] :]}"


def regenerate(page: Path, text: str) -> str:
    """``text`` (page ``page``) with every block it holds regenerated."""
    for name in blocks_in(text):
        text = replace_block(text, BLOCKS[name](page), name)
    return text


def _diff(page: Path, old: str, new: str) -> str:
    return "\n".join(
        difflib.unified_diff(
            old.splitlines(),
            new.splitlines(),
            f"{page} (now)",
            f"{page} (from results)",
            lineterm="",
        )
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--results", type=Path, default=None, help="render the bench block from this")
    p.add_argument("--readme", type=Path, default=None, help="only this page")
    p.add_argument("--check", action="store_true", help="exit 1 when a page is stale")
    args = p.parse_args(argv)
    pages = [args.readme] if args.readme is not None else list(PAGES)
    stale = 0
    for page in pages:
        try:
            old = page.read_text()
            if args.results is not None:
                doc = _d(json.loads(args.results.read_text()), str(args.results))
                new = replace_block(old, render(doc, args.results, page))
            else:
                new = regenerate(page, old)
        except ResultsError as exc:
            print(f"readme_table: {page}: {exc}", file=sys.stderr)
            return 2
        if new == old:
            continue
        if args.check:
            print(f"{page} is stale against the results:", file=sys.stderr)
            print(_diff(page, old, new), file=sys.stderr)
            stale += 1
        else:
            page.write_text(new)
            print(f"{page}: updated")
    if stale:
        print("regenerate: python benchmarks/readme_table.py", file=sys.stderr)
        return 1
    print("every page is up to date with the results" if not args.check else "up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
