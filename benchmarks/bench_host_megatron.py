"""Host cost per layer node, side by side: ``moe_overlap`` vs Megatron-Core 0.19.

Usage (device, with the Megatron-Core wheel on ``PYTHONPATH``)::

    PYTHONPATH=/tmp/site:src python3 benchmarks/bench_host_megatron.py --out DIR

and on a laptop, ours only: ``PYTHONPATH=src python benchmarks/bench_host_megatron.py
--ours-only --device cpu``.

Both sides build the same thing: layers of four ``TransformerLayerNode`` s named like
Megatron's slots (``pre_dispatch_computation``, ``moe_dispatch``, ``mlp``,
``moe_combine``; an MoE layer with 2 local experts and the ``alltoall`` dispatcher, so the
last three free their inputs after forward), every slot function one ``x * 2`` on a small
tensor that requires grad, all nodes on the compute stream (the current CUDA stream), one
event per microbatch (8 events, layer ``i`` uses event ``i % 8``). Per repeat and side, in
turn, each phase is timed with ``time.perf_counter`` over ``--nodes`` nodes, with the
garbage collector off and a ``synchronize`` before each phase (outside its timing):

- ``construct``: build the nodes (configuration, layer state and events made beforehand:
  a schedule plan makes those once per layer or microbatch, not per node);
- ``forward``: each layer's four ``forward`` calls, in order;
- ``backward``: each layer's four ``backward`` calls, in reverse order, from a ones grad;
- ``backward_dw`` (only with delayed wgrad): each node's ``backward_dw`` (a no-op module
  on ``pre_dispatch_computation`` and ``mlp``, as Megatron's builder attaches them);
- ``drop``: release the nodes (Megatron's ``__del__`` runs here).

Reported: microseconds per node, the median over ``--repeats`` repeats (a warm-up repeat
first), per phase and in total. Megatron-Core is imported through ``importlib`` only
(``megatron.core.pipeline_parallel.utils``, ``megatron.core.models.common.utils``); a
module its import chain needs but that is missing is replaced by an empty stub module,
and the stubbed names are reported. If Megatron-Core cannot be imported or fails, its
traceback is printed and our numbers are still reported.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib
import json
import platform
import statistics
import sys
import time
import traceback
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from moe_overlap import (
    ChunkState,
    LayerArgs,
    LayerState,
    Microbatch,
    SlotContext,
    TransformerLayerNode,
)
from moe_overlap.engine import without_guards
from moe_overlap.megatron import layer_args
from moe_overlap.streams import AnyEvent, AnyStream, make_event, make_streams

SLOTS = ("pre_dispatch_computation", "moe_dispatch", "mlp", "moe_combine")
"""Megatron-Core's slot names; the free-input policy keys on them."""

WGRAD_SLOTS = frozenset({"pre_dispatch_computation", "mlp"})
N_EVENTS = 8


@dataclass(frozen=True)
class BenchConfig:
    """Every configuration field either node reads (Megatron's ``TransformerConfig`` names)."""

    moe_token_dispatcher_type: str = "alltoall"
    moe_flex_dispatcher_backend: str | None = None
    fp8: str | None = None
    fp4: str | None = None
    cuda_graph_modules: tuple[object, ...] = ()
    moe_ncclep_zero_copy: bool = False
    delay_wgrad_compute: bool = False


