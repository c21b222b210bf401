"""torchtitan's DeepSeek-V3 through ``TorchtitanMoEAdapter`` on one GPU: exactness and timing.

Two parts, one run (issue 26, part 4):

1. **Exactness**, first (torchtitan's registry ``debugmodel``, all 6 layers, bf16
   parameters, torchtitan's real flex attention on a GPU), under deterministic kernels only
   (``bench_overlap.deterministic_kernels``: ``torch.use_deterministic_algorithms(True)``,
   not warn-only, which also puts inductor's flex kernels in its deterministic mode;
   ``CUBLAS_WORKSPACE_CONFIG=:4096:8``; SDPA, where any, off cuDNN attention): the adapter's
   plain path (forward and backward per microbatch, run twice: run to run) against
   ``combined_1f1b`` serial, overlapped and fill/drain, with and without
   ``delay_wgrad_compute`` (each against the plain path with the same setting); losses,
   every gradient and the ``tokens_per_expert_E`` buffers must be bit-identical. torchtitan's
   own forward and backward (``model(...)``, its ``cross_entropy_loss``) sums the blocks'
   gradients in another order than the adapter's slots, so it is compared like with like:
   with itself, run to run. Any comparison that is not bit-identical, or an error in the
   pass, fails the benchmark: the results are written, the differences logged, and the
   process exits 1 without timing (``--continue-after-inexact``: after timing).
   ``MOE_OVERLAP_BENCH_PERTURB=<row>`` (e.g. ``overlapped (wgrad)``; ``1``: the first
   checked) adds one ulp to that run's first gradient: the failure path's test.
2. **Timing** (the registry's ``16B`` flavour cut to ``--layers`` MoE blocks: hidden 2048,
   64 routed experts top-6, 2 shared experts, expert hidden 1408, MLA attention with flex;
   vocabulary cut to ``--vocab``): the token dispatcher of every block is wrapped so that
   dispatch and combine send the remote ``(ep-1)/ep`` of the routed rows through the
   library's :class:`~moe_overlap.blocks.HostLoopback` (device -> pinned host -> device,
   in both directions of autograd), an emulated EP all-to-all. Variants, interleaved round
   by round: torchtitan's own step (``model(...)`` + loss + ``backward()`` per
   microbatch), the adapter's serial step, overlapped, fill/drain; then compute-only
   (serial with the loopback as a device copy) and comm-only (the step's loopback calls
   back to back). Median and spread of ``--iters`` steps after ``--warmup``; peak memory.

torchtitan 0.3.0 does not import on torch < 2.13 as it is: ``titan_compat`` adds
placeholders for the missing names (listed in the results). On CPU (``--device cpu
--tiny``: a smoke run) flex attention has no backward, so the test-only causal stand-in of
``tests/adapters/_titan.py`` replaces it.

Run: ``PYTHONPATH=src:. python3 benchmarks/bench_torchtitan.py --out $OUT``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_overlap import (
    Run,
    add_ulp,
    compare,
    describe,
    deterministic_kernels,
    perturb_target,
)
from titan_compat import compile_flex, import_torchtitan

from moe_overlap import Microbatch, StreamPair, combined_1f1b, make_streams
from moe_overlap.blocks import HostLoopback, LoopbackMode, finish_wgrad, loopback

JsonDict = dict[str, Any]
LOG: list[str] = []


def tt(module: str) -> Any:
    """A torchtitan module (untyped: its names are ``Any`` here)."""
    return importlib.import_module(module)


def log(msg: str) -> None:
    print(msg, flush=True)
    LOG.append(msg)


# --- models -----------------------------------------------------------------------------------
def cast_parameters(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Parameters to ``dtype``; buffers stay (``.to(dtype)`` would turn DeepSeek's complex
    RoPE cache real, and torchtitan keeps its MoE counters in float32)."""
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model


