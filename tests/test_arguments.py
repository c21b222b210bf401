"""Every public entry point checks its arguments: a property-based test.

A table lists each public constructor and function with, for each argument, a valid
example and a strategy of wrong values (wrong types and out-of-range values). Hypothesis
feeds each wrong value in turn, the other arguments valid; the call must raise the
library's own error (a :class:`moe_overlap.MoeOverlapError`) naming the argument, never a
bare Python or torch error and never accept it. The all-valid call must be accepted.

The rule for numbers (docs/errors.md, "Argument validation"): a Python ``int`` or any
``numbers.Integral`` (NumPy integers) is an int; a ``bool`` is not (``True`` experts), nor
a tensor. A real is any ``numbers.Real`` but a ``bool``, finite unless stated.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import numbers
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.fsdp import FSDPModule

import moe_overlap as mo
from moe_overlap import (
    ChunkState,
    CudaGraphModule,
    Microbatch,
    MoeOverlapError,
    ScheduleOptions,
    StreamPair,
    combined_1f1b,
    make_event,
    make_streams,
)
from moe_overlap import blocks as b
from moe_overlap.integrations import checkpoint as ckpt
from moe_overlap.integrations import fsdp, pipelining
from moe_overlap.megatron import layer_args
from moe_overlap.models import (
    Decoder,
    DenseLayer,
    GPTMoEConfig,
    GPTMoEModel,
    GPTMoEStage,
    MoELayer,
    masked_cross_entropy,
)
from moe_overlap.steps import ChunkHooks, Step
from moe_overlap.streams import CpuEvent, CpuStream, shake
from moe_overlap.timeline import Timeline
from moe_overlap.wgrad import check_wgrad_done, owed_wgrad

from .debug_mode import refusal
from .engine.toy_model import ToyConfig, ToyModel, make_microbatches

# --- wrong values ---------------------------------------------------------------------------

JUNK: st.SearchStrategy[object] = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.binary(max_size=2),
    st.lists(st.integers(0, 2), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(0, 2), max_size=1),
    st.complex_numbers(max_magnitude=2),
    st.sampled_from([object(), np.bool_(True), np.int64(-1), np.float32("nan"), int]),
    st.builds(lambda: torch.ones(2)),
    st.builds(lambda: torch.tensor(1)),
)
"""Values of every kind; each strategy below keeps the wrong ones for its argument."""


def _int_like(v: object) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _real_like(v: object) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def not_bool() -> st.SearchStrategy[object]:
    return JUNK.filter(lambda v: not isinstance(v, bool))


def not_int(lo: int, hi: int | None = None, *, optional: bool = False) -> st.SearchStrategy[object]:
    """Anything but an int in ``[lo, hi]`` (and ``None`` when ``optional``)."""

    def wrong(v: object) -> bool:
        if v is None:
            return not optional
        if not _int_like(v):
            return True
        n = int(cast(Any, v))
        return n < lo or (hi is not None and n > hi)

    extra = [st.integers(max_value=lo - 1)]
    if hi is not None:
        extra.append(st.integers(hi + 1, hi + 100))
    return st.one_of(JUNK, *extra).filter(wrong)


def not_real(*, lo: float | None = None, above: float | None = None) -> st.SearchStrategy[object]:
    """Anything but a finite real ``>= lo`` / ``> above``."""

    def wrong(v: object) -> bool:
        if not _real_like(v):
            return True
        x = float(cast(Any, v))
        if x != x or x in (float("inf"), float("-inf")):
            return True
        return (lo is not None and x < lo) or (above is not None and x <= above)

    bad_range = st.floats(max_value=(lo if lo is not None else above or 0.0) - 1e-3)
    return st.one_of(JUNK, bad_range).filter(wrong)


def not_choice(choices: Sequence[object], *, optional: bool = False) -> st.SearchStrategy[object]:
    def wrong(v: object) -> bool:
        if v is None:
            return not optional
        return not any(type(v) is type(c) and v == c for c in choices)

    return st.one_of(JUNK, st.text(max_size=8), st.sampled_from(["all2all", "SOFTMAX", ""])).filter(
        wrong
    )


def not_instance(
    kind: type | tuple[type, ...], *, optional: bool = False
) -> st.SearchStrategy[object]:
    return JUNK.filter(
        lambda v: (v is None and not optional) or (v is not None and not isinstance(v, kind))
    )


def not_callable(*, optional: bool = False) -> st.SearchStrategy[object]:
    return JUNK.filter(
        lambda v: (v is None and not optional) or (v is not None and not callable(v))
    )


def not_float_dtype() -> st.SearchStrategy[object]:
    return st.one_of(JUNK, st.sampled_from([torch.int64, torch.bool, torch.int32, "float32"]))


WRONG_DEVICES = [
    "gpu",
    "cuda:99",
    "",
    "cpu:x",
    "nonsense",
    *([] if torch.cuda.is_available() else ["cuda"]),
]


def not_device(*, optional: bool = True) -> st.SearchStrategy[object]:
    strings = st.sampled_from(WRONG_DEVICES)
    others = JUNK.filter(
        lambda v: not isinstance(v, (str, torch.device)) and (v is not None or not optional)
    )
    return st.one_of(strings, others)


def not_group() -> st.SearchStrategy[object]:
    return JUNK.filter(lambda v: v is not None)


def not_module() -> st.SearchStrategy[object]:
    return JUNK


def not_tensor(*, optional: bool = False) -> st.SearchStrategy[object]:
    return not_instance(torch.Tensor, optional=optional)


def not_modules() -> st.SearchStrategy[object]:
    """Not a collection of modules: junk, or a list holding a non-module."""
    return st.one_of(
        JUNK.filter(lambda v: not isinstance(v, (list, tuple)) or len(v) > 0),
        st.builds(lambda: [nn.Linear(2, 2), "layer"]),
    )


# --- the table ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Arg:
    name: str
    wrong: st.SearchStrategy[object]
    named: str | None = None
    """What the message must contain (the argument's name unless given)."""


@dataclass(frozen=True)
class Entry:
    name: str
    call: Callable[..., object]
    valid: Callable[[], dict[str, Any]]
    """Fresh valid arguments for each call (modules and tensors are not shared)."""
    args: tuple[Arg, ...]
    valid_runs: bool = True
    """Whether the all-valid call can run in this process (False: it needs peer ranks)."""


TINY: dict[str, Any] = dict(
    vocab_size=16,
    hidden_size=8,
    num_layers=2,
    first_k_dense=1,
    num_attention_heads=2,
    ffn_hidden_size=8,
    num_experts=4,
    moe_ffn_hidden_size=8,
    moe_router_topk=2,
)


def tiny_config(**changes: Any) -> GPTMoEConfig:
    return GPTMoEConfig(**(TINY | changes))


def tiny_model() -> GPTMoEModel:
    return GPTMoEModel(tiny_config())


def _f32() -> dict[str, Any]:
    return {"dtype": torch.float32, "device": None}


DTYPE_DEVICE = (Arg("dtype", not_float_dtype()), Arg("device", not_device()))


def _router() -> dict[str, Any]:
    return dict(
        hidden=8,
        num_experts=4,
        topk=2,
        aux_loss_coeff=0.0,
        score="softmax",
        num_groups=1,
        topk_groups=1,
        normalize=False,
        scaling=1.0,
        **_f32(),
    )


def _stage_schedule() -> Any:
    from .integrations.test_prepare_checks import _schedule, _stages

    return _schedule(*_stages())


def _hf() -> Any:
    from .adapters import _hf

    return _hf


@functools.cache
def _adapter() -> Any:
    """One adapter for every call (a stage refuses its arguments before reading it)."""
    from moe_overlap.adapters.transformers import TransformersMoEAdapter

    return TransformersMoEAdapter(_hf().mixtral(), self_check=False)


def bad(value: object) -> Any:
    """A value the types forbid, passed on purpose: the misuse under test."""
    return value


def _mask_args(mask: torch.Tensor) -> dict[str, Any]:
    return dict(mask=mask, batch=2, seq=4, where="here")


def _input_args(n: int) -> dict[str, Any]:
    return dict(inputs=tuple(torch.ones(1) for _ in range(n)), where="here")


def _schedule_run(**kwargs: Any) -> object:
    model = ToyModel(ToyConfig(), "dm")
    return combined_1f1b(model, make_microbatches(2, ToyConfig()), **kwargs)


def _set_streams(**kwargs: Any) -> object:
    try:
        return mo.set_streams(**kwargs)
    finally:
        from moe_overlap.streams import reset_streams

        reset_streams()


CONFIG_WRONG: dict[str, st.SearchStrategy[object]] = {
    "vocab_size": not_int(1),
    "hidden_size": st.one_of(not_int(1), st.sampled_from([7, 9, 6])),  # not heads * even
    "num_layers": not_int(0),
    "first_k_dense": st.one_of(not_int(0), st.integers(3, 9)),  # above num_layers=2
    "num_attention_heads": not_int(1),
    "ffn_hidden_size": not_int(1),
    "num_experts": not_int(1),
    "moe_ffn_hidden_size": not_int(1),
    "moe_router_topk": st.one_of(not_int(1), st.integers(5, 40)),  # above num_experts=4
    "moe_shared_expert_hidden_size": not_int(1, optional=True),
    "moe_aux_loss_coeff": not_real(lo=0.0),
    "dispatcher": not_choice(["alltoall", "loopback"]),
    "attention": not_choice(["math", "sdpa"]),
    "rotary_base": not_real(above=0.0),
    "norm_eps": not_real(above=0.0),
    "init_std": not_real(lo=0.0),
    "seed": not_int(-(2**63), 2**64 - 1),
    "dtype": st.one_of(not_float_dtype(), st.just(torch.float16)),
    "delay_wgrad_compute": not_bool(),
    "moe_a2a_chunks": not_int(1),
    "recompute": st.one_of(
        st.sampled_from(["norm", ("norms",), 5, None, [1], torch.ones(2)]),
        st.text(min_size=1, max_size=3),
    ),
    "moe_token_dispatcher_type": not_choice(["alltoall"]),
    "moe_flex_dispatcher_backend": JUNK.filter(lambda v: v is not None),
    "fp8": JUNK.filter(lambda v: v is not None),
    "fp4": JUNK.filter(lambda v: v is not None),
    "cuda_graph_modules": st.sampled_from(
        ["attn", ("attn",), (CudaGraphModule.moe,), 5, None, [object()], (CudaGraphModule.mamba,)]
    ),
    "mtp_num_layers": JUNK.filter(lambda v: v is not None),
}


def _entries() -> Iterator[Entry]:
    # ----- moe_overlap.blocks
    yield Entry(
        "TopKRouter",
        b.TopKRouter,
        _router,
        (
            Arg("hidden", not_int(1)),
            Arg("num_experts", not_int(1)),
            Arg("topk", not_int(1, 4)),  # above the 4 experts: refused
            Arg("aux_loss_coeff", not_real(lo=0.0)),
            Arg("score", not_choice(["softmax", "sigmoid"])),
            Arg("num_groups", st.one_of(not_int(1), st.just(3))),  # 3 does not divide 4
            Arg("topk_groups", not_int(1)),
            Arg("normalize", not_bool()),
            Arg("scaling", not_real(above=0.0)),
            *DTYPE_DEVICE,
        ),
    )
    yield Entry(
        "TokenDispatcher",
        b.TokenDispatcher,
        lambda: dict(
            num_experts=4, topk=2, kind="alltoall", group=None, count_group=None, chunks=2
        ),
        (
            Arg("num_experts", not_int(1)),
            Arg("topk", not_int(1, 4)),
            Arg("kind", not_choice(["alltoall", "loopback"])),
            Arg("group", not_group()),
            Arg("count_group", not_group()),
            Arg("chunks", not_int(1)),
        ),
    )
    yield Entry(
        "GroupedExperts",
        b.GroupedExperts,
        lambda: dict(
            local_experts=2,
            hidden=8,
            ffn=8,
            expert_offset=0,
            delay_wgrad=False,
            recompute_activation=False,
            calls_per_backward=2,
            **_f32(),
        ),
        (
            Arg("local_experts", not_int(1)),
            Arg("hidden", not_int(1)),
            Arg("ffn", not_int(1)),
            Arg("expert_offset", not_int(0)),
            Arg("delay_wgrad", not_bool()),
            Arg("recompute_activation", not_bool()),
            Arg("calls_per_backward", not_int(1)),
            *DTYPE_DEVICE,
        ),
    )
    yield Entry(
        "RMSNorm",
        b.RMSNorm,
        lambda: dict(dim=8, eps=1e-5, recompute=False, **_f32()),
        (
            Arg("dim", not_int(1)),
            Arg("eps", not_real(above=0.0)),
            Arg("recompute", not_bool()),
            *DTYPE_DEVICE,
        ),
    )
    yield Entry(
        "SelfAttention",
        b.SelfAttention,
        lambda: dict(
            hidden=8, heads=2, impl="math", delay_wgrad=False, recompute_core=False, **_f32()
        ),
        (
            Arg("hidden", st.one_of(not_int(1), st.sampled_from([7, 6, 9]))),
            Arg("heads", st.one_of(not_int(1), st.sampled_from([3, 5, 8]))),
            Arg("impl", not_choice(["math", "sdpa"])),
            Arg("delay_wgrad", not_bool()),
            Arg("recompute_core", not_bool()),
            *DTYPE_DEVICE,
        ),
    )
    yield Entry(
        "SwiGLUMLP",
        b.SwiGLUMLP,
        lambda: dict(hidden=8, ffn=8, delay_wgrad=False, recompute_activation=False, **_f32()),
        (
            Arg("hidden", not_int(1)),
            Arg("ffn", not_int(1)),
            Arg("delay_wgrad", not_bool()),
            Arg("recompute_activation", not_bool()),
            *DTYPE_DEVICE,
        ),
    )
    yield Entry(
        "DelayedWgradLinear",
        b.DelayedWgradLinear,
        lambda: dict(in_features=4, out_features=4, delay_wgrad=True, **_f32()),
        (
            Arg("in_features", not_int(1)),
            Arg("out_features", not_int(1)),
            Arg("delay_wgrad", not_bool()),
            *DTYPE_DEVICE,
        ),
    )
    yield Entry(
        "DelayedWgradGroupedLinear",
        b.DelayedWgradGroupedLinear,
        lambda: dict(
            groups=2, in_features=4, out_features=4, delay_wgrad=True, transposed=False, **_f32()
        ),
        (
            Arg("groups", not_int(1)),
            Arg("in_features", not_int(1)),
            Arg("out_features", not_int(1)),
            Arg("delay_wgrad", not_bool()),
            Arg("transposed", not_bool()),
            *DTYPE_DEVICE,
        ),
    )
    yield Entry(
        "DelayedWgradModule",
        b.DelayedWgradModule,
        lambda: dict(weight=nn.Parameter(torch.ones(2, 2)), delay_wgrad=False),
        (Arg("weight", not_instance(nn.Parameter)), Arg("delay_wgrad", not_bool())),
    )
    yield Entry(
        "GroupSizes",
        b.GroupSizes,
        lambda: dict(sizes=[1, 2]),
        (
            Arg(
                "sizes",
                st.one_of(
                    JUNK.filter(lambda v: not isinstance(v, (list, tuple))),
                    st.sampled_from([[1, -1], [1.0], ["1"], [True], [torch.tensor(1)]]),
                ),
            ),
        ),
    )
    yield Entry(
        "accumulate_grad",
        b.accumulate_grad,
        lambda: dict(param=nn.Parameter(torch.ones(2)), grad=torch.ones(2)),
        (
            Arg("param", not_tensor()),
            Arg("grad", st.one_of(not_tensor(), st.builds(lambda: torch.ones(1)))),  # broadcast
        ),
    )
    fn: Callable[..., Any]
    fns: tuple[Callable[..., Any], ...]
    fns = (owed_wgrad, check_wgrad_done, b.finish_wgrad, b.discard_wgrad)
    for fn in fns:
        yield Entry(
            fn.__name__, fn, lambda: dict(model=nn.Linear(2, 2)), (Arg("model", not_module()),)
        )
    yield Entry(
        "HostLoopback",
        b.HostLoopback,
        lambda: dict(remote_rows=None, chunks=1, mode=b.LoopbackMode.HOST),
        (
            Arg("remote_rows", not_int(0, optional=True)),
            Arg("chunks", not_int(1)),
            Arg("mode", st.one_of(not_choice(list(b.LoopbackMode)), st.just("device"))),
        ),
    )
    yield Entry(
        "loopback",
        b.loopback,
        lambda: dict(x=torch.ones(2, 2), mover=b.HostLoopback()),
        (Arg("x", not_tensor()), Arg("mover", not_instance(b.HostLoopback))),
    )
    yield Entry(
        "recompute",
        lambda fn, policy: b.recompute(fn, torch.ones(2, requires_grad=True), policy=policy),
        lambda: dict(fn=torch.sin, policy=None),
        (Arg("fn", not_callable()), Arg("policy", not_callable(optional=True))),
    )
    yield Entry(
        "check_recompute",
        b.check_recompute,
        lambda: dict(parts=("norm",), where="GPTMoEConfig.recompute"),
        (Arg("parts", st.sampled_from(["norm", ("norms",), 5, None, [1], torch.ones(2)])),),
    )
    yield Entry(
        "recompute_module",
        b.recompute_module,
        lambda: dict(module=nn.Linear(2, 2), selective=False),
        (Arg("module", not_module()), Arg("selective", not_bool())),
    )
    yield Entry(
        "GraphedBlock",
        b.GraphedBlock,
        lambda: dict(
            fn=lambda x: x,
            modules=[nn.Linear(2, 2)],
            scope=CudaGraphModule.attn,
            label="block",
            frozen=None,
            warmup=2,
        ),
        (
            Arg("fn", not_callable()),
            Arg("modules", not_modules()),
            Arg("scope", st.one_of(not_instance(CudaGraphModule), st.just("attn"))),
            Arg("label", not_instance(str)),
            Arg("frozen", not_callable(optional=True)),
            Arg("warmup", not_int(1)),
        ),
    )
    yield Entry(
        "StageLayers",
        b.StageLayers,
        lambda: dict(layers=[nn.Linear(2, 2)], start=0),
        (
            Arg("layers", not_modules().filter(lambda v: v is not None), named="layer"),
            Arg("start", not_int(0)),
        ),
    )
    yield Entry(
        "attach_aux_loss",
        b.attach_aux_loss,
        lambda: dict(probs=torch.ones(2), aux_loss=torch.tensor(0.5), coeff=0.1),
        (
            Arg("probs", not_tensor()),
            Arg("aux_loss", st.one_of(not_tensor(), st.builds(lambda: torch.ones(3)))),
            Arg("coeff", not_real()),
        ),
    )
    yield Entry(
        "rotary_tables",
        b.rotary_tables,
        lambda: dict(
            position_ids_BS=torch.arange(4).view(1, 4), head_dim=4, base=1e4, dtype=torch.float32
        ),
        (
            Arg("position_ids_BS", not_tensor()),
            Arg("head_dim", st.one_of(not_int(1), st.sampled_from([3, 5]))),
            Arg("base", not_real(above=0.0)),
            Arg("dtype", not_float_dtype()),
        ),
    )
    yield Entry(
        "chunk_sizes",
        b.chunk_sizes,
        lambda: dict(tokens=10, chunks=3),
        (Arg("tokens", not_int(0)), Arg("chunks", not_int(1))),
    )
    yield Entry(
        "swiglu", b.swiglu, lambda: dict(gate_up=torch.ones(2, 4)), (Arg("gate_up", not_tensor()),)
    )
    yield Entry(
        "apply_rotary",
        b.apply_rotary,
        lambda: dict(
            x_BHSE=torch.ones(1, 1, 2, 4),
            cos_B1SE=torch.ones(1, 1, 2, 4),
            sin_B1SE=torch.ones(1, 1, 2, 4),
        ),
        (Arg("x_BHSE", not_tensor()), Arg("cos_B1SE", not_tensor()), Arg("sin_B1SE", not_tensor())),
    )
    masks: tuple[tuple[Callable[..., Any], torch.Tensor], ...] = (
        (b.check_padding_mask, torch.zeros(2, 4, dtype=torch.bool)),
        (b.check_attention_mask, torch.zeros(2, 1, 4, 4, dtype=torch.bool)),
    )
    for fn, mask in masks:
        yield Entry(
            fn.__name__,
            fn,
            functools.partial(_mask_args, mask),
            (Arg("mask", not_tensor(optional=True), named="_mask"),),
        )
    fns = (b.token_padding,)
    for fn in fns:
        yield Entry(
            fn.__name__,
            fn,
            lambda: dict(state=ChunkState(Microbatch())),
            (Arg("state", not_instance(ChunkState)),),
        )
    yield Entry(
        "check_masks",
        b.check_masks,
        lambda: dict(state=ChunkState(Microbatch()), batch=2, seq=4, where="here"),
        (Arg("state", not_instance(ChunkState)),),
    )
    yield Entry(
        "PlainContext",
        b.PlainContext,
        lambda: dict(chunk_state=ChunkState(Microbatch())),
        (Arg("chunk_state", not_instance(ChunkState)),),
    )
    inputs: tuple[tuple[Callable[..., Any], int], ...] = ((b.single_input, 1), (b.pair_input, 2))
    for fn, n in inputs:
        yield Entry(
            fn.__name__,
            fn,
            functools.partial(_input_args, n),
            (Arg("inputs", JUNK.filter(lambda v: not isinstance(v, tuple))),),
        )

    # ----- moe_overlap.models
    yield Entry(
        "GPTMoEConfig",
        GPTMoEConfig,
        lambda: dict(TINY),
        tuple(Arg(name, wrong) for name, wrong in CONFIG_WRONG.items()),
    )
    yield Entry(
        "GPTMoEModel",
        GPTMoEModel,
        lambda: dict(config=tiny_config(), ep_group=None, count_group=None, device=None),
        (
            Arg("config", not_instance(GPTMoEConfig)),
            Arg("ep_group", not_group()),
            Arg("count_group", not_group()),
            Arg("device", not_device()),
        ),
    )
    yield Entry(
        "GPTMoEModel.set_aux_loss_scale",
        lambda scale: tiny_model().set_aux_loss_scale(scale),
        lambda: dict(scale=2.0),
        (Arg("scale", not_real()),),
    )
    yield Entry(
        "GPTMoEStage",
        GPTMoEStage,
        lambda: dict(model=tiny_model(), layers=range(0, 1)),
        (
            Arg("model", not_instance(GPTMoEModel)),
            Arg(
                "layers",
                st.one_of(JUNK, st.sampled_from([range(0, 3), range(-1, 1), range(0, 2, 2)])),
                named="layers",
            ),
        ),
    )
    yield Entry(
        "DenseLayer",
        DenseLayer,
        lambda: dict(config=tiny_config(), index=0, device=None),
        (
            Arg("config", not_instance(GPTMoEConfig)),
            Arg("index", not_int(0)),
            Arg("device", not_device()),
        ),
    )
    yield Entry(
        "MoELayer",
        MoELayer,
        lambda: dict(
            config=tiny_config(), index=1, dispatcher=b.TokenDispatcher(4, 2), device=None
        ),
        (
            Arg("config", not_instance(GPTMoEConfig)),
            Arg("index", not_int(0)),
            Arg(
                "dispatcher",
                st.one_of(
                    not_instance(b.TokenDispatcher),
                    st.builds(lambda: b.TokenDispatcher(8, 2)),  # another expert count
                ),
            ),
            Arg("device", not_device()),
        ),
    )
    yield Entry(
        "Decoder",
        Decoder,
        lambda: dict(layers=[DenseLayer(tiny_config(), 0, None)], start=0),
        (Arg("layers", not_modules()), Arg("start", not_int(0))),
    )
    yield Entry(
        "masked_cross_entropy",
        masked_cross_entropy,
        lambda: dict(
            logits_BSV=torch.zeros(1, 2, 4),
            labels_BS=torch.zeros(1, 2, dtype=torch.long),
            loss_mask=None,
        ),
        (
            Arg("logits_BSV", not_tensor()),
            Arg("labels_BS", not_tensor()),
            Arg("loss_mask", not_tensor(optional=True)),
        ),
    )

    # ----- moe_overlap (the engine's newer entry points)
    yield Entry(
        "ScheduleOptions",
        ScheduleOptions,
        lambda: dict(
            delay_wgrad_compute=None,
            ep_overlap_early_attn_memory_release=False,
            free_input=True,
            recompute=("pre_dispatch", "mlp"),
        ),
        (
            Arg("delay_wgrad_compute", not_bool().filter(lambda v: v is not None)),
            Arg("ep_overlap_early_attn_memory_release", not_bool()),
            Arg("free_input", not_bool()),
            Arg(
                "recompute",
                st.one_of(
                    JUNK.filter(lambda v: not (isinstance(v, list) and not v)),  # [] is valid
                    st.sampled_from([("dispatch",), ("combine", "mlp"), ("mtp_post",), "mlp"]),
                ),
            ),
        ),
    )
    yield Entry(
        "ChunkHooks",
        ChunkHooks,
        lambda: dict(pre_forward=None, pre_backward=None, post_forward=None, post_backward=None),
        tuple(
            Arg(n, not_callable(optional=True))
            for n in ("pre_forward", "pre_backward", "post_forward", "post_backward")
        ),
    )
    yield Entry(
        "Microbatch",
        Microbatch,
        lambda: dict(input_ids=torch.zeros(1, 2, dtype=torch.long), runtime_gather_output=None),
        (
            Arg("input_ids", not_tensor(optional=True)),
            Arg("runtime_gather_output", not_bool().filter(lambda v: v is not None)),
            Arg(
                "extra_block_kwargs",
                JUNK.filter(lambda v: v is not None and not isinstance(v, dict)),
            ),
        ),
    )
    yield Entry(
        "combined_1f1b",
        _schedule_run,
        lambda: dict(
            overlap=True, loss_scale=1.0, options=ScheduleOptions(), streams=None, fill_drain=False
        ),
        (
            Arg("overlap", not_bool()),
            Arg("loss_scale", not_real()),
            Arg("options", not_instance(ScheduleOptions)),
            Arg("streams", not_instance(StreamPair, optional=True)),
            Arg("on_plan", not_callable(optional=True)),
            Arg("observer", JUNK.filter(lambda v: v is not None)),
            Arg("fill_drain", not_bool()),
            Arg("consensus_group", JUNK.filter(lambda v: v is not None)),
        ),
    )
    yield Entry(
        "LayerArgs.from_mapping",
        lambda **mapping: layer_args(mapping),
        lambda: dict(config=tiny_config(), is_moe=True, num_local_experts=None),
        (
            Arg("config", JUNK),
            Arg("is_moe", not_bool()),
            Arg("delay_wgrad_compute", not_bool()),
            Arg("num_local_experts", not_int(1, optional=True)),
        ),
    )
    yield Entry(
        "make_streams",
        make_streams,
        lambda: dict(device="cpu", high_priority_comm=False),
        (Arg("device", not_device()), Arg("high_priority_comm", not_bool())),
    )
    yield Entry(
        "shake",
        shake,
        lambda: dict(seed=0, max_us=10.0, probability=0.5),
        (
            Arg("seed", not_int(0)),
            Arg("max_us", not_real(lo=0)),
            Arg("probability", not_real(lo=0)),
        ),
    )
    yield Entry("Timeline", Timeline, lambda: dict(rank=0), (Arg("rank", not_int(0)),))
    yield Entry(
        "make_event", make_event, lambda: dict(device="cpu"), (Arg("device", not_device()),)
    )
    yield Entry(
        "set_streams",
        _set_streams,
        lambda: dict(comp_stream=CpuStream(), comm_stream=CpuStream()),
        (
            Arg("comp_stream", JUNK.filter(lambda v: v is not None)),
            Arg("comm_stream", JUNK.filter(lambda v: v is not None)),
        ),
    )
    yield Entry(
        "StreamPair",
        StreamPair,
        lambda: dict(comp=CpuStream(), comm=CpuStream()),
        (Arg("comp", JUNK), Arg("comm", JUNK)),
    )
    yield Entry("CpuStream", CpuStream, lambda: dict(name="s"), (Arg("name", not_instance(str)),))
    yield Entry(
        "CpuEvent", CpuEvent, lambda: dict(enable_timing=True), (Arg("enable_timing", not_bool()),)
    )
    yield Entry(
        "Step.parse",
        Step.parse,
        lambda: dict(text="f.L0.dispatch.F@comm"),
        (Arg("text", JUNK, named="Step.parse"),),
    )

    # ----- moe_overlap.integrations
    yield Entry(
        "prepare_schedule",
        pipelining.prepare_schedule,
        lambda: dict(
            schedule=_stage_schedule(), pair=True, overlap=True, options=None, observer=None
        ),
        (
            Arg("pair", not_bool()),
            Arg("overlap", not_bool()),
            Arg("options", not_instance(ScheduleOptions, optional=True)),
            Arg("observer", JUNK.filter(lambda v: v is not None)),
        ),
    )
    yield Entry(
        "pair_overlap_f_b",
        pipelining.pair_overlap_f_b,
        lambda: dict(order={0: [None]}, num_stages=2, stage_to_rank=lambda s: 0),
        (
            Arg("order", JUNK.filter(lambda v: not isinstance(v, dict))),
            Arg("num_stages", not_int(1)),
            Arg("stage_to_rank", not_callable()),
        ),
    )
    yield Entry(
        "check_torch",
        pipelining.check_torch,
        lambda: dict(version=None),
        (Arg("version", JUNK.filter(lambda v: v is not None and not isinstance(v, str))),),
    )
    yield Entry(
        "fully_shard_slots",
        fsdp.fully_shard_slots,
        lambda: dict(
            model=tiny_model(), mesh=_mesh(), expert_mesh=None, reshard_after_forward=True
        ),
        (
            Arg("model", not_module()),
            Arg("mesh", JUNK.filter(lambda v: v is not None)),
            Arg("expert_mesh", JUNK.filter(lambda v: v is not None)),
            Arg("is_expert", not_callable()),
            Arg("reshard_after_forward", not_bool()),
        ),
    )
    yield Entry(
        "slot_modules",
        lambda model: list(fsdp.slot_modules(model)),
        lambda: dict(model=tiny_model()),
        (Arg("model", not_module()),),
    )
    yield Entry(
        "register_expert_shards",
        ckpt.register_expert_shards,
        lambda: dict(module=nn.Linear(2, 2), names=["weight"], num_experts=2, group=None),
        (
            Arg("module", not_module()),
            Arg(
                "names",
                st.one_of(
                    JUNK.filter(lambda v: not isinstance(v, (list, tuple, dict, str, bytes))),
                    st.just([1]),
                ),
            ),
            Arg("num_experts", not_int(1)),
            Arg("group", not_group()),
        ),
    )
    yield Entry(
        "register_fsdp_experts",
        ckpt.register_fsdp_experts,
        lambda: dict(modules=[nn.Linear(2, 2)], expert_mesh=_mesh()),
        (Arg("modules", not_modules()), Arg("expert_mesh", JUNK)),
        valid_runs=False,  # a registered expert module needs an EP group of two ranks
    )
    yield Entry(
        "attach_optimizer",
        ckpt.attach_optimizer,
        lambda: dict(optimizer=torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)),
        (Arg("optimizer", JUNK),),
    )
    yield Entry(
        "expert_shards",
        ckpt.expert_shards,
        lambda: dict(module=nn.Linear(2, 2)),
        (Arg("module", not_module()),),
    )

    # ----- moe_overlap.adapters.transformers
    if importlib.util.find_spec("transformers") is None:
        return
    from moe_overlap.adapters import transformers as hf

    yield Entry(
        "TransformersMoEAdapter",
        hf.TransformersMoEAdapter,
        lambda: dict(
            model=_hf().mixtral(),
            ep_group=None,
            delay_wgrad_compute=False,
            router_aux_loss=None,
            self_check=False,
            recompute=(),
        ),
        (
            Arg("model", not_module()),
            Arg("ep_group", not_group()),
            Arg("delay_wgrad_compute", not_bool()),
            Arg("router_aux_loss", not_bool().filter(lambda v: v is not None)),
            Arg("self_check", not_bool()),
            Arg("recompute", st.sampled_from(["attention", 5, None, ("mlp",), ("activation",)])),
        ),
    )
    yield Entry(
        "AdapterConfig",
        hf.AdapterConfig,
        lambda: dict(delay_wgrad_compute=True),
        (
            Arg("delay_wgrad_compute", not_bool()),
            Arg("moe_token_dispatcher_type", not_choice(["alltoall"])),
            Arg("fp8", JUNK.filter(lambda v: v is not None)),
            Arg("cuda_graph_modules", st.sampled_from([(CudaGraphModule.attn,), "attn", 5])),
            Arg("mtp_num_layers", JUNK.filter(lambda v: v is not None)),
        ),
    )
    yield Entry(
        "TransformersMoEStage",
        hf.TransformersMoEStage,
        lambda: dict(adapter=_adapter(), layers=range(0, 1)),
        (
            Arg("adapter", JUNK),
            Arg("layers", st.one_of(JUNK, st.just(range(0, 9))), named="layers"),
        ),
    )
    fns = (hf.shard_experts, hf.gather_experts)
    for fn in fns:
        yield Entry(
            fn.__name__,
            fn,
            lambda: dict(model=_hf().mixtral(), group=None),
            (Arg("model", not_module()), Arg("group", not_group())),
        )
    yield Entry(
        "expert_parameter_names",
        hf.expert_parameter_names,
        lambda: dict(model=_hf().mixtral()),
        (Arg("model", not_module()),),
    )
    yield Entry(
        "DelayedLinear",
        hf.DelayedLinear,
        lambda: dict(linear=nn.Linear(2, 2), delay_wgrad=True),
        (Arg("linear", JUNK), Arg("delay_wgrad", not_bool())),
    )


