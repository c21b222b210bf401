"""Run a test worker module as real gloo ranks and collect the JSON lines they print."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def run_ranks(module: str, *, world: int = 2, timeout: float = 180) -> list[dict[str, object]]:
    """``python -m module`` once per rank (``RANK``, ``WORLD_SIZE``, ``MASTER_*`` set).

    Fails with the rank's stderr when one exits non-zero; returns every rank's JSON lines.
    """
    port = str(_free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", module],
            cwd=ROOT,
            env=dict(
                os.environ,
                RANK=str(rank),
                WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                OMP_NUM_THREADS="1",
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    results: list[dict[str, object]] = []
    for rank, proc in enumerate(procs):
        out, err = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, f"{module} rank {rank} failed:\n{err}"
        results += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return results
