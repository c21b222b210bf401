"""``examples/train_torchtitan.py`` runs and trains (one process, with and without delayed
weight gradients)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_torchtitan.py"


@pytest.mark.slow
@pytest.mark.parametrize("argv", [[], ["--delay-wgrad", "--family", "qwen3"]])
def test_train_torchtitan(argv: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", "3", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    losses = [float(x) for x in re.findall(r"step +\d+: loss ([0-9.]+)", done.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0], done.stdout
    assert "self-check" in done.stdout
