"""``examples/train_pp_ep.py`` runs under torchrun as documented and matches torch's run."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(procs),
            str(SCRIPT),
            "--steps",
            "3",
            "--timeline",
            str(tmp_path),
            *argv,
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr
    rows = re.findall(
        r"step (\d): losses ([0-9. ]+) \| matches torch's schedule: (\w+)", done.stdout
    )
    assert [r[0] for r in rows] == ["0", "1", "2"], done.stdout
    assert all(r[2] == "True" for r in rows), done.stdout
    means = [sum(map(float, r[1].split())) / 4 for r in rows]
    assert means[-1] < means[0], done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"rank{r}.json" for r in range(procs)]
