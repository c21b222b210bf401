"""Megatron-Core's own combined 1F1B beside ``moe_overlap``'s, on one Megatron-Core model, one GPU.

Usage (one GPU, Megatron-Core 0.19 importable)::

    PYTHONPATH=src:. python3 benchmarks/bench_megatron_1gpu.py --out DIR

and on a laptop (a tiny model, Megatron's CUDA-only calls replaced, see below)::

    PYTHONPATH=src:. python benchmarks/bench_megatron_1gpu.py --device cpu --tiny --out DIR

**The model.** One Megatron-Core ``GPTModel`` (local layer spec, ``--layers`` MoE layers:
hidden ``--hidden``, ``--heads`` attention heads, ``--experts`` experts of FFN ``--ffn``,
top-``--topk``, the all-to-all token dispatcher (dropless), ``moe_grouped_gemm=False``, no
dropout, no auxiliary loss), ``--dtype`` parameters, ``--microbatches`` microbatches of one
sequence of ``--seq`` random tokens. Defaults: ``bench_overlap.py``'s main size (hidden
4096, expert FFN 2048, 4096 tokens per microbatch, 4 microbatches, 4 layers, bf16) with the
experts scaled to one GPU as its slice does: an EP rank of 64 experts top-8 over 8 ranks
holds 8 experts and receives 8 x 4096 rows per microbatch; here 8 experts top-8, so each
receives exactly 4096 rows, that rank's load.

**The all-to-all stand-in** (a benchmark-only patch, restored on exit): at expert
parallelism 1 Megatron-Core's ``all_to_all`` hands its input back, so there would be no
communication to hide. The dispatcher's ``all_to_all`` (module
``megatron.core.transformer.moe.token_dispatcher``) is replaced by a round trip of the
rows an EP rank of ``--ep`` would send off-rank (``(ep-1)/ep`` of them) through pinned host
memory on the calling stream (:class:`~moe_overlap.blocks.HostLoopback`, ``--chunks``
duplex pieces; its backward sends the gradient the same way). Values are unchanged. Both
sides call the dispatcher's own ``token_dispatch`` / ``token_combine``, so the one patch
is injected identically into both.

**Megatron-Core's own combined 1F1B** runs through its pipeline entry point
``forward_backward_no_pipelining`` (PP=1), which takes its combined-1F1B path
(``combined_1f1b_schedule_for_no_pipelining`` on ``GPTModel.build_schedule_plan``'s
``TransformerModelChunkSchedulePlan``) when ``config.overlap_moe_expert_parallel_comm``
is set; with the flag off the same call is Megatron's plain loop (forward and backward per
microbatch). Two things stand in the way at EP=1, and the benchmark works around them:

1. ``TransformerConfig.__post_init__`` refuses the flag without expert parallelism (and
   without bf16/fp16): the model is built without it and the flag is set on its config
   only for the duration of Megatron's combined step (it selects the schedule; on the
   non-graphed paths this model takes nothing else reads it).
2. The dispatch node frees its input after forward (``should_free_input``); at EP=1 the
   all-to-all's output *is* its input, so the experts would read freed memory. The
   stand-in returns a fresh buffer, as a real all-to-all does, so Megatron's free-input
   policy runs unchanged here; ``--keep-dispatch-input`` keeps the dispatch input anyway
   (``should_free_input`` false for ``moe_dispatch``), the workaround a run without the
   stand-in needs.

Megatron's loss: ``forward_step_func`` returns the model's per-token loss and a loss
function giving the mean over the tokens (:func:`~moe_overlap.adapters.megatron.masked_mean`),
which Megatron divides by the number of microbatches. The library's variants use the
adapter with a loss of ``masked_mean(...) / N``, the same operations, so losses and
gradients are comparable bit for bit.

**Variants** (one model, one set of weights, gradients zeroed before each step):
``megatron_plain`` and ``megatron_combined`` (above); ``serial``, ``overlapped``,
``fill_drain``, ``fill_drain_recompute`` (``pre_dispatch`` and ``mlp`` recomputed),
``fill_drain_recompute_mlp`` (the experts only) and ``fill_drain_searched`` (the node order ``moe_overlap.steps.search_order``
finds from a serial step's node durations; ``--no-search`` leaves it out) through
:class:`~moe_overlap.adapters.megatron.MegatronMoEAdapter`, all with the free-input policy
on, as Megatron's; ``compute_only`` (serial with the stand-in as one device copy) and
``comm_only`` (the step's stand-in calls back to back on the comm stream), the bounds.

1. **Exactness**, first, under deterministic kernels only (``bench_overlap``'s
   ``deterministic_kernels``): every variant's losses and gradients against a
   ``megatron_plain`` step: bit-identical or not, the largest absolute difference.
   ``megatron_plain`` run to run and the library's variants must be bit-identical: anything
   else fails the benchmark (results written, exit 1, no timing unless
   ``--continue-after-inexact``). ``megatron_combined`` is reported, not required.
   ``MOE_OVERLAP_BENCH_PERTURB=<row>`` (``1``: the first library row) adds one ulp to that
   row's first gradient: the failure path's test. ``--exact-runs N`` repeats every step N
   times against the one reference (a race shows in some runs, not all); ``--shake`` queues
   seeded random delays (up to ``--max-delay-us``) on the library's streams at node
   boundaries in every other run, so the streams slide against each other. A row is
   bit-identical only if every run was; the tables give how many runs differed.
   The exactness claim for the GPU comes from such a repeated run::

       PYTHONPATH=src:. python3 benchmarks/bench_megatron_1gpu.py --exact-runs 10 --shake \
           --skip-timing --out DIR
2. **Timing**: ``--warmup`` untimed then ``--iters`` timed rounds, each running every
   variant once in an order rotated by one per round; milliseconds per step (CUDA events
   on the compute stream), median and spread ((max - min) / min). Then peak memory of one
   step of each variant (``torch.cuda.max_memory_allocated``; on any device, the peak of
   the activations autograd saves, ``tests/saved_bytes.py``), and host time per layer
   pair: the host seconds of each combined forward+backward chunk run (Megatron's
   ``TransformerModelChunkSchedulePlan.run``, the library's ``ModelChunkSchedulePlan.run``)
   of ``megatron_combined`` and ``overlapped`` steps over the layers, with the GPU time of
   the same runs. Both include the dispatcher's own device-to-host wait (dropless routing
   reads the token counts on the host once per layer and microbatch).

Writes ``megatron.json`` (everything) and ``megatron.md`` (the tables) to ``--out``.

On CPU (``--device cpu --tiny``, a smoke run) Megatron's CUDA-only calls are replaced:
the model's by the test shim ``tests/adapters/_megatron_cpu.py``, the schedule's (CUDA
events, streams, ``record_stream``, a counter made on ``"cuda"``) by ``benchmarks/megatron_cpu_schedule.py``.
On a GPU Megatron-Core runs unpatched except for the stand-in and the two workarounds.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import importlib
import json
import math
import os
import platform
import socket
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any, Literal, cast

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts

import torch
import torch.distributed as dist
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
    spread,
    time_interleaved,
)
from node_timing import Clock, NodeRecorder, slot_durations

from moe_overlap import (
    Microbatch,
    ModelChunkSchedulePlan,
    ScheduleOptions,
    StreamPair,
    combined_1f1b,
    make_streams,
)
from moe_overlap.blocks import HostLoopback, LoopbackMode, loopback
from moe_overlap.steps import search_order
from moe_overlap.streams import shake

JsonDict = dict[str, Any]
LOG: list[str] = []

#: The library's variants, in the order the exactness pass checks them.
LIBRARY = (
    "serial",
    "overlapped",
    "fill_drain",
    "fill_drain_recompute",
    "fill_drain_recompute_mlp",
    "fill_drain_searched",
)
"""The library's variants (exactness required)."""
RECOMPUTE: dict[str, tuple[Literal["pre_dispatch", "mlp"], ...]] = {
    "fill_drain_recompute": ("pre_dispatch", "mlp"),
    "fill_drain_recompute_mlp": ("mlp",),
}
"""Fill/drain with recomputed slots: the memory the extra microbatch in flight costs, paid
back with compute (``ScheduleOptions.recompute``)."""


