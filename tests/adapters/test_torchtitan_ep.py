"""The torchtitan adapter on torchtitan's own expert parallelism (EP=2, two gloo processes).

The worker (:mod:`tests.adapters.titan_ep_worker`) says how EP is applied.
"""

from __future__ import annotations

from typing import cast

import pytest

from tests.gloo_ranks import run_ranks

pytest.importorskip("torchtitan")


@pytest.fixture(scope="module")
def titan_ep2() -> list[dict[str, object]]:
    return run_ranks("tests.adapters.titan_ep_worker")


def _rows(results: list[dict[str, object]], case: str) -> list[dict[str, object]]:
    rows = [r for r in results if r["case"] == case]
    assert sorted(int(str(r["rank"])) for r in rows) == [0, 1]
    return rows


@pytest.mark.slow
def test_ep2_overlap_is_bit_identical_to_plain(titan_ep2: list[dict[str, object]]) -> None:
    for r in _rows(titan_ep2, "overlap_vs_plain"):
        assert r["ok"], r
        # torchtitan's EP, not a local fallback: its all-to-all dispatcher on the ep
        # mesh, experts sharded over it.
        assert r["dispatcher"] == "AllToAllTokenDispatcher"
        assert "ep=2" in str(r["ep_mesh"])
        assert r["expert_weight"] == "DTensor"
        assert r["placements"] == "(Shard(dim=0),)"
        assert r["local_experts"] == r["num_local_experts"] == 4
        assert r["global_experts"] == 8
        assert r["pending_after"] == 0


@pytest.mark.slow
def test_ep2_matches_ep1_on_the_same_global_model(titan_ep2: list[dict[str, object]]) -> None:
    for r in _rows(titan_ep2, "ep2_vs_ep1"):
        assert r["ok"], r
        assert r["loss_diff"] == 0.0, r  # forward is per token: the same bits


@pytest.mark.slow
def test_ep2_adapter_takes_the_parallelized_model_as_is(
    titan_ep2: list[dict[str, object]],
) -> None:
    """torchtitan's parallelize leaves its forward wrappers on every MoE's ``moe`` and
    ``routed_experts``; the adapter checks they do nothing under EP alone and honours them
    (the run above is on the model as it is)."""
    for r in _rows(titan_ep2, "overlap_vs_plain"):
        wrapped = [str(n) for n in cast("list[object]", r["instance_forwards"])]
        for layer in ("1", "2"):
            assert f"layers.{layer}.moe" in wrapped, wrapped
            assert f"layers.{layer}.moe.routed_experts" in wrapped, wrapped
        assert r["ok"], r


@pytest.mark.slow
def test_ep2_self_check_leaves_the_model_untouched(
    titan_ep2: list[dict[str, object]],
) -> None:
    for r in _rows(titan_ep2, "overlap_vs_plain"):
        assert r["self_check_touched"] == [], r["self_check_touched"]
