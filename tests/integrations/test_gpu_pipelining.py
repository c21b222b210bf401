"""On one GPU, bf16: DualPipeV's two stages on one rank, prepared vs torch's own run."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.gloo_ranks import run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("delay", [False, True])
def test_dualpipev_on_one_gpu_is_bit_identical(delay: bool) -> None:
    case = dict(
        pp=1,
        ep=1,
        schedule="dualpipev",
        microbatches=4,
        delay=delay,
        stages=[0, 2, 4],
        device="cuda",
    )
    os.environ["PP_CASE"] = json.dumps(case)
    try:
        (row,) = run_ranks("tests.integrations.pp_worker", world=1)
    finally:
        del os.environ["PP_CASE"]
    assert row["pairs"] and row["plan_steps"]
    assert row["got"] == row["base"]
    assert row["identical"], "a bf16 gradient differs from torch's own run of the schedule"
