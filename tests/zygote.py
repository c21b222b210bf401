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
``PYTHONPATH`` is set as the interpreter would set it (``sys.path``); a launch whose
environment differs from the zygote's otherwise in what is read at start-up (``PYTHON*``,
``TORCH*``, ``OMP_*``, ...) gets a plain subprocess, as does every launch with
``TESTS_FRESH_PROCESSES=1``. torchrun (``python -m torch.distributed.run``) forked so has its
ranks forked too: its ``SubprocessHandler`` asks the zygotes, over their sockets, for
``python -u script`` as it would start it (its own session, its standard streams, its
environment); the launcher's watching, signals and exit statuses are as with its own
processes. The zygotes end with the session (their input closes).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
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
otherwise than the zygote had them needs a fresh interpreter..."""
RUNTIME = ("PYTHONPATH", "PYTHONUNBUFFERED", "TORCHELASTIC_", "TORCH_NCCL_")
"""... but these: ``PYTHONPATH`` and ``-u`` are set in the forked process as the interpreter
sets them, torchrun's own variables are read when used."""


def startup(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """What of ``env`` an interpreter (with torch) reads when it starts."""
    return tuple(
        sorted(
            (k, v)
            for k, v in env.items()
            if k.startswith(STARTUP_PREFIXES) and not k.startswith(RUNTIME)
        )
    )


FRESH = "TESTS_FRESH_PROCESSES"
"""Set to 1: every worker a plain ``python -m`` subprocess (to compare, or to rule the
zygote out)."""


# --- the zygote's side ------------------------------------------------------------------------
def _send(message: dict[str, int]) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())


def _reported(request_id: int, code: int) -> None:
    _send({"id": request_id, "code": code})


def _report(conn: socket.socket, message: dict[str, int], *, last: bool = False) -> None:
    with contextlib.suppress(OSError):  # the asking launcher may have gone
        conn.send(json.dumps(message).encode())
    if last:
        conn.close()


def _serve(listener: socket.socket) -> dict[str, Any] | None:
    """Fork one process per request: a line on stdin (its pid and exit status reported on
    stdout, by the request's ``id``) or a message on ``listener`` with the standard streams'
    descriptors (reported on that connection). Returns the request in a forked process;
    ``None`` in the zygote at the end of its input (the processes still running killed)."""
    pending = b""
    children: dict[int, Callable[[int], None]] = {}
    conns: set[socket.socket] = set()

    def fork(request: dict[str, Any]) -> int:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # nothing of the zygote's stays open in the forked process
            listener.close()
            for conn in conns:
                conn.close()
        return pid

    while True:
        ready, _, _ = select.select([0, listener.fileno()], [], [], 0.05)
        if 0 in ready:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                for pid in children:
                    os.kill(pid, 9)
                return None
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request: dict[str, Any] = json.loads(line)
                pid = fork(request)
                if pid == 0:
                    return request
                children[pid] = functools.partial(_reported, request["id"])
                _send({"id": request["id"], "pid": pid})
        if listener.fileno() in ready:
            conn, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(conn, 1 << 22, 2)
            request = {**json.loads(message), "fds": fds}
            conns.add(conn)
            pid = fork(request)
            if pid == 0:
                return request
            for fd in fds:
                os.close(fd)
            _report(conn, {"pid": pid})

            def done(code: int, c: socket.socket = conn) -> None:
                conns.discard(c)
                _report(c, {"code": code}, last=True)

            children[pid] = done
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.pop(pid)(os.waitstatus_to_exitcode(status))


_BASE_PATH: list[str] = []
"""``sys.path`` of the zygote after its own ``PYTHONPATH`` entries."""