def _world_of_one() -> None:
    store = cast(Any, dist).HashStore()  # not in torch.distributed's __all__
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)


def _mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1,))


ENTRIES = list(_entries())
PAIRS = [(e, a) for e in ENTRIES for a in e.args]
NEEDS_GROUP = {"fully_shard_slots", "register_fsdp_experts"}


@contextlib.contextmanager
def group_for(entry: Entry) -> Iterator[None]:
    """A one-rank gloo default group, for the entry points that shard over it or take a mesh
    of it (a valid example must be valid by its annotations too: debug mode checks them all
    before the library checks the wrong one); nothing for the others."""
    if entry.name not in NEEDS_GROUP:
        yield
        return
    _world_of_one()
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def world_of_one(request: pytest.FixtureRequest) -> Iterator[None]:
    """:func:`group_for` the test's entry."""
    with group_for(request.node.callspec.params["entry"]):
        yield


SETTINGS = settings(
    max_examples=6,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much],
)


@pytest.mark.parametrize(("entry", "arg"), PAIRS, ids=[f"{e.name}-{a.name}" for e, a in PAIRS])
@pytest.mark.usefixtures("world_of_one")
def test_a_wrong_argument_is_a_library_error_naming_it(entry: Entry, arg: Arg) -> None:
    @SETTINGS
    @given(value=arg.wrong)
    def check(value: object) -> None:
        kwargs = entry.valid() | {arg.name: value}
        with pytest.raises(MoeOverlapError) as info:
            entry.call(**kwargs)
        assert (arg.named or arg.name) in str(info.value), str(info.value)

    check()


