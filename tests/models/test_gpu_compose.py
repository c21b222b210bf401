"""On CUDA, bf16, real streams: recomputation and compiled modules stay bit-identical.

Skipped without a GPU (run on the lent H200).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest
import torch
import torch._dynamo

from moe_overlap import Microbatch, combined_1f1b, make_streams
from moe_overlap.models import GPTMoEModel
from tests.models._helpers import GPU_BF16, assert_matches_plain

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _model(recompute: tuple[str, ...], delay: bool, compiled: bool) -> GPTMoEModel:
    parts: Any = recompute  # names as data, checked by the config
    config = dataclasses.replace(GPU_BF16, delay_wgrad_compute=delay, recompute=parts)
    model = GPTMoEModel(config, device="cuda")
    if compiled:
        for layer in model.layer_list:
            for name in ("attn_block", "pre_mlp_norm", "router", "mlp", "shared_expert"):
                module = getattr(layer, name, None)
                if isinstance(module, torch.nn.Module):
                    compile_: Any = module.compile  # unannotated in torch
                    compile_(fullgraph=True)
    return model


@pytest.mark.parametrize("fill_drain", [False, True])
@pytest.mark.parametrize(
    ("recompute", "delay", "compiled"),
    [
        (("norm", "activation", "attention_core"), True, False),
        (("attention", "norm"), False, False),
        ((), False, True),
    ],
)
def test_cuda_compose_parity(
    recompute: tuple[str, ...], delay: bool, compiled: bool, fill_drain: bool
) -> None:
    """``fill_drain`` with recompute: the memory-bounded fill/drain of issue 27, part 3."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    found = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    torch._dynamo.reset()
    try:
        g = torch.Generator().manual_seed(0)
        xs = [torch.randint(0, 128, (2, 64), generator=g).cuda() for _ in range(4)]
        mbs = [Microbatch(input_ids=x, labels=x.roll(-1, 1)) for x in xs]
        scheduled = _model(recompute, delay, compiled)
        losses = combined_1f1b(
            scheduled,
            mbs,
            options=scheduled.schedule_options(),
            streams=make_streams("cuda"),
            fill_drain=fill_drain,
        )
        plain = _model(recompute, delay, compiled)
        assert_matches_plain(scheduled, plain, mbs, losses)
    finally:
        torch.use_deterministic_algorithms(found)  # as found: the suite's fixture turns it on
        torch._dynamo.reset()
