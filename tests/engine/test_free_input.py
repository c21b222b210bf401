"""The free-input policy (Megatron-Core 0.19 truth table) and storage really freed."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass

import pytest
import torch

from moe_overlap import CudaGraphModule, ModelChunkSchedulePlan, ScheduleOptions, should_free_input
from moe_overlap.steps import Slot

from .toy_model import ToyConfig, ToyModel, make_microbatches


@dataclass(frozen=True)
class Cfg:
    moe_token_dispatcher_type: str
    moe_flex_dispatcher_backend: str | None
    fp8: str | None
    fp4: str | None
    cuda_graph_modules: tuple[object, ...]


class MegatronCudaGraphModule(enum.Enum):
    """Megatron-Core's own, int-valued enum: membership is judged by member name."""

    attn = 1
    mlp = 2
    moe = 3
    moe_router = 4
    moe_preprocess = 5
    mamba = 6


NAMES = ["pre_dispatch_computation", "moe_dispatch", "mlp", "moe_combine", "mtp_post_process"]
DISPATCHERS = ["alltoall", "allgather", "flex"]
BACKENDS = ["deepep", "hybridep", "ncclep", None]
GRAPHS: list[tuple[object, ...]] = [
    (),
    (CudaGraphModule.attn,),
    (CudaGraphModule.moe_router, CudaGraphModule.moe_preprocess),
    ("moe_router", "moe_preprocess"),
    (MegatronCudaGraphModule.moe_router, MegatronCudaGraphModule.moe_preprocess),
    (MegatronCudaGraphModule.attn,),
]


def expected(name: str, is_moe: bool, cfg: Cfg, nle: int | None) -> bool:
    """The 0.19 decision written as a table per node name (see SPEC §4)."""
    if not is_moe:
        return False
    backend = cfg.moe_flex_dispatcher_backend if cfg.moe_token_dispatcher_type == "flex" else None
    keeps_mlp_input = backend in ("hybridep", "ncclep")
    owns_dispatch_buffer = backend in ("deepep", "hybridep", "ncclep")
    graph_names = {m.name if isinstance(m, enum.Enum) else m for m in cfg.cuda_graph_modules}
    table = {
        "moe_combine": True,
        "moe_dispatch": not owns_dispatch_buffer and "moe_preprocess" not in graph_names,
        "mlp": (cfg.fp8 is not None or cfg.fp4 is not None)
        or (
            ((nle or 0) > 1 or cfg.moe_token_dispatcher_type != "alltoall") and not keeps_mlp_input
        ),
    }
    return table.get(name, False)


CASES = list(
    itertools.product(
        NAMES,
        [False, True],
        DISPATCHERS,
        BACKENDS,
        [None, "e4m3"],
        [None, "e2m1"],
        range(len(GRAPHS)),
        [None, 1, 8],
    )
)


@pytest.mark.parametrize("chunk", range(8))
def test_truth_table(chunk: int) -> None:
    for name, is_moe, disp, backend, fp8, fp4, g, nle in CASES[chunk::8]:
        if is_moe and nle is None:
            continue  # MoE layers always know their local expert count
        cfg = Cfg(disp, backend, fp8, fp4, GRAPHS[g])
        got = should_free_input(name, is_moe, cfg, nle)
        assert got == expected(name, is_moe, cfg, nle), (name, is_moe, cfg, nle)


@pytest.mark.parametrize(
    ("name", "disp", "backend", "fp8", "nle", "want"),
    [
        ("mlp", "alltoall", None, None, 1, False),  # experts read the a2a buffer directly
        ("mlp", "alltoall", None, None, 4, True),
        ("mlp", "allgather", None, None, 1, True),
        ("mlp", "flex", "deepep", None, 1, True),
        ("mlp", "flex", "hybridep", None, 4, False),
        ("mlp", "flex", "ncclep", "e4m3", 1, True),  # fp8 wins over the backend
        ("moe_dispatch", "flex", "deepep", None, 4, False),
        ("moe_dispatch", "flex", None, None, 4, True),
        ("moe_dispatch", "alltoall", None, None, 4, True),
        ("moe_combine", "flex", "ncclep", None, 4, True),
        ("pre_dispatch_computation", "alltoall", None, "e4m3", 4, False),
        ("mtp_post_process", "alltoall", None, None, 4, False),
    ],
)
def test_notable_rows(
    name: str, disp: str, backend: str | None, fp8: str | None, nle: int, want: bool
) -> None:
    assert should_free_input(name, True, Cfg(disp, backend, fp8, None, ()), nle) is want


def test_graphed_preprocess_keeps_dispatch_input() -> None:
    for graphs in GRAPHS[2:5]:
        cfg = Cfg("alltoall", None, None, None, graphs)
        assert not should_free_input("moe_dispatch", True, cfg, 4)


@pytest.mark.parametrize("free_input", [True, False])
def test_freed_exactly_where_the_policy_says(free_input: bool) -> None:
    config = ToyConfig()
    model = ToyModel(config, "dmm")
    (mb,) = make_microbatches(1, config)
    plan = ModelChunkSchedulePlan(
        model,
        mb,
        options=ScheduleOptions(free_input=free_input),
    )
    loss = ModelChunkSchedulePlan.run(plan, None)
    assert loss is not None
    checked = 0
    for lp in plan.layers:
        for slot in (Slot.PRE_DISPATCH, Slot.DISPATCH, Slot.MLP, Slot.COMBINE):
            node = lp.nodes[slot]
            policy = should_free_input(
                slot.node_name,
                lp.shape.is_moe,
                config,
                config.num_experts if lp.shape.is_moe else None,
            )
            assert node.free_input == (policy and free_input)
            for t in node.inputs:
                assert t is not None
                freed = t.untyped_storage().size() == 0
                assert freed == node.free_input, (lp.index, slot)
                checked += 1
    assert checked > 0
    ModelChunkSchedulePlan.run(None, plan, b_grad=torch.ones_like(loss))
