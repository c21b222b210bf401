"""Megatron-Core expert parallelism through the model's own all-to-all token dispatcher: EP=2
on two gloo processes. The worker (:mod:`tests.adapters.megatron_ep_worker`) says what
runs and what is compared."""

from __future__ import annotations

import pytest

from tests.gloo_ranks import run_ranks

pytest.importorskip("megatron.core", reason="Megatron-Core is not installed")


@pytest.mark.slow
def test_ep2_schedules_bit_identical_to_megatron_s_own() -> None:
    rows = run_ranks(
        "tests.adapters.megatron_ep_worker",
        world=2,
        timeout=300,
        env={"PYTHONWARNINGS": "ignore"},
    )
    runs = {"overlapped", "fill_drain", "recompute", "free_input"}
    assert {(r["run"], r["rank"]) for r in rows} == {(n, k) for n in runs for k in (0, 1)}
    for r in rows:
        assert r["losses"] and r["grads"], r  # bit for bit, this rank's gradients
        assert r["local_expert_params"] == 8, r  # 2 of the 4 experts on each rank (x 2 layers)
