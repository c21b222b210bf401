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
    steps = [int(x) for x in re.findall(r"step +(\d+): loss", done.stdout)]
    assert steps == [1, 2, 3], done.stdout
    # the self-check as a table: a header row, then a row per block structure
    assert re.search(
        r"\n  block class +blocks +largest rel\. difference +probe dtype\n", done.stdout
    )
    assert re.search(r"\n  \w+Block +[0-9, ]+ +[0-9.e+-]+ +float32\n", done.stdout), done.stdout
    assert "autocast" not in done.stderr, done.stderr
