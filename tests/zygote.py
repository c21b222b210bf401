"""Fresh worker processes without their imports' seconds: forked from an interpreter that
imported torch and torch.distributed once (a *zygote*).

``python -m module`` for a gloo rank spends a few CPU seconds importing torch,
``torch.distributed.pipelining`` (with ``torch._dynamo``) and the like before its first line
of work; a session launches dozens of ranks on two cores. :func:`start` asks a zygote to
fork a process that then becomes what ``python -m module`` with ``env`` in ``cwd`` would be:
its own environment (replaced whole), working directory, ``sys.argv``, ``sys.path[0]``,
standard streams (output and errors to files, input from ``/dev/null``) and fresh seeds
(Python's ``random``, torch's default generator), then runs the module as ``__main__`` and
ends as that interpreter would (exit status, traceback, ``atexit``). moe_overlap itself is
never imported before the fork (its switches are read at import), nor anything but torch's
own modules (:data:`PRELOAD`).

One zygote per rank index (rank 0's processes fork from one, rank 1's from another, ...),
so the ranks of a launch keep distinct string-hash seeds, as separate interpreters have.
A launch whose environment differs from the zygote's in what is read at start-up (``PYTHON*``,
``TORCH*``, ``OMP_*``, ...) gets a plain subprocess, as does every launch with
``TESTS_FRESH_PROCESSES=1``. The zygotes end with the session (their input closes).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.device_mesh",
    "torch.distributed.tensor",
    "torch.distributed.pipelining",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
)
"""What a zygote imports before it forks: torch's, nothing of moe_overlap or the tests."""

STARTUP_PREFIXES = ("PYTHON", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "LD_", "MALLOC")
"""Environment variables read when the interpreter or torch starts: a launch that sets them
otherwise than the zygote had them needs a fresh interpreter."""

FRESH = "TESTS_FRESH_PROCESSES"
"""Set to 1: every worker a plain ``python -m`` subprocess (to compare, or to rule the
zygote out)."""


# --- the zygote's side ------------------------------------------------------------------------
def _send(message: dict[str, int]) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())


def _serve() -> dict[str, Any] | None:
    """Fork one process per request line on stdin and report its pid and exit status on
    stdout. Returns the request in a forked process; ``None`` in the zygote at the end of
    its input (the processes still running killed)."""
    pending = b""
    children: dict[int, int] = {}
    while True:
        ready, _, _ = select.select([0], [], [], 0.05)
        if ready:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                for pid in children:
                    os.kill(pid, 9)
                return None
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request: dict[str, Any] = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    return request
                children[pid] = request["id"]
                _send({"id": request["id"], "pid": pid})
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            _send({"id": children.pop(pid), "code": os.waitstatus_to_exitcode(status)})


def _become(request: dict[str, Any]) -> None:
    """In the forked process: become ``python *request["argv"]`` and run it."""
    import random
    import runpy

    import torch

    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, request["out"]), (2, request["err"])):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(opened, fd)
        os.close(opened)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    random.seed()
    torch.seed()
    argv: list[str] = request["argv"]
    if argv[0] == "-m":  # python -m module args: the module's path set as argv[0] by runpy
        sys.argv = argv[1:]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:  # python script args
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


# --- the session's side -----------------------------------------------------------------------
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
    """One zygote process (``python -m tests.zygote``) and the workers it forked."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.zygote", *PRELOAD],
            cwd=ROOT,
            env=env,
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

    def start(self, argv: list[str], env: dict[str, str], cwd: Path) -> Forked:
        """Ask for ``python *argv`` (see the module doc); returns at once."""
        worker = Forked(Path(tempfile.mkdtemp(prefix="forked-")))
        request = {
            "argv": argv,
            "env": env,
            "cwd": str(cwd),
            "out": str(worker._folder / "out"),
            "err": str(worker._folder / "err"),
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


_zygotes: dict[tuple[int, tuple[tuple[str, str], ...]], Zygote] = {}
_zygotes_lock = threading.Lock()


def _zygote(env: dict[str, str], index: int) -> Zygote:
    """Zygote ``index`` of the interpreters that start as ``env`` says (started if none)."""
    startup = tuple(sorted((k, v) for k, v in env.items() if k.startswith(STARTUP_PREFIXES)))
    with _zygotes_lock:
        zygote = _zygotes.get((index, startup))
        if zygote is None or not zygote.alive:
            zygote = _zygotes[index, startup] = Zygote(env)
    return zygote


def prestart(env: dict[str, str], indices: range) -> None:
    """Start the zygotes ``indices`` for ``env`` now (their imports beside the first
    tests), unless :data:`FRESH`."""
    if os.environ.get(FRESH) != "1":
        for index in indices:
            _zygote(env, index)


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
    if os.environ.get(FRESH) != "1" and _forkable(argv):
        return _zygote(env, index).start(argv[1:], env, cwd)
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


if __name__ == "__main__":
    import importlib

    for name in sys.argv[1:]:
        importlib.import_module(name)
    found = _serve()
    if found is None:
        os._exit(0)  # the zygote: nothing of its own to tear down
    _become(found)
