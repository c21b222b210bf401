"""The reference model with activation recomputation and torch.compile: step time and peak
memory of the serial and the overlapped step.

Usage (device): ``PYTHONPATH=src python3 benchmarks/bench_compose.py --out DIR``;
on a laptop: ``PYTHONPATH=src python benchmarks/bench_compose.py --device cpu --tiny``.

The model is :class:`~moe_overlap.models.GPTMoEModel` at the overlap benchmark's main size
(``H=4096``, expert ``F=2048``, 64 experts top-8, 4 MoE layers, bf16, ``T=4096`` tokens per
microbatch, 4 microbatches), every expert local, the all-to-all emulated by the loopback
dispatcher (a round trip through pinned host memory). Variants, each a fresh model:

- ``serial`` / ``overlapped``: ``combined_1f1b(overlap=False / True)``, nothing recomputed;
- ``... +recompute(parts)``: ``GPTMoEConfig.recompute`` (``norm``, ``activation``,
  ``attention`` = the attention block selectively, ``attention_core``);
- ``overlapped +compile``: each layer's attention block, norms, router and shared expert
  compiled (``torch.compile``, inductor, ``fullgraph=True``); experts and dispatcher eager.

Per variant: median step milliseconds over ``--iters`` steps after ``--warmup`` (the
compile happens there) and the peak allocated memory of one step (``max_memory_allocated``
after ``reset_peak_memory_stats``). Writes ``compose.json`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from moe_overlap import Microbatch, combined_1f1b, make_streams
from moe_overlap.models import GPTMoEConfig, GPTMoEModel

JsonDict = dict[str, object]
COMPILED = ("attn_block", "pre_mlp_norm", "router", "shared_expert")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Variant:
    name: str
    overlap: bool
    recompute: tuple[str, ...] = ()
    compile: bool = False


VARIANTS = (
    Variant(name="serial", overlap=False),
    Variant(name="overlapped", overlap=True),
    Variant(
        name="serial +recompute(all)", overlap=False, recompute=("norm", "activation", "attention")
    ),
    Variant(
        name="overlapped +recompute(norm, activation)",
        overlap=True,
        recompute=("norm", "activation"),
    ),
    Variant(
        name="overlapped +recompute(attention, selective)", overlap=True, recompute=("attention",)
    ),
    Variant(
        name="overlapped +recompute(all)",
        overlap=True,
        recompute=("norm", "activation", "attention"),
    ),
    Variant(name="overlapped +compile", overlap=True, compile=True),
)


def config(args: argparse.Namespace, v: Variant, device: torch.device) -> GPTMoEConfig:
    tiny = args.tiny
    parts: Any = v.recompute  # names as data, checked by the config
    return GPTMoEConfig(
        vocab_size=1024 if not tiny else 128,
        hidden_size=4096 if not tiny else 32,
        num_layers=4,
        first_k_dense=0,
        num_attention_heads=32 if not tiny else 4,
        ffn_hidden_size=2048 if not tiny else 64,
        num_experts=64 if not tiny else 8,
        moe_ffn_hidden_size=2048 if not tiny else 16,
        moe_router_topk=8 if not tiny else 2,
        moe_shared_expert_hidden_size=2048 if not tiny else 16,
        dispatcher="loopback" if device.type == "cuda" else "alltoall",
        attention="sdpa",
        dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
        recompute=parts,
    )


def _fast_init(model: GPTMoEModel) -> None:
    """Random weights drawn on the model's device (the seeded CPU init of 64 experts of
    4096 x 4096 takes a minute per model; a benchmark needs random, not reproducible)."""
    std = model.config.init_std
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std)


class _RandomModel(GPTMoEModel):
    def reset_parameters(self) -> None:
        _fast_init(self)


def build(args: argparse.Namespace, v: Variant, device: torch.device) -> GPTMoEModel:
    cls = _RandomModel if device.type == "cuda" else GPTMoEModel
    model = cls(config(args, v, device), device=device)
    if v.compile:
        backend = "inductor" if device.type == "cuda" or not args.tiny else "aot_eager"
        for layer in model.layer_list:
            for name in COMPILED:
                module = getattr(layer, name, None)
                if isinstance(module, torch.nn.Module):
                    torch_module: Any = module  # nn.Module.compile is unannotated
                    torch_module.compile(backend=backend, fullgraph=True)
    return model


def microbatches(args: argparse.Namespace, device: torch.device) -> list[Microbatch]:
    g = torch.Generator().manual_seed(0)
    batch, seq = (2, 2048) if not args.tiny else (2, 8)
    vocab = 1024 if not args.tiny else 128
    out: list[Microbatch] = []
    for _ in range(args.microbatches):
        x = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
        out.append(Microbatch(input_ids=x, labels=x.roll(-1, 1)))
    return out


def measure(args: argparse.Namespace, v: Variant, device: torch.device) -> JsonDict:
    model = build(args, v, device)
    mbs = microbatches(args, device)
    streams = make_streams(device) if v.overlap else None
    cuda = device.type == "cuda"

    def step() -> None:
        model.zero_grad(set_to_none=False)
        combined_1f1b(
            model,
            mbs,
            overlap=v.overlap,
            streams=streams,
            options=model.schedule_options(),
        )

    for _ in range(args.warmup):
        step()
    times: list[float] = []
    for _ in range(args.iters):
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    peak = None
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) / 2**30
    if cuda:
        torch.cuda.empty_cache()  # the model goes with this frame; the next starts clean
    return {"variant": v.name, "step_ms": statistics.median(times), "peak_gib": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke run)")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--only", default="", help="comma-separated variant names")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    chosen = [v for v in VARIANTS if not args.only or v.name in args.only.split(",")]
    rows: list[JsonDict] = []
    for v in chosen:
        rows.append(measure(args, v, device))
        print(json.dumps(rows[-1]), flush=True)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "compose_partial.json").write_text(json.dumps(rows, indent=2))
    serial = next((r for r in rows if r["variant"] == "serial"), None)
    print("| variant | step ms | peak GiB | peak / serial |")
    print("|---|---|---|---|")
    for r in rows:
        peak = r["peak_gib"]
        ratio = (
            f"{peak / serial['peak_gib']:.3f}"
            if isinstance(peak, float) and serial and isinstance(serial["peak_gib"], float)
            else "-"
        )
        shown = f"{peak:.2f}" if isinstance(peak, float) else "-"
        print(f"| {r['variant']} | {r['step_ms']:.1f} | {shown} | {ratio} |")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
        (args.out / "compose.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
