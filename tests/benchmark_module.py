"""``benchmarks/<name>.py`` imported in a test, as the scripts import each other."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def benchmark_module(name: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """``benchmarks/<name>.py`` imported as its scripts import each other (their folder on
    the path); the path, the environment and the benchmark modules it brought in are put
    back after the test."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # sys.path restored whole
    # bench_overlap.py sets it with setdefault at import; undone with the test.
    monkeypatch.setenv(
        "CUBLAS_WORKSPACE_CONFIG", os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    )
    before = set(sys.modules)
    module = importlib.import_module(name)
    for added in set(sys.modules) - before:
        where = getattr(sys.modules[added], "__file__", None)
        if where is not None and Path(where).parent == BENCHMARKS:
            monkeypatch.delitem(sys.modules, added)
    return module
