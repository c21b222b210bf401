"""The checkpoint launches, shared by ``test_checkpoint.py`` and ``test_checkpoint_pp.py``.

Every layout saves in one launch of four gloo ranks and loads in a second, fresh one
(``ckpt_launch_worker.py``), so the two files together start eight processes; the
single-process (PP=1 x EP=1) side runs in this process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.gloo_ranks import run_ranks
from tests.torch_state import deterministic_algorithms


@dataclass(frozen=True)
class Layouts:
    """The shared checkpoint folder and each launch's JSON rows."""

    folder: Path
    whole_keys: set[str]
    """The whole reference model's state-dict keys (``pp1/``)."""
    save: list[dict[str, Any]]
    load: list[dict[str, Any]]

    def rows(self, launch: str, check: str) -> list[dict[str, Any]]:
        """One launch's rows of ``check``, by global rank."""
        rows = self.save if launch == "save" else self.load
        return sorted((r for r in rows if r["check"] == check), key=lambda r: int(r["rank"]))


def _launch(phase: str, folder: Path) -> list[dict[str, Any]]:
    os.environ["CKPT_DIR"], os.environ["CKPT_PHASE"] = str(folder), phase
    try:
        rows = run_ranks("tests.integrations.ckpt_launch_worker", world=4, timeout=600)
    finally:
        del os.environ["CKPT_DIR"], os.environ["CKPT_PHASE"]
    return [dict(r) for r in rows]


@pytest.fixture(scope="session")
def checkpoint_layouts(tmp_path_factory: pytest.TempPathFactory) -> Layouts:
    pytest.importorskip("transformers")
    from tests.integrations.ckpt_pp_worker import save_whole

    folder = tmp_path_factory.mktemp("checkpoints")
    with deterministic_algorithms():  # put back after: a session fixture's change outlives tests
        keys = save_whole(str(folder))
    return Layouts(folder, keys, _launch("save", folder), _launch("load", folder))
