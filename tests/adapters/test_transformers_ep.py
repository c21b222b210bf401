"""The transformers adapter with expert parallelism over two real gloo processes."""

from __future__ import annotations

import pytest

from tests.gloo_ranks import run_ranks

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def ep2_results() -> list[dict[str, object]]:
    return run_ranks("tests.adapters.ep_worker")


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        "mixtral_aux",
        "mixtral_delay",
        "qwen2_moe_mixed_aux_delay",
        "deepseek_v3",
        "deepseek_v3_delay",
        "gpt_oss",
        "gpt_oss_delay",
    ],
)
def test_ep2_matches_transformers_and_overlap_is_exact(
    ep2_results: list[dict[str, object]], case: str
) -> None:
    rows = [r for r in ep2_results if r["case"] == case]
    assert sorted(int(str(r["rank"])) for r in rows) == [0, 1]
    for r in rows:
        assert r["ok"], r


@pytest.mark.slow
def test_ep2_shard_then_gather_restores_weights(ep2_results: list[dict[str, object]]) -> None:
    rows = [r for r in ep2_results if r["case"] == "shard_gather"]
    assert len(rows) == 2
    for r in rows:
        assert r["ok"], r
        assert r["local_experts"] == r["num_local_experts"] == 2