def build(
    flavor: str,
    *,
    device: torch.device,
    dtype: torch.dtype,
    layers: slice,
    vocab: int | None = None,
    seed: int = 0,
) -> nn.Module:
    """torchtitan's ``deepseek_v3`` ``flavor`` from its registry, ``layers`` of its blocks,
    built on ``device``, parameters in ``dtype``."""
    config: Any = tt("torchtitan.models.deepseek_v3").model_registry(flavor).model
    changes: dict[str, Any] = {"layers": list(config.layers[layers])}
    if vocab is not None:
        changes |= {
            "vocab_size": vocab,
            "tok_embeddings": dataclasses.replace(config.tok_embeddings, num_embeddings=vocab),
            "lm_head": dataclasses.replace(config.lm_head, out_features=vocab),
        }
    config = dataclasses.replace(config, **changes)
    torch.manual_seed(seed)  # pyright: ignore[reportUnknownMemberType] - unannotated
    with torch.device(device):
        model = cast(nn.Module, config.build())
    cast(Any, model).init_states(buffer_device=device)
    if device.type == "cpu":  # flex attention has no CPU backward: the tests' stand-in
        from tests.adapters._titan import causal_stand_in

        causal_stand_in(model)
    return cast_parameters(model, dtype)


def microbatches(
    model: nn.Module, n: int, *, b: int, s: int, device: torch.device, seed: int = 1
) -> list[Microbatch]:
    g = torch.Generator().manual_seed(seed)
    vocab = int(cast(Any, model).config.vocab_size)
    out: list[Microbatch] = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (b, s + 1), generator=g).to(device)
        out.append(
            Microbatch(
                input_ids=ids[:, :-1].contiguous(),
                labels=ids[:, 1:].contiguous(),
                position_ids=torch.arange(s, device=device).expand(b, s).contiguous(),
            )
        )
    return out


# --- the emulated EP all-to-all ---------------------------------------------------------------
def wrap_dispatchers(model: nn.Module, *, ep: int, chunks: int) -> HostLoopback:
    """Every block's token dispatcher (torchtitan's own, without an EP mesh: its local
    path) replaced by a subclass of its class whose dispatch and combine send the remote
    ``(ep-1)/ep`` of the routed rows through one shared :class:`HostLoopback`."""
    mover = HostLoopback(remote_rows=0, chunks=chunks)
    classes: dict[type[Any], type[Any]] = {}

    def loopback_class(base: type[Any]) -> type[Any]:
        class LoopbackTokenDispatcher(base):  # type: ignore[misc]
            """torchtitan's dispatcher with an emulated all-to-all after dispatch and
            before combine."""

            def _move(self, x: Tensor) -> Tensor:
                mover.remote_rows = x.shape[0] * (ep - 1) // ep
                return loopback(x, mover)

            def dispatch(self, *args: Tensor) -> tuple[Tensor, Tensor, object]:
                out = cast(tuple[Tensor, Tensor, object], base.dispatch(self, *args))
                routed, counts, metadata = out
                return self._move(routed), counts, metadata

            def combine(self, routed_out: Tensor, metadata: object, x: Tensor) -> Tensor:
                return cast(Tensor, base.combine(self, self._move(routed_out), metadata, x))

            def __deepcopy__(self, memo: dict[int, object]) -> object:
                new: Any = object.__new__(type(self))
                new.__dict__.update(copy.deepcopy(cast(dict[str, object], self.__dict__), memo))
                return new

        return LoopbackTokenDispatcher

    for module in model.modules():
        routed: Any = getattr(module, "routed_experts", None)
        if routed is not None:
            old: Any = routed.token_dispatcher
            assert getattr(old, "ep_mesh", None) is None, "expects no EP mesh (one GPU)"
            kind: type[Any] = old.__class__
            cls = classes.setdefault(kind, loopback_class(kind))
            new: Any = object.__new__(cls)
            new.__dict__.update(old.__dict__)
            routed.token_dispatcher = new
    return mover