def log(msg: str) -> None:
    print(msg, flush=True)
    LOG.append(msg)


def mc(module: str) -> Any:
    """A Megatron-Core module (untyped: its names are ``Any`` here)."""
    return importlib.import_module(module)


# --- setup ----------------------------------------------------------------------------------
@contextlib.contextmanager
def _parallel_state(device: torch.device) -> Generator[None, None, None]:
    """Megatron-Core's model-parallel state on one rank (TP = PP = EP = 1), put back after;
    on CPU through the test shim (which also replaces the model's CUDA-only calls)."""
    if device.type == "cpu":
        from megatron_cpu_schedule import schedule_on_cpu
        from tests.adapters._megatron_cpu import megatron_on_cpu

        with megatron_on_cpu(), schedule_on_cpu():
            yield
        return
    torch.cuda.set_device(device)
    started = not dist.is_initialized()
    if started:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    ps = mc("megatron.core.parallel_state")
    ps.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        ps.destroy_model_parallel()
        if started:
            dist.destroy_process_group()


@contextlib.contextmanager
def stand_in(ep: int, chunks: int) -> Generator[HostLoopback, None, None]:
    """The dispatcher's ``all_to_all`` replaced by the host round trip (module docstring)."""
    td = mc("megatron.core.transformer.moe.token_dispatcher")
    mover = HostLoopback(remote_rows=0, chunks=chunks)
    original = td.all_to_all

    def all_to_all(
        group: object,
        input_: Tensor,
        output_split_sizes_: object = None,
        input_split_sizes: object = None,
        use_nccl_stream: bool = False,
    ) -> Tensor:
        del group, output_split_sizes_, input_split_sizes, use_nccl_stream  # one rank
        mover.remote_rows = input_.shape[0] * (ep - 1) // ep
        return loopback(input_, mover)

    td.all_to_all = all_to_all
    try:
        yield mover
    finally:
        td.all_to_all = original


