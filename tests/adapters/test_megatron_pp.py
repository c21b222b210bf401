"""Megatron-Core ``GPTModel`` chunks as pipeline stages: PP=2 on two gloo processes (two
stages each), DualPipeV and paired interleaved 1F1B. The worker
(:mod:`tests.adapters.megatron_pp_worker`) says what runs and what is compared."""

from __future__ import annotations

import json
from typing import cast

import pytest

from tests.gloo_ranks import run_ranks

pytest.importorskip("megatron.core", reason="Megatron-Core is not installed")


@pytest.mark.slow
def test_pp2_dualpipev_and_interleaved_bit_identical() -> None:
    schedules = ["DualPipeV", "Interleaved1F1B"]
    rows = run_ranks(
        "tests.adapters.megatron_pp_worker",
        world=2,
        timeout=300,
        env={"MEGATRON_PP_SCHEDULES": json.dumps(schedules), "PYTHONWARNINGS": "ignore"},
    )
    assert len(rows) == 2 * len(schedules)
    for r in rows:
        assert r["bit_identical"], r  # prepared schedule vs torch's execution of it
        assert r["vs_megatron_ok"], r  # vs torch's execution of the raw GPTModel chunks
        assert r["pending"] == 0, r
        assert int(str(r["paired"])) > 0, r  # overlapped forward+backward pairs ran
        assert int(str(r["grads"])) > 0, r
    for name in schedules:  # the rank holding the last stage reports the four losses
        losses = [cast("list[float]", r["losses"]) for r in rows if r["schedule"] == name]
        assert sorted(len(x) for x in losses) == [0, 4], (name, losses)
