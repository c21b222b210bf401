"""A process forked from a zygote (:mod:`tests.forked`) finds what a fresh interpreter
would, whichever environment started the zygote it shares."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import forked

ROOT = Path(__file__).resolve().parents[1]


def _path_of(run: subprocess.CompletedProcess[str]) -> set[str]:
    assert run.returncode == 0, run.stderr
    return set(json.loads(run.stdout.strip().splitlines()[-1]))


@pytest.mark.skipif(forked._has_cuda(), reason="processes start fresh on a CUDA machine")
def test_a_forked_process_s_path_is_a_fresh_interpreter_s(tmp_path: Path) -> None:
    """First a process with ``PYTHONPATH`` set to the library's source (which may start the
    zygote), then one without: its ``sys.path`` holds every entry a fresh interpreter's
    does (an editable install's entry went missing when the zygote had started with it)."""
    script = tmp_path / "path.py"
    script.write_text("import json, sys\nprint(json.dumps(sys.path))\n")
    bare = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with_path = {**bare, "PYTHONPATH": str(ROOT / "src")}
    argv = [sys.executable, str(script)]
    first = forked.run(argv, env=with_path, timeout=120)
    fresh_first = subprocess.run(argv, env=with_path, capture_output=True, text=True, check=False)
    assert _path_of(first) == _path_of(fresh_first)
    second = forked.run(argv, env=bare, timeout=120)
    fresh = subprocess.run(argv, env=bare, capture_output=True, text=True, check=False)
    assert _path_of(second) == _path_of(fresh)
