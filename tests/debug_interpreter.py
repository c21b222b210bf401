"""One interpreter in debug mode (``MOE_OVERLAP_DEBUG=1``) for the debug-mode tests' snippets.

The switch is read when moe_overlap is imported, so those tests cannot run in the pytest
process; they need an interpreter in debug mode, not one each (each would pay the imports
again). :class:`DebugInterpreter` starts one (``tests/conftest.py``'s ``debug_python``
fixture: one per session, started when a test first asks) and runs each snippet as
``python -c`` would, in a fresh ``__main__`` namespace, with torch's RNG at its start-up
state, and puts back after it the warning filters and torch's process settings
(:class:`~tests.torch_state.TorchState`); a snippet that kills the interpreter fails with
its exit status, and the next one gets a new interpreter.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_DONE = "\x1esnippet done\x1e"
"""Starts the line the interpreter writes after each snippet (its exit status and output)."""


def serve() -> None:
    """The interpreter's loop: one JSON ``[code, warnings_as_errors]`` per stdin line."""
    import io
    import traceback
    import warnings

    import torch

    from tests.torch_state import TorchState

    rng = torch.get_rng_state()
    for line in sys.stdin:
        code, strict = json.loads(line)
        out, err = io.StringIO(), io.StringIO()
        state = TorchState.read()
        torch.set_rng_state(rng)
        status = 0
        with (
            warnings.catch_warnings(),
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
        ):
            if strict:  # as ``python -W error::UserWarning``
                warnings.filterwarnings("error", category=UserWarning)
            try:
                exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
            except SystemExit as e:
                status = e.code if isinstance(e.code, int) else int(e.code is not None)
            except BaseException:
                traceback.print_exc()
                status = 1
        state.restore()
        sys.stdout.write(_DONE + json.dumps([status, out.getvalue(), err.getvalue()]) + "\n")
        sys.stdout.flush()


class DebugInterpreter:
    """A started interpreter in debug mode; :meth:`run` a snippet, :meth:`close` at the end."""

    def __init__(self) -> None:
        env = {k: v for k, v in os.environ.items() if k != "MOE_OVERLAP_DEBUG"}
        env["MOE_OVERLAP_DEBUG"] = "1"
        # Keep the caller's path after ours (where beartype may be installed aside).
        env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT), str(ROOT / "src"), env.get("PYTHONPATH", "")]
        )
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "from tests.debug_interpreter import serve; serve()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._stderr: list[str] = []
        self._readers = [
            threading.Thread(target=self._read_stdout, daemon=True),
            threading.Thread(target=self._read_stderr, daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    def _read_stdout(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _read_stderr(self) -> None:
        assert self._proc.stderr is not None
        for line in self._proc.stderr:
            self._stderr.append(line)

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    def run(
        self, code: str, *, warnings_as_errors: bool = True, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        """``code`` run in the interpreter: its exit status (``-signal`` or 1 where the
        interpreter died or ``timeout`` passed: it is stopped), stdout and stderr."""
        assert self._proc.stdin is not None
        self._stderr.clear()
        extra: list[str] = []  # written past Python's sys.stdout (by C code)
        try:
            self._proc.stdin.write(json.dumps([code, warnings_as_errors]) + "\n")
            self._proc.stdin.flush()
            while True:
                line = self._lines.get(timeout=timeout)
                if line is None:
                    break
                if line.startswith(_DONE):
                    status, out, err = json.loads(line[len(_DONE) :])
                    return subprocess.CompletedProcess([], status, "".join(extra) + out, err)
                extra.append(line)
        except (BrokenPipeError, queue.Empty):
            pass
        self.close()
        status = self._proc.returncode if self._proc.returncode else 1
        return subprocess.CompletedProcess([], status, "".join(extra), "".join(self._stderr))

    def close(self) -> None:
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            with contextlib.suppress(BrokenPipeError):
                self._proc.stdin.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        for reader in self._readers:
            reader.join(timeout=10)
        for pipe in (self._proc.stdout, self._proc.stderr):
            if pipe is not None:
                pipe.close()
