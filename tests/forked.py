"""Test processes forked from zygotes (:mod:`tests.zygote`), for the session: the fresh
interpreter ``python -m module`` or ``python script.py`` would be, without the seconds of
importing torch again (a gloo rank spends a few CPU seconds importing torch,
``torch.distributed.pipelining`` and the like before its first line of work; a session
starts dozens on two cores).

:func:`start` (``Popen``-like) and :func:`run` (``subprocess.run``-like) fork from zygote
``index`` of those that start as the process's environment says (one per rank index: the
ranks of a launch keep distinct string-hash seeds, as separate interpreters have); a
zygote starts the first time it is asked for (or ahead, :func:`prestart`) and ends with
the session. Another command, an environment a zygote cannot give (:func:`tests.zygote.startup`),
a machine with a CUDA device, or ``TESTS_FRESH_PROCESSES=1`` gets a plain subprocess.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from tests.zygote import PRELOAD, startup

ROOT = Path(__file__).resolve().parents[1]

FRESH = "TESTS_FRESH_PROCESSES"
"""Set to 1: every process a plain subprocess (to compare, or to rule the zygotes out)."""


class Forked:
    """A forked worker, as much of :class:`subprocess.Popen` as ``gloo_ranks`` uses:
    :meth:`poll`, :meth:`kill`, :meth:`communicate` (its output and errors, once it ended).
    Asked for at once; forked when its zygote has imported what it preloads."""

    def __init__(self, folder: Path) -> None:
        self._folder = folder
        self.pid = 0
        self.returncode: int | None = None
        self.failure = ""
        """Why it never ran, when its zygote ended first (read by :meth:`communicate`)."""
        self._started = threading.Event()
        self._ended = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def kill(self) -> None:
        self._started.wait()
        if self.returncode is None and self.pid:
            with contextlib.suppress(ProcessLookupError):  # ended since
                os.kill(self.pid, 9)

    def communicate(self) -> tuple[str, str]:
        self._ended.wait()
        found = []
        for name in ("out", "err"):
            path = self._folder / name
            found.append(path.read_text(errors="replace") if path.exists() else "")
            path.unlink(missing_ok=True)
        self._folder.rmdir()
        return found[0], found[1] + self.failure

    def _ran(self, code: int, failure: str = "") -> None:
        self.failure = failure
        self.returncode = code
        self._started.set()
        self._ended.set()


class Zygote:
    """One zygote process (``python -m tests.zygote``) and the processes it forked."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self._folder = Path(tempfile.mkdtemp(prefix="zygote-"))
        self.address = str(self._folder / "sock")
        """Its socket (forked torchruns ask it for their ranks there)."""
        # Without PYTHONPATH (each forked process sets its own): an interpreter started with
        # it skips a .pth entry it already holds (an editable install of the same src), so
        # its path less the PYTHONPATH entries would lack what a process without it finds.
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.zygote", self.address, *PRELOAD],
            cwd=ROOT,
            env={k: v for k, v in env.items() if k != "PYTHONPATH"},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self._lock = threading.Lock()
        self._next = 0
        self._workers: dict[int, Forked] = {}
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            message: dict[str, int] = json.loads(line)
            with self._lock:
                worker = self._workers[message["id"]]
                if "code" in message:
                    del self._workers[message["id"]]
            if "pid" in message:
                worker.pid = message["pid"]
                worker._started.set()
            else:
                worker._ran(message["code"])
        with self._lock:  # the zygote ended: what it had not reported never will be
            stranded, self._workers = list(self._workers.values()), {}
        for worker in stranded:
            worker._ran(-9, f"\ntests.zygote: its zygote ended (status {self._proc.wait()}).\n")

    def start(self, argv: list[str], env: dict[str, str], cwd: Path, **extra: object) -> Forked:
        """Ask for ``python *argv`` (see the module doc); returns at once."""
        worker = Forked(Path(tempfile.mkdtemp(prefix="forked-")))
        request = {
            "argv": argv,
            "env": env,
            "cwd": str(cwd),
            "out": str(worker._folder / "out"),
            "err": str(worker._folder / "err"),
            **extra,
        }
        assert self._proc.stdin is not None
        with self._lock:
            self._next += 1
            self._workers[self._next] = worker
            try:
                self._proc.stdin.write((json.dumps({"id": self._next, **request}) + "\n").encode())
                self._proc.stdin.flush()
            except (BrokenPipeError, ValueError):  # ended (or closed): the reader says why
                pass
        return worker

    def close(self) -> None:
        """End the input (the zygote then kills what it forked and exits) and wait for it."""
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        self._proc.wait(timeout=30)
        self._reader.join(timeout=30)
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        shutil.rmtree(self._folder, ignore_errors=True)


