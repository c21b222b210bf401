"""EP all-to-all overlap on one GPU: serial vs overlapped step, bounds, memory, host time.

Usage (device): ``PYTHONPATH=src python3 benchmarks/bench_overlap.py --out DIR``;
on a laptop: ``PYTHONPATH=src python benchmarks/bench_overlap.py --device cpu --tiny``.

For each configuration of the sweep, in one process:

- ``serial``: ``combined_1f1b(overlap=False)`` with the comm stream = the compute stream;
- ``overlapped``: ``combined_1f1b(overlap=True)`` with real compute + comm streams;
- ``compute_only``: the serial step with the loopback replaced by one device-side copy;
- ``comm_only``: the loopback copies alone, the same calls and bytes, on one stream;
- ``bound``: the critical path of the overlapped schedule from per-node durations measured
  in a serial step (``bound``, no contention) and in an overlapped step
  (``bound_contended``); ``efficiency = bound / overlapped``.

- ``fill_drain``: the overlapped step with the fill and the drain overlapped too
  (``combined_1f1b(fill_drain=True)``);
- ``graphs``: the overlapped and the fill/drain steps with each layer's attention run as
  CUDA graphs (:class:`~moe_overlap.blocks.GraphedBlock`), with their own bound; every copy
  is captured before the timed steps (checked).

Then, for the first configuration: peak memory of every variant with and without
free-input, the timeline (PNG + Chrome trace) of one overlapped step, and host time per
layer pair, eager and graphed; and host time and step time at a host-bound size (H=256).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch

from moe_overlap import (
    Microbatch,
    ModelChunkSchedulePlan,
    ScheduleOptions,
    StreamPair,
    combined_1f1b,
    make_streams,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_slice import LoopbackMode, MoESliceModel, SliceConfig, make_microbatches
from node_timing import (
    Clock,
    NodeRecorder,
    critical_path_ms,
    fill_drain_runs,
    overlapped_runs,
    pyplot,
    write_chrome_trace,
    write_gantt_png,
)

JsonDict = dict[str, object]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Bench:
    """What one measurement needs: the model, its inputs and the two stream setups."""

    model: MoESliceModel
    mbs: list[Microbatch]
    device: torch.device
    pair: StreamPair
    serial: StreamPair
    warmup: int
    iters: int


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(b: Bench, fn: Callable[[], object]) -> list[float]:
    """Per-call milliseconds of ``fn`` after warm-up, on the current (compute) stream.

    ``fn`` must leave the current stream waiting for all its work (the driver does).
    """
    clock = Clock(b.device)
    for _ in range(b.warmup):
        b.model.zero_grad(set_to_none=False)
        fn()
    _sync(b.device)
    out: list[float] = []
    for _ in range(b.iters):
        b.model.zero_grad(set_to_none=False)
        _sync(b.device)
        start = clock.mark()
        fn()
        end = clock.mark()
        _sync(b.device)
        out.append(Clock.ms(start, end))
    return out


def step(
    b: Bench, *, overlap: bool, options: ScheduleOptions | None = None, fill_drain: bool = False
) -> None:
    combined_1f1b(
        b.model,
        b.mbs,
        overlap=overlap,
        streams=b.pair if overlap else b.serial,
        options=options if options is not None else ScheduleOptions(),
        fill_drain=fill_drain,
    )


def _comm_only(b: Bench) -> None:
    """The loopback calls of one step (dispatch+combine, forward+backward), back to back."""
    cfg = b.model.config
    x = torch.randn(cfg.slots, cfg.hidden, device=b.device).to(b.model.embed_scale.dtype)
    lb = b.model.loopback
    comp, comm = b.pair.comp, b.pair.comm
    if isinstance(comp, torch.cuda.Stream) and isinstance(comm, torch.cuda.Stream):
        comm.wait_stream(comp)
        with torch.cuda.stream(comm):
            for _ in range(4 * len(b.mbs) * cfg.num_layers):
                lb(x)
        comp.wait_stream(comm)
    else:
        for _ in range(4 * len(b.mbs) * cfg.num_layers):
            lb(x)


def _recorded(b: Bench, *, overlap: bool, options: ScheduleOptions | None = None) -> NodeRecorder:
    rec = NodeRecorder(b.device)
    b.model.zero_grad(set_to_none=False)
    _sync(b.device)
    rec.start()
    combined_1f1b(
        b.model,
        b.mbs,
        overlap=overlap,
        streams=b.pair if overlap else b.serial,
        options=options if options is not None else ScheduleOptions(),
        on_plan=rec,
    )
    _sync(b.device)
    return rec


def make_bench(cfg: SliceConfig, args: argparse.Namespace, microbatches: int) -> Bench:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    pair = make_streams(device)
    return Bench(
        model=MoESliceModel(cfg, dtype=dtype, device=device),
        mbs=make_microbatches(microbatches, cfg, dtype=dtype, device=device),
        device=device,
        pair=pair,
        serial=StreamPair(comp=pair.comp, comm=pair.comp),
        warmup=args.warmup,
        iters=args.iters,
    )


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def measure(
    cfg: SliceConfig, args: argparse.Namespace, *, microbatches: int, main: bool, out: Path
) -> JsonDict:
    """Every figure for one configuration and microbatch count."""
    b = make_bench(cfg, args, microbatches)
    model, mbs, dtype = b.model, b.mbs, b.model.embed_scale.dtype
    res: JsonDict = {"config": _config_json(cfg, dtype), "microbatches": len(mbs)}
    serial = time_ms(b, lambda: step(b, overlap=False))
    overlapped = time_ms(b, lambda: step(b, overlap=True))
    fill_drain = time_ms(b, lambda: step(b, overlap=True, fill_drain=True))
    graphed = _graphed(b)
    model.set_loopback(LoopbackMode.DEVICE)
    compute = time_ms(b, lambda: step(b, overlap=False))
    model.set_loopback(LoopbackMode.HOST)
    comm = time_ms(b, lambda: _comm_only(b))
    serial_rec = _recorded(b, overlap=False)
    over_rec = _recorded(b, overlap=True)
    runs = overlapped_runs(len(mbs))
    bound = critical_path_ms(runs, serial_rec.shapes, serial_rec.durations())
    bound_cont = critical_path_ms(runs, over_rec.shapes, over_rec.durations())
    fd_bound = critical_path_ms(
        fill_drain_runs(len(mbs)), serial_rec.shapes, serial_rec.durations()
    )
    m = {
        k: median(v)
        for k, v in {
            "serial": serial,
            "overlapped": overlapped,
            "compute_only": compute,
            "comm_only": comm,
        }.items()
    }
    res["step_ms"] = m
    res["step_ms_samples"] = {
        "serial": serial,
        "overlapped": overlapped,
        "compute_only": compute,
        "comm_only": comm,
    }
    a2a_calls = 4 * len(mbs) * cfg.num_layers
    moved = 2 * cfg.a2a_bytes(dtype) * a2a_calls
    res["comm_GBps"] = moved / (m["comm_only"] * 1e-3) / 1e9
    res["comm_to_compute"] = m["comm_only"] / m["compute_only"]
    res["bound_ms"] = bound
    res["bound_contended_ms"] = bound_cont
    res["efficiency"] = bound / m["overlapped"]
    res["efficiency_contended"] = bound_cont / m["overlapped"]
    res["speedup"] = m["serial"] / m["overlapped"]
    res["overlapped_over_max"] = m["overlapped"] / max(m["compute_only"], m["comm_only"])
    res["sum_node_ms_serial"] = sum(serial_rec.durations().values())
    fd = median(fill_drain)
    cap = max(m["compute_only"], m["comm_only"])
    res["fill_drain"] = {
        "overlapped_ms": fd,
        "samples": fill_drain,
        "bound_ms": fd_bound,
        "efficiency": fd_bound / fd,
        "speedup": m["serial"] / fd,
        "overlapped_over_max": fd / cap,
    }
    res["graphs"] = {
        name: {
            "overlapped_ms": median(samples),
            "samples": samples,
            "bound_ms": bound_g,
            "efficiency": bound_g / median(samples),
            "speedup": m["serial"] / median(samples),
            "overlapped_over_max": median(samples) / cap,
        }
        for name, (samples, bound_g) in graphed.items()
    }
    if main:
        title = (
            f"overlapped step, H={cfg.hidden} F={cfg.ffn} T={cfg.tokens} L={cfg.num_layers} "
            f"N={len(mbs)} ({m['overlapped']:.1f} ms median)"
        )
        spans = over_rec.spans()
        write_gantt_png(spans, out / "timeline.png", title=title)
        write_chrome_trace(spans, out / "timeline_trace.json", title=title)
        res["host"] = host_time(b)
        res["host_graphs"] = host_time(b, graphs=True)
        res["variants"] = _variants(b, m, bound)
        res["memory"] = _memory(b)
    return res


def _graphed(b: Bench) -> dict[str, tuple[list[float], float]]:
    """Step times with the attention CUDA-graphed (overlapped, and with the fill/drain
    overlap), each with its critical-path bound from a graphed serial step."""
    b.model.set_graphs(True)
    try:
        # Capture every copy first (capturing synchronizes and empties the allocator's
        # cache), then warm the allocator again before anything is timed.
        for _ in range(3):
            step(b, overlap=True, fill_drain=True)
        captured = b.model.graph_captures()
        fd = time_ms(b, lambda: step(b, overlap=True, fill_drain=True))
        ov = time_ms(b, lambda: step(b, overlap=True))
        rec = _recorded(b, overlap=False)
        if b.model.graph_captures() != captured:
            raise RuntimeError("bench_overlap: graphs were captured during the timed steps")
    finally:
        b.model.set_graphs(False)
    n = len(b.mbs)
    return {
        "fill_drain": (fd, critical_path_ms(fill_drain_runs(n), rec.shapes, rec.durations())),
        "overlapped": (ov, critical_path_ms(overlapped_runs(n), rec.shapes, rec.durations())),
    }


def _variants(b: Bench, base: dict[str, float], bound: float) -> JsonDict:
    """The overlapped step with a high-priority comm stream, and with delayed expert wgrad.

    Compute-only and comm-only are the base configuration's (the same work); the delayed
    wgrad bound comes from a serial step with delayed wgrad (its own step lists, with
    ``WGRAD`` steps).
    """
    out: JsonDict = {}
    hp = make_streams(b.device, high_priority_comm=True)
    hp_ms = time_ms(b, lambda: combined_1f1b(b.model, b.mbs, overlap=True, streams=hp))
    cap = max(base["compute_only"], base["comm_only"])
    hp_med = median(hp_ms)
    out["high_priority_comm"] = {
        "overlapped_ms": hp_med,
        "samples": hp_ms,
        "bound_ms": bound,
        "efficiency": bound / hp_med,
        "speedup": base["serial"] / hp_med,
        "overlapped_over_max": hp_med / cap,
    }
    delay = ScheduleOptions(delay_wgrad_compute=True)
    b.model.set_delay_wgrad(True)
    try:
        dw_ms = time_ms(b, lambda: step(b, overlap=True, options=delay))
        ser_rec = _recorded(b, overlap=False, options=delay)
        over_rec = _recorded(b, overlap=True, options=delay)
    finally:
        b.model.set_delay_wgrad(False)
    runs = overlapped_runs(len(b.mbs))
    dw_bound = critical_path_ms(runs, ser_rec.shapes, ser_rec.durations())
    dw_bound_c = critical_path_ms(runs, over_rec.shapes, over_rec.durations())
    dw_med = median(dw_ms)
    out["delay_wgrad_compute"] = {
        "overlapped_ms": dw_med,
        "samples": dw_ms,
        "bound_ms": dw_bound,
        "bound_contended_ms": dw_bound_c,
        "efficiency": dw_bound / dw_med,
        "efficiency_contended": dw_bound_c / dw_med,
        "speedup": base["serial"] / dw_med,
        "overlapped_over_max": dw_med / cap,
    }
    return out


def _config_json(cfg: SliceConfig, dtype: torch.dtype) -> JsonDict:
    d: JsonDict = {
        k: (v.value if isinstance(v, LoopbackMode) else v)
        for k, v in dataclasses.asdict(cfg).items()
        if k not in ("cuda_graph_modules",)
    }
    d["capacity"] = cfg.capacity
    d["remote_fraction"] = cfg.remote_fraction
    d["a2a_MB_per_call"] = cfg.a2a_bytes(dtype) / 1e6
    d["dtype"] = str(dtype)
    return d


def _memory(b: Bench) -> JsonDict:
    """Peak memory of one step of each variant, free-input on and off.

    The graphed cases run last, after the eager ones, with the graphs captured afresh:
    their pools (the graphs' activations and static buffers) count in their peak only.
    """
    out: JsonDict = {}
    if b.device.type != "cuda":
        return {"note": "CUDA only"}
    cases = [
        (f"{kind}free_input_{free}", overlap, free, fd, graphs)
        for kind, overlap, fd, graphs in (
            ("", True, False, False),
            ("serial_", False, False, False),
            ("fill_drain_", True, True, False),
            ("graphs_", True, False, True),
            ("fill_drain_graphs_", True, True, True),
        )
        for free in (True, False)
    ]
    b.model.drop_graphs()
    torch.cuda.empty_cache()
    for name, overlap, free, fd, graphs in cases:
        opts = ScheduleOptions(free_input=free)
        b.model.set_graphs(graphs)
        step(b, overlap=overlap, options=opts, fill_drain=fd)  # warm the allocator
        b.model.zero_grad(set_to_none=False)
        _sync(b.device)
        torch.cuda.reset_peak_memory_stats(b.device)
        base = torch.cuda.memory_allocated(b.device)
        step(b, overlap=overlap, options=opts, fill_drain=fd)
        _sync(b.device)
        peak = torch.cuda.max_memory_allocated(b.device)
        out[name] = {"peak_GB": peak / 1e9, "above_start_GB": (peak - base) / 1e9}
        b.model.set_graphs(False)
        if graphs:
            b.model.drop_graphs()
            torch.cuda.empty_cache()
    return out


def host_time(b: Bench, *, graphs: bool = False, router: bool = False) -> JsonDict:
    """Host seconds of issuing each chunk run of overlapped steps (no sync inside a run),
    with the attention (and with ``router`` the router) CUDA-graphed when ``graphs``."""
    original = ModelChunkSchedulePlan.__dict__["run"]
    run_fn: Callable[..., torch.Tensor | None] = original.__func__
    records: list[tuple[bool, bool, float]] = []
    spans: list[tuple[torch.cuda.Event | float, torch.cuda.Event | float]] = []
    clock = Clock(b.device)

    def timed(*args: object, **kwargs: object) -> torch.Tensor | None:
        ev0 = clock.mark()
        t0 = time.perf_counter()
        result = run_fn(*args, **kwargs)
        dt = time.perf_counter() - t0
        ev1 = clock.mark()
        records.append((args[0] is not None, args[1] is not None, dt))
        spans.append((ev0, ev1))
        return result

    b.model.set_graphs(graphs, router=router)
    for _ in range(3):  # captures the graphs when asked, then warms the allocator
        step(b, overlap=True)
    setattr(ModelChunkSchedulePlan, "run", staticmethod(timed))  # noqa: B010 - restored below
    try:
        samples: list[dict[str, float]] = []
        for _ in range(max(1, b.iters)):
            records.clear()
            spans.clear()
            b.model.zero_grad(set_to_none=False)
            _sync(b.device)
            step(b, overlap=True)
            _sync(b.device)
            gpu = [Clock.ms(s, e) for s, e in spans]
            samples.append(_host_sample(records, gpu, b.model.config.num_layers))
    finally:
        setattr(ModelChunkSchedulePlan, "run", original)  # noqa: B010
        b.model.set_graphs(False)
    return {k: median([s[k] for s in samples]) for k in samples[0]}


def _host_sample(
    records: list[tuple[bool, bool, float]], gpu_ms: list[float], layers: int
) -> dict[str, float]:
    paired = [(r[2], g) for r, g in zip(records, gpu_ms, strict=True) if r[0] and r[1]]
    first = records[0][2]
    return {
        "first_run_host_ms_per_layer": first * 1e3 / layers,
        "paired_host_ms_per_layer_pair": median([h for h, _ in paired]) * 1e3 / layers,
        "paired_gpu_ms_per_layer_pair": median([g for _, g in paired]) / layers,
    }


def ffn_sweep(args: argparse.Namespace) -> list[SliceConfig]:
    """The main configuration first, then the expert FFN sizes (the comm:compute sweep)."""
    if args.tiny:
        base = SliceConfig(hidden=64, ffn=32, tokens=64, head_dim=16, num_layers=2)
        return [base, dataclasses.replace(base, ffn=128)]
    base = SliceConfig(hidden=args.hidden, ffn=args.ffn, tokens=args.tokens)
    return [base, *(dataclasses.replace(base, ffn=f) for f in args.sweep_ffn if f != base.ffn)]


def shape_sweep(args: argparse.Namespace) -> list[SliceConfig]:
    """Token and hidden sizes around the main configuration."""
    if args.tiny:
        return []
    base = SliceConfig(hidden=args.hidden, ffn=args.ffn, tokens=args.tokens)
    out = [dataclasses.replace(base, tokens=t) for t in args.sweep_tokens if t != base.tokens]
    out += [dataclasses.replace(base, hidden=h) for h in args.sweep_hidden if h != base.hidden]
    return out


def closest_to_balance(results: list[JsonDict]) -> SliceConfig | None:
    """The configuration whose comm:compute ratio is nearest 1 (on a log scale)."""
    best: tuple[float, SliceConfig] | None = None
    for r in results:
        ratio = float(str(r["comm_to_compute"]))
        dist = abs(math.log(ratio)) if ratio > 0 else math.inf
        cfg = r["slice_config"]
        assert isinstance(cfg, SliceConfig)
        if best is None or dist < best[0]:
            best = (dist, cfg)
    return None if best is None else best[1]


def _table(results: list[JsonDict]) -> str:
    head = (
        f"{'H':>5} {'F':>5} {'T':>5} {'N':>2} {'variant':>8} {'serial':>8} {'overlap':>8} "
        f"{'comp':>8} {'comm':>8} {'bound':>8} {'eff':>5} {'effC':>5} {'c:c':>5} {'spdup':>5} "
        f"{'ov/max':>6}"
    )
    lines = [head]
    for r in results:
        c = r["config"]
        m = r["step_ms"]
        assert isinstance(c, dict)
        assert isinstance(m, dict)
        key = f"{c['hidden']:>5} {c['ffn']:>5} {c['tokens']:>5} {r['microbatches']:>2}"
        lines.append(
            f"{key} {'-':>8} {m['serial']:8.1f} "
            f"{m['overlapped']:8.1f} {m['compute_only']:8.1f} {m['comm_only']:8.1f} "
            f"{r['bound_ms']:8.1f} {r['efficiency']:5.2f} {r['efficiency_contended']:5.2f} "
            f"{r['comm_to_compute']:5.2f} {r['speedup']:5.2f} {r['overlapped_over_max']:6.2f}"
        )
        variants = cast("dict[str, dict[str, object]]", r.get("variants", {}))
        fill = cast("dict[str, object] | None", r.get("fill_drain"))
        variants = {**({"fill_drain": fill} if fill is not None else {}), **variants}
        for name, v in variants.items():
            label = {
                "high_priority_comm": "hi-prio",
                "delay_wgrad_compute": "dwgrad",
                "fill_drain": "filldr",
            }[name]
            eff_c = v.get("efficiency_contended")
            eff_c_s = f"{eff_c:5.2f}" if isinstance(eff_c, float) else f"{'-':>5}"
            ov, bnd, eff = v["overlapped_ms"], v["bound_ms"], v["efficiency"]
            spd, ovm = v["speedup"], v["overlapped_over_max"]
            for x in (ov, bnd, eff, spd, ovm):
                assert isinstance(x, float)
            lines.append(
                f"{key} {label:>8} {'':>8} {ov:8.1f} {'':>8} {'':>8} "
                f"{bnd:8.1f} {eff:5.2f} {eff_c_s} {'':>5} {spd:5.2f} {ovm:6.2f}"
            )
    return "\n".join(lines)


def write_sweep_png(results: list[JsonDict], path: Path) -> None:
    """Speed-up and efficiency against the comm:compute ratio."""
    plt = pyplot()
    pts = sorted(
        (float(str(r["comm_to_compute"])), float(str(r["speedup"])), float(str(r["efficiency"])))
        for r in results
        if r["microbatches"] == 4
    )
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label="speed-up serial/overlapped")
    ax.plot([p[0] for p in pts], [p[2] for p in pts], "s--", label="efficiency bound/overlapped")
    ax.axvline(1.0, color="grey", lw=0.5)
    ax.set_xscale("log")
    ax.set_xlabel("comm-only / compute-only")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="tiny sizes (CPU smoke run)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--microbatches", type=int, default=4, help="per step, for the sweep")
    p.add_argument(
        "--more-microbatches",
        type=int,
        nargs="*",
        default=[8],
        help="also run these counts at the main and the comm~compute configuration",
    )
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--sweep-ffn", type=int, nargs="*", default=[512, 256, 1024, 4096, 8192])
    p.add_argument("--sweep-tokens", type=int, nargs="*", default=[2048])
    p.add_argument("--sweep-hidden", type=int, nargs="*", default=[2048, 7168])
    p.add_argument(
        "--budget-s",
        type=float,
        default=math.inf,
        help="skip the remaining configurations once this many seconds have passed",
    )
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    env: JsonDict = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "argv": sys.argv,
        "warmup": args.warmup,
        "iters": args.iters,
    }
    print(json.dumps(env), flush=True)
    results: list[JsonDict] = []
    skipped: list[str] = []

    def run(cfg: SliceConfig, n: int, *, main: bool = False) -> None:
        label = f"H={cfg.hidden} F={cfg.ffn} T={cfg.tokens} N={n}"
        if time.perf_counter() - t_start > args.budget_s:
            skipped.append(label)
            print(f"skipped (time budget): {label}", flush=True)
            return
        t0 = time.perf_counter()
        try:
            r = measure(cfg, args, microbatches=n, main=main, out=args.out)
        except torch.OutOfMemoryError as exc:  # keep the rest of the sweep
            print(f"OOM for {label}: {exc}", flush=True)
            return
        r["wall_s"] = time.perf_counter() - t0
        print(json.dumps(r), flush=True)
        r["slice_config"] = cfg
        results.append(r)
        if args.device == "cuda":
            torch.cuda.empty_cache()
        _save(args.out, env, results, skipped)

    ffn_cfgs = ffn_sweep(args)
    for i, cfg in enumerate(ffn_cfgs):
        run(cfg, args.microbatches, main=i == 0)
    balanced = closest_to_balance(results)
    env["balanced_config"] = None if balanced is None else dataclasses.asdict(balanced)
    for n in args.more_microbatches:
        twice = [ffn_cfgs[0]] if balanced in (None, ffn_cfgs[0]) else [ffn_cfgs[0], balanced]
        for cfg in twice:
            assert cfg is not None
            run(cfg, n)
    for cfg in shape_sweep(args):
        run(cfg, args.microbatches)
    # Host cost where the GPU never holds the host back: sizes so small that issuing is
    # slower than running.
    small = SliceConfig(hidden=256, ffn=128, tokens=256, head_dim=64)
    sb = make_bench(small, args, args.microbatches)
    time_ms(sb, lambda: step(sb, overlap=True))
    host_small: JsonDict = {"config": _config_json(small, sb.model.embed_scale.dtype)}
    host_small.update(host_time(sb))
    host_small["graphs"] = host_time(sb, graphs=True)
    steps: dict[str, Callable[[], None]] = {
        "overlapped_ms": lambda: step(sb, overlap=True),
        "fill_drain_ms": lambda: step(sb, overlap=True, fill_drain=True),
    }
    for name, fn in steps.items():
        host_small[name] = median(time_ms(sb, fn))
        sb.model.set_graphs(True)
        for _ in range(3):
            fn()
        host_small[f"graphs_{name}"] = median(time_ms(sb, fn))
        sb.model.set_graphs(False)
    print(json.dumps({"host_small": host_small}), flush=True)
    env["wall_s"] = time.perf_counter() - t_start
    _save(args.out, env, results, skipped, host_small)
    write_sweep_png(results, args.out / "sweep.png")
    print(_table(results), flush=True)
    if balanced is not None:
        print(
            f"comm~compute configuration: H={balanced.hidden} F={balanced.ffn} T={balanced.tokens}",
            flush=True,
        )
    print(f"skipped: {skipped}; wall {env['wall_s']:.1f} s", flush=True)


def _save(
    out: Path,
    env: JsonDict,
    results: list[JsonDict],
    skipped: list[str],
    host_small: JsonDict | None = None,
) -> None:
    rows = [{k: v for k, v in r.items() if k != "slice_config"} for r in results]
    doc: JsonDict = {"env": env, "results": rows, "skipped": skipped}
    if host_small is not None:
        doc["host_small"] = host_small
    (out / "results.json").write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
