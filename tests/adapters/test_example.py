"""``examples/train_mixtral.py`` runs and trains, at EP=1 and EP=2 (gloo)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_mixtral.py"


@pytest.mark.slow
@pytest.mark.parametrize("argv", [["--ep", "1"], ["--ep", "2", "--delay-wgrad"]])
def test_train_mixtral(argv: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", "4", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    losses = [float(x) for x in re.findall(r"step +\d+: loss ([0-9.]+)", done.stdout)]
    assert len(losses) == 4 and losses[-1] < losses[0], done.stdout
    assert "gathered checkpoint" in done.stdout
