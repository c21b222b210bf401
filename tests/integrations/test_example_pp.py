"""``examples/train_pp_ep.py`` runs under torchrun as documented and matches torch's run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.gloo_ranks import torchrun

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_pp_ep.py"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("procs", "argv"),
    [
        pytest.param(
            4,
            [],
            marks=pytest.mark.skipif(
                torch.__version__.startswith("2.11"),
                reason="torch 2.11 DualPipeV warm-up sends to the same rank, which gloo refuses",
            ),
        ),
        (2, ["--ep", "1", "--schedule", "interleaved", "--delay-wgrad"]),
    ],
)
def test_train_pp_ep(procs: int, argv: list[str], tmp_path: Path) -> None:
    stdout = torchrun(
        SCRIPT, procs, "--steps", "3", "--timeline", str(tmp_path), *argv, timeout=180
    )
    rows = re.findall(r"step (\d): losses ([0-9. ]+) \| matches torch's schedule: (\w+)", stdout)
    assert [r[0] for r in rows] == ["1", "2", "3"], stdout
    assert all(r[2] == "True" for r in rows), stdout
    means = [sum(map(float, r[1].split())) / 4 for r in rows]
    assert means[-1] < means[0], stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"rank{r}.json" for r in range(procs)]