@pytest.mark.parametrize("entry", ENTRIES, ids=[e.name for e in ENTRIES])
@pytest.mark.usefixtures("world_of_one")
def test_the_valid_example_is_accepted(entry: Entry) -> None:
    if not entry.valid_runs:
        pytest.skip("the all-valid call needs peer ranks (tests/integrations)")
    entry.call(**entry.valid())


def test_every_public_constructor_and_function_of_blocks_is_in_the_table() -> None:
    """A new public callable of ``moe_overlap.blocks`` gets a row (or a reason here)."""
    covered = {e.name.split(".")[0] for e in ENTRIES}
    unchecked = {
        # Protocols, type aliases, enums and plain records: nothing to call with arguments.
        "DispatcherKind",
        "DispatchMeta",
        "HostCounts",
        "PermuteMeta",
        "BlockedKeys",
        "LoopbackMode",
        "MatmulKernel",
        "DenseKernel",
        "GroupedKernel",
        "PendingItem",
        "RecomputePart",
        "RecomputeParts",
        "ScoreFunction",
        "SlotContext",
        "PlainLayer",
        "Rotary",
        "RotaryTables",
        # Records the dispatcher builds for itself, mixins without a constructor of their own, a
        # checkpoint policy torch calls, and per-step helpers of a slot (their inputs come from
        # the slots before them; torch raises for a wrong tensor).
        "MegatronHooks",
        "StageRange",
        "DenseSlots",
        "MoESlots",
        "add_residual",
        "blocked_keys",
        "save_matmuls",
        # Type aliases and a record of TokenDispatcher.permute's keywords: checked there
        # (tests/blocks/test_dispatcher_slots.py).
        "CopyOrder",
        "Combine",
        "Gathered",
    }
    missing = sorted(set(b.__all__) - covered - unchecked)
    assert missing == [], f"public blocks names without a row in test_arguments: {missing}"


