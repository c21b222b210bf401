"""Run a test worker module as real gloo ranks and collect the JSON lines they print."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NoReturn

from tests import forked

ROOT = Path(__file__).resolve().parents[1]
SCRIPT_ENV = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "src")}
"""The whole environment of :func:`torchrun` and of the benchmarks' smoke runs."""


def worker_env() -> dict[str, str]:
    """The environment :func:`run_ranks` starts from (before ``env`` and the rank's own),
    and other test workers forked from the same zygotes."""
    return dict(os.environ, OMP_NUM_THREADS="1")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def run_ranks(
    module: str,
    *,
    world: int = 2,
    timeout: float = 180,
    env: Mapping[str, str | None] | None = None,
) -> list[dict[str, object]]:
    """``python -m module`` once per rank (``RANK``, ``WORLD_SIZE``, ``MASTER_*`` set), in
    this process's environment updated by ``env`` (a ``None`` value unsets; unlike
    ``os.environ``, two launches at once do not share it); each rank forked from its zygote
    (:mod:`tests.forked`: a fresh interpreter's state without the seconds of importing
    torch again).

    Fails with the rank's stderr when one exits non-zero; returns every rank's JSON lines.
    """
    port = str(_free_port())
    base = {k: v for k, v in {**worker_env(), **(env or {})}.items() if v is not None}
    procs = [
        forked.start(
            [sys.executable, "-m", module],
            dict(
                base,
                RANK=str(rank),
                WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                OMP_NUM_THREADS="1",
            ),
            cwd=ROOT,
            index=rank,
        )
        for rank in range(world)
    ]
    # Read every rank's pipes in the background; a rank that fails ends the run at once
    # (its peers would wait for it until the timeout).
    outputs: list[tuple[str, str] | None] = [None] * world

    def read(rank: int) -> None:
        outputs[rank] = procs[rank].communicate()

    readers = [threading.Thread(target=read, args=(r,), daemon=True) for r in range(world)]
    for t in readers:
        t.start()
    deadline = time.monotonic() + timeout
    failed: int | None = None
    while failed is None and any(p.poll() is None for p in procs):
        failed = next((r for r, p in enumerate(procs) if p.poll() not in (None, 0)), None)
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    failed = next((r for r, p in enumerate(procs) if p.poll() not in (None, 0)), failed)
    for p in procs:
        if p.poll() is None:
            p.kill()
    for t in readers:
        t.join()
    if failed is not None:
        err = (outputs[failed] or ("", ""))[1]
        raise AssertionError(f"{module} rank {failed} failed (the others were stopped):\n{err}")
    hung = [r for r, p in enumerate(procs) if p.returncode != 0]
    assert not hung, f"{module} ranks {hung} did not finish in {timeout:g} s"
    results: list[dict[str, object]] = []
    for out in outputs:
        assert out is not None
        results += [json.loads(line) for line in out[0].splitlines() if line.startswith("{")]
    return results


def torchrun(script: Path, procs: int, *argv: str, timeout: float = 240) -> str:
    """``torchrun --nproc-per-node procs script argv`` on CPU (gloo); its stdout.

    Fails with its stderr when it exits non-zero.
    """
    done = forked.run(  # torchrun forked from a zygote, and its ranks (tests/forked.py)
        [
            *(sys.executable, "-m", "torch.distributed.run"),
            *("--nproc-per-node", str(procs), str(script), *argv),
        ],
        timeout=timeout,
        env=SCRIPT_ENV,
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