@contextlib.contextmanager
def keep_dispatch_input(on: bool) -> Generator[None, None, None]:
    """Workaround 2 (``--keep-dispatch-input``): Megatron's dispatch node keeps its input."""
    if not on:
        yield
        return
    node = mc("megatron.core.models.common.utils").TransformerLayerNode
    original = node.__dict__["_resolve_free_input"]

    def resolve(name: str, is_moe: bool, config: object, num_local_experts: object) -> bool:
        if name == "moe_dispatch":
            return False
        return bool(original.__func__(name, is_moe, config, num_local_experts))

    node._resolve_free_input = staticmethod(resolve)
    try:
        yield
    finally:
        node._resolve_free_input = original


def build(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> nn.Module:
    tc = mc("megatron.core.transformer.transformer_config")
    specs = mc("megatron.core.models.gpt.gpt_layer_specs")
    config = tc.TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        ffn_hidden_size=args.ffn,
        num_moe_experts=args.experts,
        moe_router_topk=args.topk,
        moe_ffn_hidden_size=args.ffn,
        moe_token_dispatcher_type="alltoall",
        moe_aux_loss_coeff=0.0,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=device.type == "cpu",
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
    )
    torch.manual_seed(0)  # pyright: ignore[reportUnknownMemberType] - unannotated
    if device.type == "cuda":
        mc("megatron.core.tensor_parallel.random").model_parallel_cuda_manual_seed(0)
    model: nn.Module = mc("megatron.core.models.gpt.gpt_model").GPTModel(
        config=config,
        transformer_layer_spec=specs.get_gpt_layer_local_spec(
            num_experts=args.experts, moe_grouped_gemm=False
        ),
        vocab_size=args.vocab,
        max_sequence_length=args.seq,
        position_embedding_type="rope",
    )
    # Every floating tensor in the dtype, as Megatron's Float16Module casts a bf16 model.
    return model.to(device=device, dtype=dtype)


def microbatches(args: argparse.Namespace, device: torch.device) -> list[Microbatch]:
    g = torch.Generator().manual_seed(1)
    s = args.seq
    causal = torch.ones(s, s, dtype=torch.bool, device=device).triu(1).expand(1, 1, s, s)
    positions = torch.arange(s, device=device).expand(1, s).contiguous()
    out: list[Microbatch] = []
    for _ in range(args.microbatches):
        ids = torch.randint(0, args.vocab, (1, s + 1), generator=g).to(device)
        out.append(
            Microbatch(
                input_ids=ids[:, :-1].contiguous(),
                labels=ids[:, 1:].contiguous(),
                position_ids=positions,
                attention_mask=causal,
            )
        )
    return out