# --- the named nonsense cases, one by one ----------------------------------------------------


NAMED_NONSENSE: list[tuple[Callable[[], object], str, str | None]] = [
    (
        lambda: b.TokenDispatcher(4, 2, kind=bad("all2all")),
        r"TokenDispatcher: kind must be one of \['alltoall', 'loopback'\], received str 'all2all'",
        "kind",
    ),
    (
        lambda: tiny_config(num_experts=0),
        r"GPTMoEConfig\.num_experts: expected an int >= 1, received int 0",
        None,
    ),
    (
        lambda: tiny_config(num_experts=True),
        r"GPTMoEConfig\.num_experts: expected an int >= 1, received bool True",
        None,
    ),
    (
        lambda: b.TopKRouter(8, 4, 5, aux_loss_coeff=0.0),
        r"TopKRouter: topk must be an int in \[1, num_experts=4\], received int 5",
        None,
    ),
    (
        lambda: tiny_config(moe_aux_loss_coeff=float("nan")),
        r"moe_aux_loss_coeff: expected a finite real number >= 0, received float nan",
        None,
    ),
    (lambda: tiny_config(moe_aux_loss_coeff=-0.1), r"received float -0\.1", None),
    (
        lambda: tiny_config(delay_wgrad_compute="yes"),
        r"GPTMoEConfig\.delay_wgrad_compute: expected a bool, received str 'yes'",
        "delay_wgrad_compute",
    ),
    (
        lambda: b.GraphedBlock(lambda x: x, [], bad("attn"), label="b"),
        r"GraphedBlock: scope must be a CudaGraphModule .*received str 'attn'; pass the member",
        "scope",
    ),
    (
        lambda: b.GroupSizes(bad({3, 1})),
        r"GroupSizes: sizes must be a sequence, .*received set \{1, 3\} \(a set has no order",
        None,
    ),
    (
        lambda: Decoder(bad({DenseLayer(tiny_config(), 0, None)})),
        r"(?s)Decoder: layers must be a sequence, .*received set .*a set has no order: give a list",
        None,
    ),
    (
        lambda: fsdp.fully_shard_slots(tiny_model()),
        r"fully_shard_slots: expected a process group .*not initialized",
        None,
    ),
]
"""(call, the library's message, the parameter whose annotation the value breaks, if any)."""