class NoopWgrad(nn.Module):
    """A module with delayed weight gradients that has none to compute."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))

    def backward_dw(self) -> None:
        return None


# --- the slot functions: the same work on both sides ------------------------------------


def ours_slot(node: SlotContext, inputs: tuple[Tensor, ...], /) -> Tensor:
    (x,) = inputs
    return x * 2


def megatron_slot(node: object, x: Tensor) -> Tensor:
    return x * 2


# --- one side of the comparison -----------------------------------------------------------


@dataclass
class Side:
    """How to build, run and release the nodes of one implementation."""

    name: str
    build: Callable[[str, int], object]  # (slot name, layer index) -> node
    forward: Callable[[Any, Tensor], Tensor]
    backward: Callable[[Any, Tensor], Tensor]
    backward_dw: Callable[[Any], None]


@dataclass
class Env:
    device: torch.device
    stream: AnyStream
    events: list[AnyEvent]

    def comp_stream(self) -> AnyStream:
        """The compute stream, as a zero-argument provider (Megatron's ``get_comp_stream``)."""
        return self.stream

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def _ours_forward(node: Any, x: Tensor) -> Tensor:
    out: tuple[Tensor, ...] = node.forward(x)
    return out[0]


def _ours_backward(node: Any, g: Tensor) -> Tensor:
    grads: tuple[Tensor | None, ...] = node.backward(g)
    grad = grads[0]
    assert grad is not None
    return grad


def _node_backward_dw(node: Any) -> None:
    node.backward_dw()


def _megatron_forward(node: Any, x: Tensor) -> Tensor:
    out: Tensor = node.forward(x)
    return out


def _megatron_backward(node: Any, g: Tensor) -> Tensor:
    grad: Tensor = node.backward(g)
    return grad


def ours_side(
    env: Env, config: BenchConfig, *, delay: bool, dict_args: bool, n_layers: int
) -> Side:
    """Our ``TransformerLayerNode``, with prebuilt :class:`~moe_overlap.LayerArgs` (as our
    plans pass them) or with a Megatron-style ``extra_args`` dict (checked per node)."""
    extra: dict[str, object] = {
        "config": config,
        "is_moe": True,
        "num_local_experts": 2,
        "delay_wgrad_compute": delay,
    }
    args: LayerArgs | dict[str, object] = extra if dict_args else layer_args(extra)
    wgrad = [NoopWgrad().to(env.device)]
    chunk_state = ChunkState(Microbatch())
    layer_states = [LayerState() for _ in range(n_layers)]

    def build(slot: str, i: int) -> object:
        return TransformerLayerNode(
            env.comp_stream,
            env.events[i % N_EVENTS],
            layer_states[i],
            chunk_state,
            ours_slot,
            name=slot,
            bwd_dw_callables=wgrad if slot in WGRAD_SLOTS else None,
            extra_args=args,
        )

    name = "ours (dict extra_args)" if dict_args else "ours"
    return Side(name, build, _ours_forward, _ours_backward, _node_backward_dw)


def megatron_side(
    env: Env, config: BenchConfig, mcore: types.ModuleType, *, delay: bool, n_layers: int
) -> Side:
    """Megatron-Core 0.19's ``megatron.core.models.common.utils.TransformerLayerNode``."""
    node_cls: Any = mcore.TransformerLayerNode
    layer_state_cls: Any = mcore.LayerState
    extra: dict[str, object] = {
        "config": config,
        "is_moe": True,
        "num_local_experts": 2,
        "delay_wgrad_compute": delay,
    }
    wgrad = [NoopWgrad().to(env.device)]
    chunk_state = types.SimpleNamespace()
    layer_states: list[object] = [layer_state_cls() for _ in range(n_layers)]

    def build(slot: str, i: int) -> object:
        made: object = node_cls(
            env.comp_stream,
            env.events[i % N_EVENTS],
            layer_states[i],
            chunk_state,
            megatron_slot,
            name=slot,
            bwd_dw_callables=wgrad if slot in WGRAD_SLOTS else None,
            extra_args=extra,
        )
        return made

    return Side("megatron", build, _megatron_forward, _megatron_backward, _node_backward_dw)


# --- timing --------------------------------------------------------------------------------


def run_repeat(env: Env, side: Side, n_layers: int, delay: bool) -> dict[str, float]:
    """Time each phase over ``n_layers`` layers of 4 nodes; return µs per node."""
    n_nodes = n_layers * len(SLOTS)
    xs = [torch.randn(16, device=env.device, requires_grad=True) for _ in range(n_layers)]
    g0 = torch.ones(16, device=env.device)
    build, fwd, bwd, bwd_dw = side.build, side.forward, side.backward, side.backward_dw
    times: dict[str, float] = {}
    gc.collect()
    env.sync()
    gc.disable()
    try:
        t0 = time.perf_counter()
        nodes = [[build(slot, i) for slot in SLOTS] for i in range(n_layers)]
        times["construct"] = time.perf_counter() - t0
        env.sync()

        t0 = time.perf_counter()
        outs: list[Tensor] = []
        for layer, x in zip(nodes, xs, strict=True):
            h = x
            for node in layer:
                h = fwd(node, h)
            outs.append(h)
        times["forward"] = time.perf_counter() - t0
        env.sync()

        t0 = time.perf_counter()
        grads: list[Tensor] = []
        for layer in nodes:
            g = g0
            for node in reversed(layer):
                g = bwd(node, g)
            grads.append(g)
        times["backward"] = time.perf_counter() - t0
        env.sync()

        if delay:
            t0 = time.perf_counter()
            for layer in nodes:
                for node in layer:
                    bwd_dw(node)
            times["backward_dw"] = time.perf_counter() - t0
            env.sync()

        t0 = time.perf_counter()
        nodes.clear()
        times["drop"] = time.perf_counter() - t0
    finally:
        gc.enable()
    # Sanity: every layer multiplies by 2 four times, so d out / d x = 16.
    for g in (grads[0], grads[-1]):
        assert torch.equal(g, torch.full_like(g0, 16.0)), f"{side.name}: wrong input grad"
    del outs, grads
    per_node = {k: v * 1e6 / n_nodes for k, v in times.items()}
    per_node["total"] = sum(per_node.values())
    return per_node


def measure(
    env: Env, sides: Sequence[Side], *, n_layers: int, warmup_layers: int, repeats: int, delay: bool
) -> dict[str, dict[str, Any]]:
    """Alternate the sides repeat by repeat; median µs per node per phase."""
    for side in sides:
        run_repeat(env, side, warmup_layers, delay)
    samples: dict[str, list[dict[str, float]]] = {s.name: [] for s in sides}
    for _ in range(repeats):
        for side in sides:
            samples[side.name].append(run_repeat(env, side, n_layers, delay))
    out: dict[str, dict[str, Any]] = {}
    for name, reps in samples.items():
        phases = list(reps[0])
        out[name] = {
            "median_us_per_node": {p: statistics.median(r[p] for r in reps) for p in phases},
            "samples_us_per_node": {p: [round(r[p], 3) for r in reps] for p in phases},
        }
    return out


# --- importing Megatron-Core --------------------------------------------------------------


class _StubModule(types.ModuleType):
    """Stands in for a module Megatron-Core's import chain needs but this machine lacks."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__path__ = []
        self.__version__ = "0.0.0"

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Anything()


class _Anything:
    """Any attribute, call, decoration or subscript of a stubbed module."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # used as a decorator
        return _Anything()

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Anything()

    def __getitem__(self, key: object) -> Any:
        return _Anything()


def load_megatron() -> tuple[types.ModuleType, str, list[str]]:
    """Import Megatron-Core's node module; stub missing third-party modules one by one."""
    stubbed: list[str] = []
    for _ in range(16):
        try:
            importlib.import_module("megatron.core.pipeline_parallel.utils")
            mcore = importlib.import_module("megatron.core.models.common.utils")
            version = str(getattr(importlib.import_module("megatron.core"), "__version__", "?"))
            return mcore, version, stubbed
        except ModuleNotFoundError as e:
            missing = e.name
            if missing is None or missing.split(".")[0] == "megatron" or missing in stubbed:
                raise
            for key in [k for k in sys.modules if k == "megatron" or k.startswith("megatron.")]:
                del sys.modules[key]
            sys.modules[missing] = _StubModule(missing)
            stubbed.append(missing)
            print(f"megatron import: stubbed missing module {missing!r}", flush=True)
    raise ImportError(f"megatron import: still failing after stubbing {stubbed}")


# --- main -----------------------------------------------------------------------------------

PHASES = ("construct", "forward", "backward", "backward_dw", "drop", "total")


def _table(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    lines = [
        "| variant | side | " + " | ".join(PHASES) + " |",
        "|---|---|" + "---|" * len(PHASES),
    ]
    for variant, sides in results.items():
        for side, r in sides.items():
            med: dict[str, float] = r["median_us_per_node"]
            cells = [f"{med[p]:.2f}" if p in med else "" for p in PHASES]
            lines.append(f"| {variant} | {side} | " + " | ".join(cells) + " |")
        if "megatron" in sides and "ours" in sides:
            mg: dict[str, float] = sides["megatron"]["median_us_per_node"]
            us: dict[str, float] = sides["ours"]["median_us_per_node"]
            cells = [f"{us[p] / mg[p]:.2f}" if p in us and mg.get(p) else "" for p in PHASES]
            lines.append(f"| {variant} | ours / megatron | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def _measure_variants(
    args: argparse.Namespace,
    env: Env,
    config: BenchConfig,
    mcore: types.ModuleType | None,
    meta: dict[str, object],
    results: dict[str, dict[str, dict[str, Any]]],
    n_layers: int,
    warmup_layers: int,
    t_start: float,
) -> None:
    """Each variant (plain, delayed wgrad): every side measured, in turn."""
    for variant, delay in (("plain", False), ("delay_wgrad", True)):
        cfg = BenchConfig(delay_wgrad_compute=delay) if delay else config
        sides = [ours_side(env, cfg, delay=delay, dict_args=False, n_layers=n_layers)]
        if not delay:
            sides.append(ours_side(env, cfg, delay=delay, dict_args=True, n_layers=n_layers))
        if mcore is not None:
            try:
                mg = megatron_side(env, cfg, mcore, delay=delay, n_layers=n_layers)
                run_repeat(env, mg, 2, delay)  # smoke test before mixing it into the timing
                sides.append(mg)
            except Exception:
                traceback.print_exc()
                meta["megatron_error"] = traceback.format_exc(limit=5)
                print(f"megatron-core failed in variant {variant}: skipped", flush=True)
        results[variant] = measure(
            env,
            sides,
            n_layers=n_layers,
            warmup_layers=warmup_layers,
            repeats=args.repeats,
            delay=delay,
        )
        print(f"variant {variant} done ({time.perf_counter() - t_start:.1f} s)", flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="host cost per node: moe_overlap vs Megatron-Core")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None)
    p.add_argument("--nodes", type=int, default=2000, help="nodes per timed repeat")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup-nodes", type=int, default=400)
    p.add_argument("--ours-only", action="store_true")
    p.add_argument(
        "--without-guards",
        action="store_true",
        help="detach the library's checks (its guards) while measuring: their own cost is "
        "the difference to a run without this flag",
    )
    p.add_argument("--out", type=Path, default=None, help="folder for host_megatron.json")
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    streams = make_streams(device)
    env = Env(device, streams.comp, [make_event(device) for _ in range(N_EVENTS)])
    n_layers = max(1, args.nodes // len(SLOTS))
    warmup_layers = max(1, args.warmup_nodes // len(SLOTS))

    mcore: types.ModuleType | None = None
    meta: dict[str, object] = {
        "date": datetime.date.today().isoformat(),
        "command": " ".join(
            [Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]
        ),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "host_cpu": _cpu_model(),
        "nodes_per_repeat": n_layers * len(SLOTS),
        "repeats": args.repeats,
        "megatron": None,
        "megatron_stubbed_modules": [],
        "megatron_error": None,
        "guards": "detached" if args.without_guards else "attached",
    }
    if not args.ours_only:
        try:
            t0 = time.perf_counter()
            mcore, version, stubbed = load_megatron()
            meta["megatron"] = version
            meta["megatron_stubbed_modules"] = stubbed
            meta["megatron_import_s"] = round(time.perf_counter() - t0, 2)
            print(f"megatron-core {version} imported in {meta['megatron_import_s']} s", flush=True)
        except Exception:
            traceback.print_exc()
            meta["megatron_error"] = traceback.format_exc(limit=3)
            print("megatron-core not importable: measuring ours only", flush=True)

    config = BenchConfig()
    results: dict[str, dict[str, dict[str, Any]]] = {}
    guards = without_guards() if args.without_guards else contextlib.nullcontext()
    with guards:
        _measure_variants(args, env, config, mcore, meta, results, n_layers, warmup_layers, t_start)
    meta["wall_s"] = round(time.perf_counter() - t_start, 2)
    report = {**meta, "results": results}
    text = json.dumps(report, indent=1)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "host_megatron.json").write_text(text + "\n")
    print(text)
    print()
    print(f"µs per node, median of {args.repeats} repeats of {n_layers * len(SLOTS)} nodes")
    print(_table(results))


if __name__ == "__main__":
    main()