# --- steps ------------------------------------------------------------------------------------
def titan_step(model: nn.Module, mbs: list[Microbatch]) -> list[Tensor]:
    """torchtitan's own forward and backward per microbatch: ``model(tokens, positions,
    attention_masks)`` (masks from ``get_attention_masks``, as its trainer builds them with
    flex attention), its ``cross_entropy_loss`` over the labelled tokens."""
    cross_entropy_loss = tt("torchtitan.components.loss").cross_entropy_loss
    m = cast(Any, model)
    losses: list[Tensor] = []
    for mb in mbs:
        assert mb.labels is not None
        assert mb.position_ids is not None
        masks = m.get_attention_masks(mb.position_ids) if _uses_flex(model) else None
        logits = m(mb.input_ids, positions=mb.position_ids, attention_masks=masks)
        loss: Tensor = cross_entropy_loss(logits, mb.labels) / (mb.labels != -100).sum()
        torch.autograd.backward(loss)
        losses.append(loss.detach())
    return losses


def _uses_flex(model: nn.Module) -> bool:
    flex: type[Any] = tt("torchtitan.models.common.attention").FlexAttention
    return any(isinstance(x, flex) for x in model.modules())


def plain_step(adapter: Any, mbs: list[Microbatch], *, delay: bool) -> list[Tensor]:
    """The adapter's plain path: forward and backward per microbatch."""
    losses: list[Tensor] = []
    for mb in mbs:
        loss: Tensor = adapter.forward(mb.input_ids, mb.position_ids, labels=mb.labels)
        torch.autograd.backward(loss)
        if delay:
            finish_wgrad(adapter.model)
        losses.append(loss.detach())
    return losses


def schedule_step(
    adapter: Any,
    mbs: list[Microbatch],
    streams: StreamPair,
    *,
    overlap: bool,
    fill_drain: bool = False,
) -> list[Tensor]:
    serial = StreamPair(comp=streams.comp, comm=streams.comp)
    return combined_1f1b(
        adapter,
        mbs,
        overlap=overlap,
        fill_drain=fill_drain,
        streams=streams if overlap else serial,
        options=adapter.schedule_options(),
    )


