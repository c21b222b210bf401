"""Chunked all-to-alls on CUDA: bit-identical to plain backward, and really overlapped.

Skipped without a GPU (run on the lent H200: ``pytest tests/blocks/test_a2a_chunks_gpu.py``).
The all-to-all is the one-device stand-in (``dispatcher="loopback"``: a round trip of the
rows through pinned host memory on the copy engines), so a copy overlapping a kernel is
visible in a profile.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Callable, Iterator

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from moe_overlap import Microbatch, combined_1f1b, make_streams
from moe_overlap.models import GPTMoEConfig, GPTMoEModel
from tests.models._helpers import GPU_BF16, assert_matches_plain, deterministic_cuda

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture
def _deterministic_cuda() -> Iterator[None]:
    with deterministic_cuda():
        yield


def _batches(n: int, batch: int, seq: int, vocab: int) -> list[Microbatch]:
    g = torch.Generator().manual_seed(0)
    xs = [torch.randint(0, vocab, (batch, seq), generator=g).cuda() for _ in range(n)]
    return [Microbatch(input_ids=x, labels=x.roll(-1, 1)) for x in xs]


@pytest.mark.usefixtures("_deterministic_cuda")
@pytest.mark.parametrize("chunks", [1, 3])
@pytest.mark.parametrize("delay", [False, True])
@pytest.mark.parametrize("fill_drain", [False, True])
def test_cuda_chunked_schedule_bit_identical(chunks: int, delay: bool, fill_drain: bool) -> None:
    """bf16, every layer MoE with a shared expert, loopback all-to-all; 3 chunks of 43, 43
    and 42 tokens. The reference is the same chunked model without delayed wgrad."""
    config = dataclasses.replace(
        GPU_BF16, dispatcher="loopback", moe_a2a_chunks=chunks, delay_wgrad_compute=delay
    )
    scheduled = GPTMoEModel(config, device="cuda")
    plain = GPTMoEModel(dataclasses.replace(config, delay_wgrad_compute=False), device="cuda")
    plain.load_state_dict(scheduled.state_dict())
    mbs = _batches(4, 2, 64, config.vocab_size)
    losses = combined_1f1b(
        scheduled,
        mbs,
        options=scheduled.schedule_options(),
        streams=make_streams("cuda"),
        fill_drain=fill_drain,
    )
    assert_matches_plain(scheduled, plain, mbs, losses)


# --- overlap: the copies of the next/previous chunk run under this chunk's kernels -------
BIG = GPTMoEConfig(
    hidden_size=2048,
    num_layers=1,
    first_k_dense=0,
    num_attention_heads=16,
    num_experts=8,
    moe_ffn_hidden_size=4096,
    moe_router_topk=2,
    dispatcher="loopback",
    attention="sdpa",
    dtype=torch.bfloat16,
)


def _intervals(trace: dict[str, object]) -> tuple[list[tuple[float, float]], ...]:
    """``(copies, kernels)``: the device intervals of host<->device copies and of kernels."""
    copies: list[tuple[float, float]] = []
    kernels: list[tuple[float, float]] = []
    events = trace.get("traceEvents", [])
    assert isinstance(events, list)
    for e in events:
        if not isinstance(e, dict) or "dur" not in e:
            continue
        cat, name = str(e.get("cat", "")), str(e.get("name", ""))
        span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        if cat == "gpu_memcpy" and ("DtoH" in name or "HtoD" in name):
            copies.append(span)
        elif cat == "kernel":
            kernels.append(span)
    return copies, kernels


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Microseconds during which some interval of ``a`` and some of ``b`` both run."""

    def union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
        out: list[tuple[float, float]] = []
        for s, e in sorted(spans):
            if out and s <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], e))
            else:
                out.append((s, e))
        return out

    total = 0.0
    ua, ub = union(a), union(b)
    i = j = 0
    while i < len(ua) and j < len(ub):
        lo, hi = max(ua[i][0], ub[j][0]), min(ua[i][1], ub[j][1])
        total += max(0.0, hi - lo)
        if ua[i][1] < ub[j][1]:
            i += 1
        else:
            j += 1
    return total


def _profiled(fn: Callable[[], object]) -> tuple[list[tuple[float, float]], ...]:
    """``fn()`` under the CUDA profiler: the ``(copies, kernels)`` intervals it ran."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:  # read at once: a later profile clears it
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return _intervals(json.load(f))


def _copy_kernel_overlap(chunks: int) -> dict[str, float]:
    """Plain forward, then backward, of one MoE layer (8192 tokens), each profiled: the
    time copies overlap kernels, and the copies' total time. No schedule runs, so any
    overlap is the chunked dispatcher's own. Sizes large enough that the GPU work of one
    chunk outlasts the host's issuing of the next."""
    model = GPTMoEModel(dataclasses.replace(BIG, moe_a2a_chunks=chunks), device="cuda")
    (mb,) = _batches(1, 4, 2048, BIG.vocab_size)
    assert mb.input_ids is not None
    ids, labels = mb.input_ids, mb.labels
    losses: list[torch.Tensor] = []

    def forward() -> None:
        losses.append(model(ids, labels=labels))

    def backward() -> None:
        torch.autograd.backward(losses.pop())

    out: dict[str, float] = {}
    for _ in range(2):  # the first round warms up (cuBLAS, allocators); the second counts
        phases = {"forward": _profiled(forward), "backward": _profiled(backward)}
        model.zero_grad(set_to_none=True)
        for phase, (copies, kernels) in phases.items():
            # Copy time as wall time with some copy running (concurrent copies share the
            # link, so their summed durations would overstate it).
            out[f"{phase}_copy_us"] = _overlap(copies, copies)
            out[f"{phase}_overlap_us"] = _overlap(copies, kernels)
    return out


def test_cuda_chunks_overlap_copies_with_kernels() -> None:
    """One chunk: no copy ever runs under a kernel (the all-to-all stand-in holds the
    stream). Three chunks: in forward, chunk j+1's transfer and chunk j-1's return run under
    chunk j's expert GEMMs; in backward, autograd runs each op on its forward's stream, so
    copies run under kernels too. How much depends on how far the host issues ahead of the
    GPU (launch latency; on the H200 under gVisor forward 2.4-17 % of the copy time,
    backward 0.2-39 % across runs), so only some overlap (over 10 us) is required in each
    direction: one chunk gives none at all."""
    one = _copy_kernel_overlap(1)
    three = _copy_kernel_overlap(3)
    print(f"chunks=1: {one}\nchunks=3: {three}")
    for phase in ("forward", "backward"):
        assert one[f"{phase}_copy_us"] > 0 and three[f"{phase}_copy_us"] > 0
        assert one[f"{phase}_overlap_us"] <= 0.01 * one[f"{phase}_copy_us"], (phase, one)
    for phase in ("forward", "backward"):  # microseconds: some, not a share
        assert three[f"{phase}_overlap_us"] >= 10.0, (phase, three)
