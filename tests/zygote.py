"""A *zygote*: an interpreter that imported torch and torch.distributed once and forks
test processes, each of which becomes what a fresh ``python ...`` would be.

``python -m tests.zygote SOCKET MODULE...`` imports the modules (:data:`PRELOAD`, torch's
own: nothing of moe_overlap, whose switches are read at import, nor of the tests) and then
forks one process per request, a JSON line on its stdin (from the session,
:mod:`tests.forked`; pid and exit status reported on its stdout) or a message on its
socket with the standard streams' descriptors (from a forked torchrun asking for a rank;
reported on that connection). The forked process becomes ``python *argv`` (``-m module``,
``script.py``, ``-u``): its own environment (replaced whole), working directory,
``sys.argv``, ``sys.path`` (``PYTHONPATH`` set as the interpreter sets it),
``sys.dont_write_bytecode`` (from ``PYTHONDONTWRITEBYTECODE``), standard streams
(the asker's, or files; input from ``/dev/null``), its own session for a torchrun rank (as
torchrun starts one) and fresh seeds (Python's ``random``, torch's default generator); it
runs the module or script as ``__main__`` and ends as that interpreter would (exit status,
traceback, ``atexit``). A torchrun (``-m torch.distributed.run``) forked so has its
``SubprocessHandler`` ask the zygotes for its ranks' ``python -u script`` where they start as
it would; its watching, signals and exit statuses are as with its own processes. At the
end of its stdin the zygote kills what it forked and exits.
"""

from __future__ import annotations

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
from collections.abc import Callable, Mapping
from typing import Any

PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.device_mesh",
    "torch.distributed.tensor",
    "torch.distributed.pipelining",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    # torch.compile's compiler (imported by any torch.compile call, e.g. at the import of
    # torchtitan's attention: most of a torchtitan rank's import; no thread, no process).
    "torch._inductor.compile_fx",
)
"""What a zygote imports before it forks."""

STARTUP_PREFIXES = ("PYTHON", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "LD_", "MALLOC")
"""Environment variables read when the interpreter or torch starts: a process whose
environment has them otherwise than a zygote's needs another zygote (or none)..."""
RUNTIME = (
    "PYTHONPATH",
    "PYTHONUNBUFFERED",
    "PYTHONDONTWRITEBYTECODE",
    "TORCHELASTIC_",
    "TORCH_NCCL_",
)
"""... but these: ``PYTHONPATH``, ``-u`` and ``PYTHONDONTWRITEBYTECODE``
(``sys.dont_write_bytecode``) are set in the forked process as the interpreter sets them,
torchrun's own variables are read when used (a session whose environment sets
``PYTHONDONTWRITEBYTECODE`` shares its zygotes with the scripts' clean environment)."""


def startup(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """What of ``env`` an interpreter (with torch) reads when it starts."""
    return tuple(
        sorted(
            (k, v)
            for k, v in env.items()
            if k.startswith(STARTUP_PREFIXES) and not k.startswith(RUNTIME)
        )
    )


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
    sys.dont_write_bytecode = bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))
    argv: list[str] = request["argv"]
    if argv[0] == "-u" or os.environ.get("PYTHONUNBUFFERED"):  # unbuffered standard streams
        argv = argv[1:] if argv[0] == "-u" else argv
        for name in ("stdout", "stderr"):
            found = getattr(sys, name)
            raw = io.FileIO(found.fileno(), "w", closefd=False)
            setattr(
                sys, name, io.TextIOWrapper(raw, found.encoding, found.errors, write_through=True)
            )
    own = os.environ.get("PYTHONPATH")  # its entries made absolute, as the interpreter does
    pythonpath = [os.path.abspath(p) for p in own.split(os.pathsep)] if own else []
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