# --- exactness --------------------------------------------------------------------------------
def _grads(model: nn.Module) -> dict[str, Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    for n, b in model.named_buffers():
        if n.endswith("tokens_per_expert_E"):
            out[n] = b.detach().clone()
    return out


#: The exactness rows a failure test may perturb: each scheduled step, per wgrad setting.
CHECKED = tuple(
    f"{kind} ({tag})"
    for tag in ("wgrad", "delayed_wgrad")
    for kind in ("serial", "overlapped", "fill_drain")
)


def exactness(
    args: argparse.Namespace, device: torch.device, dtype: torch.dtype, perturb: str | None
) -> JsonDict:
    """The comparisons of the module docstring, under deterministic kernels."""
    from moe_overlap.adapters.torchtitan import TorchtitanMoEAdapter

    layers = slice(0, 3) if args.tiny else slice(None)
    base = build("debugmodel", device=device, dtype=dtype, layers=layers)
    b, s = (2, 16) if args.tiny else (2, 256)
    mbs = microbatches(base, args.exact_microbatches, b=b, s=s, device=device)
    streams = make_streams(device)
    out: JsonDict = {
        "model": "deepseek_v3 debugmodel (torchtitan registry)",
        "blocks": len(cast(Any, base).layers),
        "microbatches": len(mbs),
        "batch": b,
        "seq": s,
        "attention": "flex" if _uses_flex(base) else "causal stand-in (CPU)",
        "perturbed": perturb,
    }
    if _uses_flex(base):  # torch < 2.13 has no separate_full_blocks: check it still does
        pos = mbs[0].position_ids
        masks: Any = cast(Any, base).get_attention_masks(pos)
        mask: Any = masks
        if isinstance(masks, dict):  # one per attention kind
            mask = next(iter(cast(dict[str, Any], masks).values()))
        out["block_mask_full_blocks_separate"] = (
            getattr(mask, "full_kv_num_blocks", None) is not None
        )
    self_check: JsonDict = {}

    def run(kind: str, delay: bool = False) -> Run:
        model = copy.deepcopy(base)
        if kind == "titan":
            losses = titan_step(model, mbs)
        else:
            adapter = TorchtitanMoEAdapter(
                model, delay_wgrad_compute=delay, self_check=not self_check
            )
            if not self_check:
                self_check.update(_report(adapter))
            if kind == "plain":
                losses = plain_step(adapter, mbs, delay=delay)
            else:
                losses = schedule_step(
                    adapter, mbs, streams, overlap=kind != "serial", fill_drain=kind == "fill_drain"
                )
        _sync(device)
        return [x.detach().clone() for x in losses], _grads(model)

    rows: dict[str, JsonDict] = {}
    with deterministic_kernels(device, "sdpa") as kernels:
        for delay in (False, True):
            tag = "delayed_wgrad" if delay else "wgrad"
            ref = run("plain", delay)
            rows[f"plain ({tag}) run to run"] = {
                "reference": f"plain ({tag})",
                **compare(run("plain", delay), ref),
            }
            for kind in ("serial", "overlapped", "fill_drain"):
                name = f"{kind} ({tag})"
                got = run(kind, delay)
                if perturb == name or (perturb == "1" and name == CHECKED[0]):
                    add_ulp(next(iter(got[1].values())))
                rows[name] = {"reference": f"plain ({tag})", **compare(got, ref)}
            if not delay:
                rows["torchtitan own step run to run"] = {
                    "reference": "torchtitan own step",
                    **compare(run("titan"), run("titan")),
                }
    out["kernels"] = kernels
    out["rows"] = rows
    out["failed"] = [k for k, r in rows.items() if not r["bit_identical"]]
    for name, r in rows.items():
        log(
            f"[exact] {name:32s} vs {r['reference']:20s} bit_identical={r['bit_identical']!s:5s} "
            f"differing={r['tensors_differing']}/{r['tensors']} max_abs={r['max_abs_diff']:.3g}"
        )
    out["self_check"] = self_check
    return out


def _report(adapter: Any) -> JsonDict:
    report = getattr(adapter, "self_check_report", None)
    if report is None:
        return {"ran": False}
    if dataclasses.is_dataclass(report) and not isinstance(report, type):
        return cast(JsonDict, json.loads(json.dumps(dataclasses.asdict(report), default=str)))
    return {"report": str(report)}


# --- timing -----------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timing(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, n: int) -> JsonDict:
    from moe_overlap.adapters.torchtitan import TorchtitanMoEAdapter

    if args.tiny:
        model = build("debugmodel", device=device, dtype=dtype, layers=slice(1, 1 + args.layers))
        b, s = 1, 32
    else:
        model = build(
            "16B", device=device, dtype=dtype, layers=slice(1, 1 + args.layers), vocab=args.vocab
        )
        b, s = args.batch, args.seq
    mover = wrap_dispatchers(model, ep=args.ep, chunks=args.chunks)
    adapter = TorchtitanMoEAdapter(model, self_check=False)
    mbs = microbatches(model, n, b=b, s=s, device=device)
    streams = make_streams(device)
    moe_cfg = _moe_shape(model)
    params = sum(p.numel() for p in model.parameters())
    log(
        f"[time] N={n} microbatches of {b}x{s} tokens, {len(cast(Any, model).layers)} MoE blocks, "
        f"{moe_cfg}, {params / 1e9:.3f} G parameters"
    )

    def comm_only() -> None:
        cfg = _moe_shape(model)
        rows = b * s * int(cfg["top_k"])
        x = torch.randn(rows, int(cfg["dim"]), device=device, dtype=dtype)
        mover.remote_rows = rows * (args.ep - 1) // args.ep
        comp, comm = streams.comp, streams.comm
        calls = 4 * n * len(cast(Any, model).layers)
        if isinstance(comp, torch.cuda.Stream) and isinstance(comm, torch.cuda.Stream):
            comm.wait_stream(comp)
            with torch.cuda.stream(comm):
                for _ in range(calls):
                    mover(x)
            comp.wait_stream(comm)
        else:
            for _ in range(calls):
                mover(x)

    def compute_only() -> None:
        mover.mode = LoopbackMode.DEVICE
        try:
            schedule_step(adapter, mbs, streams, overlap=False)
        finally:
            mover.mode = LoopbackMode.HOST

    variants: dict[str, Callable[[], object]] = {
        "torchtitan": lambda: titan_step(model, mbs),
        "serial": lambda: schedule_step(adapter, mbs, streams, overlap=False),
        "overlapped": lambda: schedule_step(adapter, mbs, streams, overlap=True),
        "fill_drain": lambda: schedule_step(adapter, mbs, streams, overlap=True, fill_drain=True),
        "compute_only": compute_only,
        "comm_only": comm_only,
    }
    samples: dict[str, list[float]] = {k: [] for k in variants}
    losses: dict[str, list[float]] = {}
    for r in range(args.warmup + args.iters):
        for name, fn in variants.items():
            model.zero_grad(set_to_none=False)
            _sync(device)
            t0 = time.perf_counter()
            res = fn()
            _sync(device)
            ms = (time.perf_counter() - t0) * 1e3
            if r >= args.warmup:
                samples[name].append(ms)
            if isinstance(res, list) and r == 0:
                losses[name] = [float(x) for x in cast(list[Tensor], res)]
        log(
            f"[time] N={n} round {r}{' (warm-up)' if r < args.warmup else ''}: "
            + ", ".join(
                f"{k} {samples[k][-1] if r >= args.warmup else float('nan'):.1f}" for k in variants
            )
        )
    peak: JsonDict = {}
    for name, fn in variants.items():
        if name == "comm_only":
            continue
        model.zero_grad(set_to_none=False)
        _sync(device)
        start = 0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            start = torch.cuda.memory_allocated(device)
        fn()
        _sync(device)
        if device.type == "cuda":
            top = torch.cuda.max_memory_allocated(device)
            peak[name] = {"peak_gb": top / 1e9, "above_start_gb": (top - start) / 1e9}
    rows: JsonDict = {}
    for name, xs in samples.items():
        med = statistics.median(xs)
        rows[name] = {
            "median_ms": med,
            "min_ms": min(xs),
            "max_ms": max(xs),
            "spread": (max(xs) - min(xs)) / min(xs) if xs and min(xs) > 0 else math.nan,
            "samples_ms": xs,
        }
    t = rows["torchtitan"]["median_ms"]
    for name in ("serial", "overlapped", "fill_drain"):
        rows[name]["vs_torchtitan"] = t / rows[name]["median_ms"]
    bound = max(rows["compute_only"]["median_ms"], rows["comm_only"]["median_ms"])
    for name in ("overlapped", "fill_drain"):
        rows[name]["over_max_compute_comm"] = rows[name]["median_ms"] / bound
    moved = mover.bytes_moved
    return {
        "microbatches": n,
        "batch": b,
        "seq": s,
        "tokens_per_microbatch": b * s,
        "blocks": len(cast(Any, model).layers),
        "moe": moe_cfg,
        "vocab": int(cast(Any, model).config.vocab_size),
        "parameters": params,
        "ep_emulated": args.ep,
        "loopback_chunks": args.chunks,
        "loopback_bytes_moved_total": moved,
        "rows": rows,
        "peak_memory": peak,
        "first_round_losses": losses,
    }


def _moe_shape(model: nn.Module) -> JsonDict:
    for module in model.modules():
        routed = getattr(module, "routed_experts", None)
        if routed is not None:
            w1 = routed.inner_experts.w1_EFD
            shared = getattr(module, "shared_experts", None)
            w_shared = getattr(getattr(shared, "w1", None), "weight", None)
            return {
                "num_experts": int(w1.shape[0]),
                "expert_hidden": int(w1.shape[1]),
                "dim": int(w1.shape[2]),
                "top_k": int(routed.token_dispatcher.top_k),
                "shared_hidden": None if w_shared is None else int(w_shared.shape[0]),
            }
    raise AssertionError("no MoE block")


# --- main -------------------------------------------------------------------------------------
def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="CPU smoke sizes")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    p.add_argument("--exact-microbatches", type=int, default=4)
    p.add_argument("--layers", type=int, default=2, help="MoE blocks in the timed model")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--ep", type=int, default=8, help="emulated EP size: (ep-1)/ep rows move")
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--flex-autotune", action="store_true", help="torchtitan's max-autotune")
    p.add_argument("--skip-exact", action="store_true")
    p.add_argument("--skip-timing", action="store_true")
    p.add_argument("--budget-s", type=float, default=1e9, help="skip later timing configs")
    p.add_argument(
        "--continue-after-inexact",
        action="store_true",
        help="time the steps even when the exactness pass failed (still exits 1)",
    )
    args = p.parse_args()
    perturb = perturb_target(CHECKED)
    t_start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    placeholders = import_torchtitan()

    result: JsonDict = {
        "torch": torch.__version__,
        "torchtitan": getattr(tt("torchtitan"), "__version__", "?"),
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype),
        "titan_compat_placeholders": placeholders,
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    log(f"torch {torch.__version__}, torchtitan {result['torchtitan']}, {result['device']}")
    log(f"titan_compat placeholders ({len(placeholders)}): {placeholders}")
    if device.type == "cuda":
        result["flex_inductor_options"] = compile_flex(autotune=args.flex_autotune)
    path = args.out / "bench_torchtitan.json"

    def save() -> None:
        result["wall_s"] = time.perf_counter() - t_start
        path.write_text(json.dumps(result, indent=1, default=str))
        (args.out / "bench_torchtitan_log.txt").write_text("\n".join(LOG) + "\n")

    status = 0
    if not args.skip_exact:
        t0 = time.perf_counter()
        try:
            exact = exactness(args, device, dtype, perturb)
            result["exactness"] = exact
            rows = cast(dict[str, JsonDict], exact["rows"])
            for name in cast(list[str], exact["failed"]):
                status = 1
                msg = f"bench_torchtitan: EXACTNESS FAILED ({exact['kernels']}): " + describe(
                    name, rows[name]["reference"], rows[name]
                )
                log(msg)
                print(msg, file=sys.stderr, flush=True)
        except Exception:
            status = 1
            result["exactness_error"] = traceback.format_exc()
            log(result["exactness_error"])
            print(
                "bench_torchtitan: EXACTNESS FAILED: the pass raised (for one, an operation without a "
                "deterministic implementation raises under deterministic kernels):\n"
                + result["exactness_error"],
                file=sys.stderr,
                flush=True,
            )
        result["exactness_s"] = time.perf_counter() - t0
        save()
        if status and not args.continue_after_inexact:
            print(
                f"bench_torchtitan: stopped: the exactness pass failed, not timed "
                f"(--continue-after-inexact); wrote {path}",
                file=sys.stderr,
                flush=True,
            )
            return 1
    if not args.skip_timing:
        timings: list[JsonDict] = []
        result["timing"] = timings
        for n in args.microbatches:
            if time.perf_counter() - t_start > args.budget_s:
                log(f"[time] N={n} skipped: over --budget-s")
                continue
            t0 = time.perf_counter()
            row: JsonDict
            try:
                row = timing(args, device, dtype, n)
            except Exception:
                status = 1
                row = {"microbatches": n, "error": traceback.format_exc()}
                log(row["error"])
            row["seconds"] = time.perf_counter() - t0
            timings.append(row)
            save()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    save()
    _table(result)
    return status


def _table(result: JsonDict) -> None:
    for row in result.get("timing", []):
        if "rows" not in row:
            continue
        log(
            f"\nN={row['microbatches']} x {row['tokens_per_microbatch']} tokens, "
            f"{row['blocks']} MoE blocks, {row['moe']}"
        )
        log(
            f"{'variant':14s} {'median ms':>10s} {'min':>8s} {'max':>8s} {'spread':>7s} {'peak GB':>8s}"
        )
        for name, r in row["rows"].items():
            peak = row["peak_memory"].get(name, {}).get("peak_gb", math.nan)
            log(
                f"{name:14s} {r['median_ms']:10.1f} {r['min_ms']:8.1f} {r['max_ms']:8.1f} "
                f"{r['spread']:7.3f} {peak:8.2f}"
            )
    for name, r in result.get("exactness", {}).get("rows", {}).items():
        log(
            f"exact {name} vs {r['reference']}: bit_identical={r['bit_identical']} "
            f"max_abs={r['max_abs_diff']:.3g}"
        )


if __name__ == "__main__":
    sys.exit(main())