def _become(request: dict[str, Any]) -> None:
    """In the forked process: become ``python *request["argv"]`` and run it."""
    import random
    import runpy

    import torch

    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    if "fds" in request:  # the asking launcher's streams, its own session (as Popen starts it)
        for fd, given in zip((1, 2), request["fds"], strict=True):
            os.dup2(given, fd)
            os.close(given)
        os.setsid()
    else:
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
    if argv[0] == "-u" or os.environ.get("PYTHONUNBUFFERED"):  # unbuffered standard streams
        argv = argv[1:] if argv[0] == "-u" else argv
        for name in ("stdout", "stderr"):
            found = getattr(sys, name)
            raw = io.FileIO(found.fileno(), "w", closefd=False)
            setattr(
                sys, name, io.TextIOWrapper(raw, found.encoding, found.errors, write_through=True)
            )
    entries = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    pythonpath = [os.path.abspath(p) for p in entries] if os.environ.get("PYTHONPATH") else []
    if argv[0] == "-m":  # python -m module args: the module's path set as argv[0] by runpy
        sys.argv = argv[1:]
        sys.path[:] = [os.getcwd(), *pythonpath, *_BASE_PATH]
        if argv[1] == "torch.distributed.run" and "workers" in request:
            _fork_torchrun_ranks(request["workers"], request["startup"])
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:  # python script args
        sys.argv = argv
        sys.path[:] = [os.path.dirname(os.path.abspath(argv[0])), *pythonpath, *_BASE_PATH]
        runpy.run_path(argv[0], run_name="__main__")


class ForkedPopen:
    """In a forked torchrun: a rank forked by a zygote, as much of :class:`subprocess.Popen`
    as torch's ``SubprocessContext`` uses (``pid``, ``poll``, ``wait``, signals)."""

    def __init__(self, address: str, request: dict[str, Any], fds: list[int]) -> None:
        self.args = request["argv"]
        self.returncode: int | None = None
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._conn.connect(address)
        socket.send_fds(self._conn, [json.dumps(request).encode()], fds)
        self.pid: int = json.loads(self._conn.recv(1 << 16))["pid"]

    def _read(self) -> None:
        message = self._conn.recv(1 << 16)
        self.returncode = json.loads(message)["code"] if message else -9
        self._conn.close()

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self._read()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self._read()
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _fork_torchrun_ranks(addresses: list[str], zygote_startup: list[list[str]]) -> None:
    """Have torchrun's ``SubprocessHandler`` ask the zygotes at ``addresses`` (local rank
    ``i``: the ``i``-th, modulo) for ``python -u script ...`` where that interpreter would
    start as they did; anything else it starts itself."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import (
        subprocess_handler as handler,
    )

    own = handler.SubprocessHandler._popen
    expected = tuple(tuple(kv) for kv in zygote_startup)

    def popen(self: Any, args: tuple[str, ...], env: dict[str, str]) -> Any:
        script = len(args) > 2 and args[:2] == (sys.executable, "-u") and args[2].endswith(".py")
        if not script or startup(env) != expected:
            return own(self, args, env)
        fds = [
            f.fileno() if f is not None else n for f, n in ((self._stdout, 1), (self._stderr, 2))
        ]
        request = {"argv": list(args[1:]), "env": env, "cwd": os.getcwd()}
        return ForkedPopen(addresses[self.local_rank_id % len(addresses)], request, fds)

    setattr(handler.SubprocessHandler, "_popen", popen)  # noqa: B010 - patched in this process


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
        self.address = tempfile.mktemp(prefix="zygote-", suffix=".sock")
        """Its socket (forked torchruns ask it for their ranks there)."""
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.zygote", self.address, *PRELOAD],
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
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.address)


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
    tests), unless :data:`FRESH`."""
    if os.environ.get(FRESH) != "1":
        for index in indices:
            _zygote(env, index)


TORCHRUN_RANKS = 4
"""The zygotes a forked torchrun's ranks fork from (local rank ``i``: the ``i``-th, modulo)."""


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


if __name__ == "__main__":
    import importlib

    listening = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listening.bind(sys.argv[1])  # before the imports: a launcher may connect meanwhile
    listening.listen(64)
    for name in sys.argv[2:]:
        importlib.import_module(name)
    own = os.environ.get("PYTHONPATH")
    _BASE_PATH[:] = sys.path[1 + (len(own.split(os.pathsep)) if own else 0) :]
    found = _serve(listening)
    if found is None:
        os._exit(0)  # the zygote: nothing of its own to tear down
    _become(found)
