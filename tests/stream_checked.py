"""Run a gloo test worker under the stream-order checker and print the checker's counters.

``python -m tests.stream_checked`` with ``STREAM_CHECKED_WORKER`` naming a worker module
(one whose ``main()`` runs one rank, as ``tests/gloo_ranks.py`` launches them) and
``MOE_OVERLAP_STREAM_CHECK=1`` in the environment: the engine's import starts the checker
for the whole process and the worker's ``main()`` runs under it; then the checker checks
the releases still pending and this prints one JSON line,
``{"stream_check": RANK, "checked_ops": ..., "cross_stream_storages": ...}``.

A :class:`~moe_overlap.streams.StreamOrderError` ends the rank at once, its traceback on
stderr (:func:`fail_fast`): raised inside a schedule, the error would otherwise go to the
step's consensus (pipelining) or leave the peers in a collective, and every rank would wait
for the launch's timeout, which reports no rank's stderr.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import ParamSpec, TypeVar, cast

from moe_overlap.engine._stream_check import active_checker
from moe_overlap.streams import StreamOrderChecker, StreamOrderError
from tests.gloo_ranks import exit_worker

WORKER_ENV = "STREAM_CHECKED_WORKER"

P = ParamSpec("P")
R = TypeVar("R")


def checker() -> StreamOrderChecker:
    """The process-wide checker ``MOE_OVERLAP_STREAM_CHECK=1`` started."""
    found = active_checker()
    if found is None:
        raise AssertionError(
            "no stream-order checker in force: set MOE_OVERLAP_STREAM_CHECK=1 in the "
            "worker's environment (read when moe_overlap.engine is imported)"
        )
    return found


def _exit_on_error(method: Callable[P, R]) -> Callable[P, R]:
    @functools.wraps(method)
    def checked(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return method(*args, **kwargs)
        except StreamOrderError:
            traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    return checked


def fail_fast(c: StreamOrderChecker) -> None:
    """Make every :class:`StreamOrderError` ``c`` raises end the process (exit status 1)
    with its traceback: each entry point that checks (an operator, a wait, a release, the
    final check) on this instance."""
    for name in ("on_op", "join", "release", "finish"):
        setattr(c, name, _exit_on_error(getattr(c, name)))


def main() -> None:
    c = checker()  # before the worker runs: it must run checked
    fail_fast(c)
    module = importlib.import_module(os.environ[WORKER_ENV])
    worker_main = cast(Callable[[], None], module.main)
    worker_main()
    c.finish()  # the releases since the last wait
    row = {
        "stream_check": int(os.environ["RANK"]),
        "checked_ops": c.checked_ops,
        "cross_stream_storages": c.cross_stream_storages,
    }
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    exit_worker(main)
