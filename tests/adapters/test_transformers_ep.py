"""The transformers adapter with expert parallelism over two real gloo processes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def ep2_results() -> list[dict[str, object]]:
    port = str(_free_port())
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            OMP_NUM_THREADS="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.adapters.ep_worker"],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results: list[dict[str, object]] = []
    for rank, proc in enumerate(procs):
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, f"rank {rank} failed:\n{err}"
        results += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return results


@pytest.mark.slow
@pytest.mark.parametrize("case", ["mixtral_aux", "mixtral_delay", "qwen2_moe_mixed_aux_delay"])
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