@pytest.mark.parametrize(("call", "match", "hinted"), NAMED_NONSENSE)
def test_named_nonsense_is_refused(
    call: Callable[[], object], match: str, hinted: str | None
) -> None:
    """The library's message; in debug mode, where the value breaks the parameter's
    annotation itself (``hinted``), beartype's ``TypeHintError`` naming it, first."""
    with refusal(match, hinted):
        call()


def test_numpy_integers_are_ints_and_stored_as_ints() -> None:
    config = tiny_config(num_experts=np.int64(4), moe_router_topk=np.int32(2))
    assert type(config.num_experts) is int and type(config.moe_router_topk) is int
    assert (
        b.TopKRouter(bad(np.int64(8)), 4, 2, aux_loss_coeff=bad(np.float32(0.5))).aux_loss_coeff
        == 0.5
    )


def test_fully_shard_slots_refuses_parameters_outside_the_slot_modules() -> None:
    """A parameter of the decoder itself or of a decoder child other than ``layers`` was
    left unsharded: its gradient never reduced over the data-parallel ranks."""
    _world_of_one()
    try:
        for name, part in (("scale", nn.Parameter(torch.ones(1))), ("final_norm", nn.Linear(2, 2))):
            model = tiny_model()
            setattr(model.decoder, name, part)
            with pytest.raises(
                mo.ConfigError,
                match=rf"expected every parameter of GPTMoEModel in a slot module .* outside "
                rf"them \(decoder\.{name}.*never be reduced over the data-parallel ranks",
            ):
                fsdp.fully_shard_slots(model, mesh=_mesh())
            assert not any(isinstance(m, FSDPModule) for m in model.modules())
    finally:
        dist.destroy_process_group()


def test_slot_modules_checks_the_model_when_called() -> None:
    """The checks ran on the first ``next()``, not at the call."""
    with pytest.raises(mo.IntegrationError, match="slot_modules: model must be an nn.Module"):
        fsdp.slot_modules(cast(Any, "model"))
    model = nn.Module()
    model.decoder = nn.Module()
    model.decoder.layers = cast(Any, [3])  # not a module: a plain attribute
    with pytest.raises(mo.ConfigError, match=r"decoder.layers\[0\] is a int, not an nn.Module"):
        fsdp.slot_modules(model)


def test_fully_shard_slots_applied_twice_is_refused() -> None:
    _world_of_one()
    try:
        model = tiny_model()
        fsdp.fully_shard_slots(model, mesh=_mesh())
        with pytest.raises(
            mo.ConfigError, match=r"already FSDPModules .*apply fully_shard_slots once"
        ):
            fsdp.fully_shard_slots(model, mesh=_mesh())
    finally:
        dist.destroy_process_group()
