"""The stream-order checker over every composition that runs in one process.

Each test runs a composition of the library under
:func:`~moe_overlap.streams.stream_order_check` (every tensor access on the CPU streams
checked against the happens-before of their events, and the caching allocator's release
rule), asserts the checker saw the streams interleave (storages used on more than one
stream) and that the result is still exact:

- ``combined_1f1b`` on the reference model: overlapped, fill/drain, recomputation, delayed
  weight gradients, early attention-memory release, the chunked all-to-all and the
  loopback all-to-all, alone and combined; bit-identical to plain per-microbatch
  ``backward()``;
- torch pipelining schedules prepared by ``prepare_schedule`` (DualPipeV, paired
  interleaved 1F1B, ZBV zero bubble), two stages on a one-rank gloo group; bit-identical
  to torch's own execution of the schedule;
- the transformers and torchtitan adapters; bit-identical to the sequential schedule.

The multi-process compositions (PP=2, PP=2 x EP=2, EP=2, FSDP2) run the same checker in
their gloo workers: ``tests/integrations/test_stream_order_pp.py``,
``tests/models/test_stream_order_ep.py``, ``tests/integrations/test_stream_order_fsdp.py``.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    ScheduleDualPipeV,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

from moe_overlap import Microbatch, combined_1f1b
from moe_overlap.integrations.pipelining import prepare_schedule
from moe_overlap.models import GPTMoEConfig, GPTMoEModel, GPTMoEStage, masked_cross_entropy
from moe_overlap.streams import StreamOrderChecker, stream_order_check
from tests.models._helpers import SMALL, assert_matches_plain
from tests.torch_state import num_threads

RECOMPUTE = ("norm", "activation", "attention_core")
EARLY = {"ep_overlap_early_attn_memory_release": True}


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """One intra-op thread (put back after): tiny operators, where more threads only wait
    for each other (and for other processes on a loaded machine)."""
    with num_threads(1):
        yield


@dataclasses.dataclass(frozen=True)
class Composition:
    """A reference-model config change, a schedule-options change and fill/drain."""

    config: dict[str, Any] = dataclasses.field(default_factory=dict[str, Any])
    options: dict[str, Any] = dataclasses.field(default_factory=dict[str, Any])
    fill_drain: bool = False


C1F1B: dict[str, Composition] = {
    "default": Composition(),
    "fill_drain": Composition(fill_drain=True),
    "recompute": Composition({"recompute": RECOMPUTE}),
    "delay_wgrad": Composition({"delay_wgrad_compute": True}),
    "early_release": Composition(options=EARLY),
    "a2a_chunks": Composition({"moe_a2a_chunks": 2}),
    "loopback": Composition({"dispatcher": "loopback"}),
    # combined
    "recompute-delay_wgrad-fill_drain": Composition(
        {"recompute": RECOMPUTE, "delay_wgrad_compute": True}, fill_drain=True
    ),
    "early_release-recompute-delay_wgrad": Composition(
        {"recompute": RECOMPUTE, "delay_wgrad_compute": True}, EARLY
    ),
    "a2a_chunks-delay_wgrad-fill_drain": Composition(
        {"moe_a2a_chunks": 2, "delay_wgrad_compute": True}, fill_drain=True
    ),
    "loopback-a2a_chunks-delay_wgrad": Composition(
        {"dispatcher": "loopback", "moe_a2a_chunks": 2, "delay_wgrad_compute": True}
    ),
    "loopback-early_release-fill_drain": Composition(
        {"dispatcher": "loopback"}, EARLY, fill_drain=True
    ),
}


def _microbatches(n: int, vocab: int, *, batch: int = 2, seq: int = 16) -> list[Microbatch]:
    """Next-token microbatches of ids and labels only (what ``assert_matches_plain`` feeds
    the plain model)."""
    gen = torch.Generator().manual_seed(0)
    out: list[Microbatch] = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
        out.append(Microbatch(input_ids=ids[:, :-1], labels=ids[:, 1:]))
    return out


def _saw_streams_interleave(c: StreamOrderChecker) -> None:
    assert c.checked_ops > 0, "the checker saw no operator"
    assert c.cross_stream_storages > 0, (
        f"the checker saw {c.checked_ops} operators but no storage used on two streams: "
        "the run did not interleave its streams"
    )


# --- combined_1f1b on the reference model ---------------------------------------------------
@pytest.mark.parametrize("name", list(C1F1B))
def test_combined_1f1b_is_stream_ordered(name: str) -> None:
    comp = C1F1B[name]
    config = dataclasses.replace(SMALL, **comp.config)
    scheduled, plain = GPTMoEModel(config), GPTMoEModel(config)
    plain.load_state_dict(scheduled.state_dict())
    mbs = _microbatches(3, config.vocab_size)
    options = dataclasses.replace(scheduled.schedule_options(), **comp.options)
    with stream_order_check() as c:
        losses = combined_1f1b(scheduled, mbs, options=options, fill_drain=comp.fill_drain)
    _saw_streams_interleave(c)
    assert_matches_plain(scheduled, plain, mbs, losses)


# --- prepared torch pipelining schedules, two stages on one rank ----------------------------
# torch 2.11's stage set-up sends a warm-up tensor between the two stages a V-schedule puts on
# one rank; gloo cannot send to its own rank (2.13 skips same-rank neighbours).
V_ON_GLOO = pytest.mark.skipif(
    torch.__version__.startswith("2.11"),
    reason="torch 2.11 V-schedule warm-up sends to the same rank, which gloo refuses",
)
SCHEDULES: dict[str, Any] = {
    "dualpipev": ScheduleDualPipeV,
    "interleaved": ScheduleInterleaved1F1B,
    "zbv": ScheduleZBVZeroBubble,
}
PIPELINE = GPTMoEConfig(
    vocab_size=64,
    num_layers=4,
    first_k_dense=1,
    hidden_size=32,
    ffn_hidden_size=48,
    num_attention_heads=2,
    num_experts=4,
    moe_ffn_hidden_size=16,
    moe_router_topk=2,
)
"""Two stages of two layers: the dense layer and an MoE layer, then two MoE layers."""
PIPELINE_VARIANTS: dict[str, dict[str, Any]] = {
    "delay_wgrad": {"delay_wgrad_compute": True},
    "loopback-a2a_chunks": {"dispatcher": "loopback", "moe_a2a_chunks": 2},
}
MICROBATCHES = 4


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A one-rank gloo group (the stages' process group), destroyed after."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    store = cast(Any, dist).HashStore()  # not in torch.distributed's __all__
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _loss_fn(logits: Tensor, labels: Tensor) -> Tensor:
    return masked_cross_entropy(logits, labels, None)


def _schedule(kind: str, model: GPTMoEModel) -> Any:
    stages = [
        PipelineStage(GPTMoEStage(model, range(2 * i, 2 * i + 2)), i, 2, torch.device("cpu"))
        for i in (0, 1)
    ]
    return SCHEDULES[kind](stages, n_microbatches=MICROBATCHES, loss_fn=_loss_fn)


def _step(schedule: Any, x: Tensor, y: Tensor) -> list[Tensor]:
    losses: list[Tensor] = []
    schedule.step(x, target=y, losses=losses)
    return [loss.detach() for loss in losses]


def _differ(a: nn.Module, b: nn.Module) -> list[str]:
    """The parameters whose gradients are not bit-identical (or present on one side)."""
    out: list[str] = []
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        if p.grad is None or q.grad is None:
            if (p.grad is None) != (q.grad is None):
                out.append(name)
        elif not torch.equal(p.grad, q.grad):
            out.append(name)
    return out


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("variant", list(PIPELINE_VARIANTS))
@pytest.mark.parametrize(
    "kind",
    [
        pytest.param("dualpipev", marks=V_ON_GLOO),
        "interleaved",
        pytest.param("zbv", marks=V_ON_GLOO),
    ],
)
def test_prepared_pipeline_schedule_is_stream_ordered(kind: str, variant: str) -> None:
    config = dataclasses.replace(PIPELINE, **PIPELINE_VARIANTS[variant])
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (2 * MICROBATCHES, 17), generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:]
    # torch's own execution (no delayed weight gradients: torch runs no backward_dw)
    reference = GPTMoEModel(dataclasses.replace(config, delay_wgrad_compute=False))
    want = _step(_schedule(kind, reference), x, y)

    model = GPTMoEModel(config)
    model.load_state_dict(reference.state_dict())
    schedule = _schedule(kind, model)
    overlap = prepare_schedule(schedule, pair=kind != "dualpipev")
    with stream_order_check() as c:
        _step(schedule, x, y)  # torch's shape inference (the plain path)
        model.zero_grad(set_to_none=True)
        got = _step(schedule, x, y)
    _saw_streams_interleave(c)
    if kind != "zbv":  # zero bubble's backward comes in I/W halves: nothing to pair
        assert overlap.paired > 0
    assert len(got) == MICROBATCHES
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), (got, want)
    assert _differ(model, reference) == []


# --- the adapters ----------------------------------------------------------------------------
def _assert_same(got: Sequence[Tensor], want: Sequence[Tensor], a: nn.Module, b: nn.Module) -> None:
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), (got, want)
    assert _differ(a, b) == []


@pytest.mark.parametrize(("family", "delay"), [("mixtral", False), ("qwen2_moe", True)])
def test_transformers_adapter_is_stream_ordered(family: str, delay: bool) -> None:
    """Mixtral (two MoE layers); Qwen2-MoE (a dense layer, shared experts) with delayed
    weight gradients: the overlapped schedule against the sequential one."""
    pytest.importorskip("transformers")
    from moe_overlap.adapters.transformers import TransformersMoEAdapter
    from tests.adapters._hf import FAMILIES, microbatches

    model = FAMILIES[family]()
    mbs = microbatches(3)
    sequential = TransformersMoEAdapter(copy.deepcopy(model), delay_wgrad_compute=delay)
    overlapped = TransformersMoEAdapter(copy.deepcopy(model), delay_wgrad_compute=delay)
    want = combined_1f1b(sequential, mbs, overlap=False, options=sequential.schedule_options())
    with stream_order_check() as c:
        got = combined_1f1b(overlapped, mbs, options=overlapped.schedule_options())
    _saw_streams_interleave(c)
    assert overlapped.pending_wgrad == 0
    _assert_same(got, want, overlapped.model, sequential.model)


@pytest.mark.filterwarnings(
    # torchtitan's MoE enters a float32 CPU autocast, which torch disables with a warning.
    "ignore:In CPU autocast, but the target dtype is not supported:UserWarning"
)
@pytest.mark.parametrize("delay", [False, True], ids=["wgrad", "delayed_wgrad"])
def test_torchtitan_adapter_is_stream_ordered(delay: bool) -> None:
    """torchtitan's Qwen3 MoE (its debug flavour, cut to three layers and eight experts,
    the test's causal attention stand-in): the overlapped schedule against the sequential
    one."""
    pytest.importorskip("torchtitan")
    from moe_overlap.adapters.torchtitan import TorchtitanMoEAdapter
    from tests.adapters._titan import batch, build, causal_stand_in

    model = causal_stand_in(build("qwen3"))
    mbs = [
        Microbatch(input_ids=b["input_ids"], labels=b["labels"], position_ids=b["position_ids"])
        for b in batch(model, 3)
    ]
    sequential = TorchtitanMoEAdapter(
        copy.deepcopy(model), delay_wgrad_compute=delay, self_check=False
    )
    overlapped = TorchtitanMoEAdapter(
        copy.deepcopy(model), delay_wgrad_compute=delay, self_check=False
    )
    want = combined_1f1b(sequential, mbs, overlap=False, options=sequential.schedule_options())
    with stream_order_check() as c:
        got = combined_1f1b(overlapped, mbs, options=overlapped.schedule_options())
    _saw_streams_interleave(c)
    assert overlapped.pending_wgrad == 0
    _assert_same(got, want, overlapped.model, sequential.model)
