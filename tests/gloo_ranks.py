"""Run a test worker module as real gloo ranks and collect the JSON lines they print."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

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


def torchrun(script: Path, procs: int, *argv: str, timeout: float = 240) -> str:
    """``torchrun --nproc-per-node procs script argv`` on CPU (gloo); its stdout.

    Fails with its stderr when it exits non-zero.
    """
    done = subprocess.run(
        [
            *(sys.executable, "-m", "torch.distributed.run"),
            *("--nproc-per-node", str(procs), str(script), *argv),
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "src")},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def exit_worker(main: Callable[[], None]) -> NoReturn:
    """Run a worker's ``main`` and leave without interpreter teardown.

    At teardown gloo's background threads can abort the process ("terminate called without
    an active exception") after the work is done and reported, in roughly one run of
    five to eight; the exit status must say only whether ``main`` succeeded.
    """
    code = 0
    try:
        main()
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