# --- the steps --------------------------------------------------------------------------------
class Bench:
    """The model, the adapter on it, the microbatches, the streams and the stand-in."""

    def __init__(
        self,
        args: argparse.Namespace,
        device: torch.device,
        dtype: torch.dtype,
        mover: HostLoopback,
    ) -> None:
        from moe_overlap.adapters.megatron import MegatronMoEAdapter, masked_mean

        self.args, self.device, self.mover = args, device, mover
        self.model = build(args, device, dtype)
        self.mbs = microbatches(args, device)
        n = len(self.mbs)
        self.masked_mean = masked_mean
        # Built before Megatron's first step: the self-check copies the layers.
        self.adapter = MegatronMoEAdapter(
            self.model, loss_fn=lambda per_token, mask: masked_mean(per_token, mask) / n
        )
        self.pair = make_streams(device)
        self.serial_pair = StreamPair(comp=self.pair.comp, comm=self.pair.comp)
        self.searched: ScheduleOptions | None = None

    @property
    def warmup(self) -> int:
        """Untimed rounds before the timed ones."""
        return int(self.args.warmup)

    @property
    def iters(self) -> int:
        """Timed rounds."""
        return int(self.args.iters)

    def megatron(self, combined: bool) -> list[Tensor]:
        """One step through ``forward_backward_no_pipelining``; the per-microbatch losses
        divided by the number of microbatches, as Megatron scales them for backward."""
        model, mbs, mean = self.model, self.mbs, self.masked_mean
        cfg: Any = cast(Any, model).config

        def forward_step(
            data: Iterator[Microbatch], m: Any, return_schedule_plan: bool = False
        ) -> tuple[object, Callable[[Tensor], tuple[Tensor, dict[str, Tensor]]]]:
            mb = next(data)
            call = m.build_schedule_plan if return_schedule_plan else m
            out = call(mb.input_ids, mb.position_ids, mb.attention_mask, labels=mb.labels)

            def loss_func(per_token: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
                loss = mean(per_token, mb.loss_mask)
                return loss, {"loss": loss.detach().clone()}

            return out, loss_func

        cfg.overlap_moe_expert_parallel_comm = combined  # workaround 1
        try:
            with keep_dispatch_input(combined and self.args.keep_dispatch_input):
                store = mc(
                    "megatron.core.pipeline_parallel.schedules"
                ).forward_backward_no_pipelining(
                    forward_step_func=forward_step,
                    data_iterator=iter(mbs),
                    model=model,
                    num_microbatches=len(mbs),
                    seq_length=self.args.seq,
                    micro_batch_size=1,
                )
        finally:
            cfg.overlap_moe_expert_parallel_comm = False
        return [cast(Tensor, d["loss"]) / len(mbs) for d in store]

    def ours(
        self,
        *,
        overlap: bool,
        fill_drain: bool = False,
        options: ScheduleOptions | None = None,
        on_plan: NodeRecorder | None = None,
    ) -> list[Tensor]:
        return combined_1f1b(
            self.adapter,
            self.mbs,
            overlap=overlap,
            fill_drain=fill_drain,
            streams=self.pair if overlap else self.serial_pair,
            options=options or self.adapter.schedule_options(free_input=True),
            on_plan=on_plan,
        )

    def compute_only(self) -> list[Tensor]:
        self.mover.mode = LoopbackMode.DEVICE
        try:
            return self.ours(overlap=False)
        finally:
            self.mover.mode = LoopbackMode.HOST

    def comm_only(self) -> None:
        """The stand-in calls of one step (dispatch and combine, forward and backward, of
        every layer and microbatch: the tokens; the probs are small) on the comm stream."""
        a = self.args
        rows = a.seq * a.topk
        x = torch.randn(rows, a.hidden, device=self.device).to(next(self.model.parameters()).dtype)
        self.mover.remote_rows = rows * (a.ep - 1) // a.ep
        calls = 4 * len(self.mbs) * a.layers
        comp, comm = self.pair.comp, self.pair.comm
        if isinstance(comp, torch.cuda.Stream) and isinstance(comm, torch.cuda.Stream):
            comm.wait_stream(comp)
            with torch.cuda.stream(comm):
                for _ in range(calls):
                    self.mover(x)
            comp.wait_stream(comm)
        else:
            for _ in range(calls):
                self.mover(x)

    def search(self) -> JsonDict:
        """The node order ``search_order`` finds from a serial step's node durations."""
        for _ in range(2):
            self.ours(overlap=False)
        rec = NodeRecorder(self.device)
        self.model.zero_grad(set_to_none=False)
        sync(self.device)
        rec.start()
        self.ours(overlap=False, on_plan=rec)
        sync(self.device)
        shape = next(iter(rec.shapes.values()))
        found = search_order(shape, slot_durations(rec.durations()))
        self.searched = ScheduleOptions(free_input=True, order=found.order)
        return {
            "order": str(found.order),
            "run_ms_megatron_order": {k.value: v for k, v in found.megatron_ms.items()},
            "run_ms_found": {k.value: v for k, v in found.found_ms.items()},
        }

    def variants(self) -> dict[str, Callable[[], object]]:
        out: dict[str, Callable[[], object]] = {
            "megatron_plain": lambda: self.megatron(False),
            "megatron_combined": lambda: self.megatron(True),
            "serial": lambda: self.ours(overlap=False),
            "overlapped": lambda: self.ours(overlap=True),
            "fill_drain": lambda: self.ours(overlap=True, fill_drain=True),
        }
        for name, slots in RECOMPUTE.items():
            out[name] = functools.partial(
                self.ours,
                overlap=True,
                fill_drain=True,
                options=ScheduleOptions(free_input=True, recompute=slots),
            )
        if self.searched is not None:
            searched = self.searched
            out["fill_drain_searched"] = lambda: self.ours(
                overlap=True, fill_drain=True, options=searched
            )
        out["compute_only"] = self.compute_only
        out["comm_only"] = self.comm_only
        return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def snapshot(model: nn.Module, losses: list[Tensor]) -> Run:
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return [x.detach().clone() for x in losses], grads


# --- exactness --------------------------------------------------------------------------------
def merge(runs: list[JsonDict]) -> JsonDict:
    """One row from several runs' :func:`compare` results: bit-identical only if every run
    was; the worst difference; how many runs differed, and which."""
    bad = [i for i, r in enumerate(runs) if not r["bit_identical"]]
    first = runs[bad[0]] if bad else runs[0]
    return {
        **first,
        "bit_identical": not bad,
        "losses_equal": all(r["losses_equal"] for r in runs),
        "tensors_differing": max(r["tensors_differing"] for r in runs),
        "max_abs_diff": max(r["max_abs_diff"] for r in runs),
        "not_finite": any(r["not_finite"] for r in runs),
        "runs": len(runs),
        "runs_not_bit_identical": len(bad),
        "bad_runs": bad[:8],
    }


def exactness(b: Bench, perturb: str | None) -> JsonDict:
    """Every variant that computes gradients against a ``megatron_plain`` step (module doc),
    ``--exact-runs`` times; with ``--shake``, every other run queues seeded random delays on
    the library's streams at node boundaries (:func:`moe_overlap.streams.shake`: Megatron's
    own schedule is not shaken)."""
    fns = b.variants()
    names = [k for k in fns if k not in ("compute_only", "comm_only")]
    runs_n = max(1, int(b.args.exact_runs))

    def run(name: str) -> Run:
        b.model.zero_grad(set_to_none=True)
        out = fns[name]()
        sync(b.device)
        return snapshot(b.model, cast("list[Tensor]", out))

    per_run: dict[str, list[JsonDict]] = {}
    with deterministic_kernels(b.device, "sdpa") as kernels:
        want = run("megatron_plain")
        library = [n for n in names if n in LIBRARY]
        for r in range(runs_n):
            shaken = bool(b.args.shake) and r % 2 == 1
            with shake(r, max_us=b.args.max_delay_us) if shaken else contextlib.nullcontext():
                per_run.setdefault("megatron_plain (run to run)", []).append(
                    compare(run("megatron_plain"), want)
                )
                for name in names[1:]:
                    got = run(name)
                    if r == 0 and (
                        perturb == name or (perturb == "1" and library and name == library[0])
                    ):
                        add_ulp(next(iter(got[1].values())))
                    per_run.setdefault(name, []).append(compare(got, want))
                    del got
            if runs_n > 1:
                log(
                    f"[exact] run {r + 1}/{runs_n}{' (shaken)' if shaken else ''}: "
                    + ", ".join(
                        f"{k} {'ok' if v[-1]['bit_identical'] else 'DIFFERS'}"
                        for k, v in per_run.items()
                    )
                )
    b.model.zero_grad(set_to_none=True)
    rows = {name: merge(rs) for name, rs in per_run.items()}
    required = [k for k in rows if k != "megatron_combined"]
    for name, row in rows.items():
        log(
            f"[exact] {name:28s} vs megatron_plain: bit_identical={row['bit_identical']!s:5s} "
            f"runs_differing={row['runs_not_bit_identical']}/{row['runs']} "
            f"differing={row['tensors_differing']}/{row['tensors']} "
            f"max_abs={row['max_abs_diff']:.3g}"
        )
    return {
        "kernels": kernels,
        "reference": "megatron_plain",
        "runs": runs_n,
        "shaken_runs": runs_n // 2 if b.args.shake else 0,
        "max_delay_us": b.args.max_delay_us if b.args.shake else 0.0,
        "perturbed": perturb,
        "rows": rows,
        "required_bit_identical": required,
        "failed": [k for k in required if not rows[k]["bit_identical"]],
    }


# --- timing, memory, host time ----------------------------------------------------------------
def _log_round(r: int, out: dict[str, list[float]]) -> None:
    log(f"[time] round {r}: " + ", ".join(f"{k} {xs[-1]:.1f}" for k, xs in out.items()))


def peak_memory(b: Bench, fns: dict[str, Callable[[], object]]) -> JsonDict:
    """Peak memory of one step of each variant (after one warm step), and above its start
    (CUDA only); on every device, the peak of the activations autograd saves for backward
    in one step (``tests/saved_bytes.py``: what recomputation and the schedule change)."""
    from tests.saved_bytes import peak_saved_bytes

    out: JsonDict = {}
    for name, fn in fns.items():
        if name == "comm_only":
            continue
        fn()
        b.model.zero_grad(set_to_none=False)
        sync(b.device)
        try:
            entry: JsonDict = {"saved_peak_MB": peak_saved_bytes(fn) / 1e6}
        except AssertionError as exc:  # saved tensors alive after the step: report, go on
            entry = {"saved_peak_MB": math.nan, "saved_note": str(exc)}
            log(f"[memory] {name}: {exc}")
        b.model.zero_grad(set_to_none=False)
        if b.device.type == "cuda":
            sync(b.device)
            torch.cuda.reset_peak_memory_stats(b.device)
            base = torch.cuda.memory_allocated(b.device)
            fn()
            sync(b.device)
            peak = torch.cuda.max_memory_allocated(b.device)
            entry |= {"peak_GB": peak / 1e9, "above_start_GB": (peak - base) / 1e9}
        out[name] = entry
    return out


def host_time(b: Bench, name: str, owner: type[Any], fn: Callable[[], object]) -> JsonDict:
    """Host ms of each paired (forward + backward) chunk run of ``fn``'s steps, per layer,
    and the GPU ms of the same runs: ``owner.run`` timed (a staticmethod, put back after)."""
    original = owner.__dict__["run"]
    run_fn: Callable[..., Any] = original.__func__
    records: list[tuple[bool, float, Any, Any]] = []
    clock = Clock(b.device)

    def timed(*args: Any, **kwargs: Any) -> Any:
        ev0 = clock.mark()
        t0 = time.perf_counter()
        result = run_fn(*args, **kwargs)
        dt = time.perf_counter() - t0
        records.append((args[0] is not None and args[1] is not None, dt, ev0, clock.mark()))
        return result

    layers = b.args.layers
    host: list[float] = []
    gpu: list[float] = []
    owner.run = staticmethod(timed)
    try:
        for _ in range(max(1, b.args.iters)):
            records.clear()
            b.model.zero_grad(set_to_none=False)
            sync(b.device)
            fn()
            sync(b.device)
            paired = [(dt, Clock.ms(s, e)) for both, dt, s, e in records if both]
            host.append(statistics.median(dt for dt, _ in paired) * 1e3 / layers)
            gpu.append(statistics.median(g for _, g in paired) / layers)
    finally:
        owner.run = original
    return {
        "variant": name,
        "host_ms_per_layer_pair": statistics.median(host),
        "gpu_ms_per_layer_pair": statistics.median(gpu),
        "host_spread": spread(host),
        "samples_host_ms": host,
        "samples_gpu_ms": gpu,
    }


def timing(b: Bench) -> JsonDict:
    fns = b.variants()
    t = time_interleaved(b, fns, _log_round)
    rows: JsonDict = {
        name: {
            "median_ms": statistics.median(xs),
            "min_ms": min(xs),
            "max_ms": max(xs),
            "spread": spread(xs),
            "samples_ms": xs,
        }
        for name, xs in t.items()
    }
    mega = rows["megatron_combined"]["median_ms"]
    bound = max(rows["compute_only"]["median_ms"], rows["comm_only"]["median_ms"])
    for name in ("megatron_plain", "megatron_combined", *LIBRARY):
        if name in rows:
            rows[name]["speedup_vs_megatron_combined"] = mega / rows[name]["median_ms"]
            rows[name]["over_max_compute_comm"] = rows[name]["median_ms"] / bound
    plan_cls = mc("megatron.core.models.common.model_chunk_schedule_plan")
    return {
        "rows": rows,
        "peak_memory": peak_memory(b, fns),
        "host_time": {
            "megatron_combined": host_time(
                b,
                "megatron_combined",
                plan_cls.TransformerModelChunkSchedulePlan,
                fns["megatron_combined"],
            ),
            "overlapped": host_time(b, "overlapped", ModelChunkSchedulePlan, fns["overlapped"]),
        },
    }


# --- report -----------------------------------------------------------------------------------
def markdown(result: JsonDict) -> str:
    lines = [
        "# Megatron-Core's combined 1F1B beside moe_overlap's (one GPU, host-loopback all-to-all)",
        "",
        f"{result['device']}, torch {result['torch']}, megatron-core {result['megatron_core']}, "
        f"{result['dtype']}; {result['model']}",
        "",
    ]
    exact = result.get("exactness")
    if exact is not None:
        lines += [
            f"Exactness ({exact['kernels']}), against `megatron_plain`, "
            f"{exact.get('runs', 1)} run(s) per variant, {exact.get('shaken_runs', 0)} of them "
            "with the library's streams shaken:",
            "",
            "| variant | bit-identical | runs differing | gradients differing | max abs diff |",
            "|---|---|---|---|---|",
        ]
        for name, r in exact["rows"].items():
            lines.append(
                f"| {name} | {'yes' if r['bit_identical'] else 'no'} | "
                f"{r.get('runs_not_bit_identical', int(not r['bit_identical']))}"
                f"/{r.get('runs', 1)} | "
                f"{r['tensors_differing']}/{r['tensors']} | {r['max_abs_diff']:.3g} |"
            )
        lines.append("")
    tm = result.get("timing")
    if tm is not None:
        mem: JsonDict = tm["peak_memory"]
        lines += [
            "| variant | step ms (median) | spread | vs megatron_combined | peak GB "
            "| saved activations peak MB |",
            "|---|---|---|---|---|---|",
        ]
        for name, r in tm["rows"].items():
            entry = cast(JsonDict, mem.get(name, {}))
            peak = float(entry.get("peak_GB", math.nan))
            saved = float(entry.get("saved_peak_MB", math.nan))
            speed = r.get("speedup_vs_megatron_combined")
            lines.append(
                f"| {name} | {r['median_ms']:.1f} | {r['spread']:.3f} | "
                f"{'' if speed is None else f'{speed:.3f}x'} | {peak:.2f} | {saved:.3f} |"
            )
        lines += [
            "",
            "| host time | host ms per layer pair | GPU ms per layer pair |",
            "|---|---|---|",
        ]
        for name, h in tm["host_time"].items():
            lines.append(
                f"| {name} | {h['host_ms_per_layer_pair']:.3f} | {h['gpu_ms_per_layer_pair']:.3f} |"
            )
        lines.append("")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="CPU smoke sizes")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on CUDA")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--ffn", type=int, default=2048, help="expert FFN size")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096, help="tokens per microbatch")
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--ep", type=int, default=8, help="emulated EP size: (ep-1)/ep rows move")
    p.add_argument("--chunks", type=int, default=4, help="stand-in transfer pieces")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--keep-dispatch-input", action="store_true", help="workaround 2 (doc)")
    p.add_argument("--no-search", action="store_true", help="leave out fill_drain_searched")
    p.add_argument("--skip-exact", action="store_true")
    p.add_argument("--skip-timing", action="store_true")
    p.add_argument("--continue-after-inexact", action="store_true")
    p.add_argument(
        "--exact-runs", type=int, default=1, help="repeat the exactness pass's steps N times"
    )
    p.add_argument(
        "--shake", action="store_true", help="shake the library's streams every other run"
    )
    p.add_argument("--max-delay-us", type=float, default=3000.0, help="shaking's longest delay")
    args = p.parse_args()
    if args.tiny:
        for k, v in dict(
            layers=2, hidden=64, heads=4, ffn=32, experts=4, topk=4, seq=16, vocab=128, ep=4
        ).items():
            setattr(args, k, v)
        args.warmup, args.iters = 1, 2
    perturb = perturb_target(LIBRARY)
    warnings.filterwarnings("ignore", module="megatron")
    t_start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    if device.type == "cuda" and ":" not in args.device:  # torch.cuda.set_device needs an index
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[
        args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    ]
    result: JsonDict = {
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "command": " ".join(sys.argv),
        "torch": torch.__version__,
        "megatron_core": str(mc("megatron.core.package_info").__version__),
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype),
        "model": (
            f"GPTModel, {args.layers} MoE layers, hidden {args.hidden}, {args.heads} heads, "
            f"{args.experts} experts top-{args.topk} of FFN {args.ffn}, vocab {args.vocab}, "
            f"{args.microbatches} microbatches x {args.seq} tokens; stand-in all-to-all "
            f"(EP {args.ep}, {args.chunks} chunks)"
        ),
        "workarounds": {
            "overlap_flag_set_after_construction": True,
            "keep_dispatch_input": args.keep_dispatch_input,
        },
        "args": {k: str(v) for k, v in vars(args).items()},
    }

    def save() -> None:
        result["wall_s"] = time.perf_counter() - t_start
        (args.out / "megatron.json").write_text(json.dumps(result, indent=1, default=str))
        (args.out / "megatron.md").write_text(markdown(result))
        (args.out / "megatron_log.txt").write_text("\n".join(LOG) + "\n")

    status = 0
    with _parallel_state(device), stand_in(args.ep, args.chunks) as mover:
        b = Bench(args, device, dtype, mover)
        params = sum(x.numel() for x in b.model.parameters())
        result["parameters"] = params
        log(f"{result['device']}, {result['model']}, {params / 1e9:.3f} G parameters, {dtype}")
        if not args.no_search:
            result["search"] = b.search()
            log(f"[search] {result['search']['order']}")
        if not args.skip_exact:
            try:
                exact = exactness(b, perturb)
                result["exactness"] = exact
                for name in cast("list[str]", exact["failed"]):
                    status = 1
                    msg = "bench_megatron_1gpu: EXACTNESS FAILED: " + describe(
                        name, "megatron_plain", exact["rows"][name]
                    )
                    log(msg)
                    print(msg, file=sys.stderr, flush=True)
            except Exception:
                status = 1
                result["exactness_error"] = traceback.format_exc()
                print(
                    "bench_megatron_1gpu: EXACTNESS FAILED: the pass raised:\n"
                    + result["exactness_error"],
                    file=sys.stderr,
                    flush=True,
                )
            save()
            if status and not args.continue_after_inexact:
                print(
                    "bench_megatron_1gpu: stopped: the exactness pass failed, not timed "
                    f"(--continue-after-inexact); wrote {args.out / 'megatron.json'}",
                    file=sys.stderr,
                    flush=True,
                )
                return 1
        if not args.skip_timing:
            result["timing"] = timing(b)
        result["stand_in"] = {"calls": mover.calls, "bytes_moved": mover.bytes_moved}
    save()
    log(markdown(result))
    return status


if __name__ == "__main__":
    sys.exit(main())