_zygotes: dict[tuple[int, tuple[tuple[str, str], ...]], Zygote] = {}
_zygotes_lock = threading.Lock()


def _zygote(env: dict[str, str], index: int) -> Zygote:
    """Zygote ``index`` of the interpreters that start as ``env`` says (started if none)."""
    key = (index, startup(env))
    with _zygotes_lock:
        zygote = _zygotes.get(key)
        if zygote is None or not zygote.alive:
            zygote = _zygotes[key] = Zygote(env)
    return zygote


def prestart(env: dict[str, str], indices: range) -> None:
    """Start the zygotes ``indices`` for ``env`` now (their imports beside the first
    tests), unless :data:`FRESH` or on a machine with CUDA."""
    if os.environ.get(FRESH) != "1" and not _has_cuda():
        for index in indices:
            _zygote(env, index)


TORCHRUN_RANKS = 4
"""The zygotes a forked torchrun's ranks fork from (local rank ``i``: the ``i``-th, modulo)."""


@functools.cache
def _has_cuda() -> bool:
    """A CUDA device here: processes start fresh (a rank forked from a zygote on a GPU
    machine finds CUDA poisoned for forks, "Cannot re-initialize CUDA in forked subprocess";
    the zygotes are for CI's two CPU cores)."""
    import torch

    return torch.cuda.is_available()


def _forkable(argv: list[str]) -> bool:
    """``python -m module ...`` or ``python script.py ...`` with this interpreter."""
    if len(argv) < 2 or argv[0] != sys.executable:
        return False
    return (argv[1] == "-m" and len(argv) > 2) or argv[1].endswith(".py")


def start(
    argv: list[str], env: dict[str, str], *, cwd: Path, index: int = 0
) -> Forked | subprocess.Popen[str]:
    """``argv`` (``[sys.executable, "-m", module, ...]`` or ``[sys.executable, script, ...]``)
    with ``env`` in ``cwd``, at once: forked from zygote ``index`` of the interpreters that
    start as ``env`` says (started the first time it is asked for), else (another ``argv``,
    or :data:`FRESH`) a plain subprocess (text output)."""
    if os.environ.get(FRESH) != "1" and not _has_cuda() and _forkable(argv):
        extra: dict[str, object] = {}
        if argv[1:3] == ["-m", "torch.distributed.run"]:  # its ranks forked too
            extra["workers"] = [_zygote(env, i).address for i in range(TORCHRUN_RANKS)]
            extra["startup"] = startup(env)
        return _zygote(env, index).start(argv[1:], env, cwd, **extra)
    return subprocess.Popen(
        argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def run(
    argv: list[str], *, timeout: float, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(argv, capture_output=True, text=True, check=False, ...)``, the process
    forked from a zygote (:func:`start`) where it can be."""
    proc = start(argv, dict(os.environ) if env is None else env, cwd=cwd or Path.cwd())
    out: list[tuple[str, str]] = []

    def read() -> None:
        out.append(proc.communicate())

    reader = threading.Thread(target=read)
    reader.start()
    reader.join(timeout)
    if reader.is_alive():
        proc.kill()
        reader.join()
        raise subprocess.TimeoutExpired(argv, timeout, out[0][0], out[0][1])
    code = proc.poll()
    assert code is not None
    return subprocess.CompletedProcess(argv, code, out[0][0], out[0][1])


@atexit.register
def _close() -> None:
    for zygote in _zygotes.values():  # every input ended first: they exit side by side
        if zygote._proc.stdin is not None:
            zygote._proc.stdin.close()
    for zygote in _zygotes.values():
        zygote.close()
