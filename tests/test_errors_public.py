"""The errors are shown from their public module, and survive pickling (across processes)."""

from __future__ import annotations

import pickle
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

from moe_overlap import errors
from moe_overlap.errors import ConfigError, IntegrationError, MoeOverlapError, ScheduleError

ROOT = Path(__file__).resolve().parent.parent


def _instance(cls: type[MoeOverlapError]) -> MoeOverlapError:
    if cls is ScheduleError:
        return ScheduleError("step 3 failed", position="step 3: f.L0.mlp.F@comp")
    return cls("the message")


@pytest.mark.parametrize("name", errors.__all__)
def test_error_is_named_by_its_public_module(name: str) -> None:
    cls = getattr(errors, name)
    assert cls.__module__ == "moe_overlap.errors"
    assert getattr(sys.modules[cls.__module__], cls.__qualname__) is cls
    shown = "".join(traceback.format_exception_only(type(_instance(cls)), _instance(cls)))
    assert shown.startswith(f"moe_overlap.errors.{name}: "), shown


@pytest.mark.parametrize("name", errors.__all__)
def test_error_pickles(name: str) -> None:
    cls = getattr(errors, name)
    error = _instance(cls)
    if sys.version_info >= (3, 11):
        error.add_note("a note")
    data = pickle.dumps(error)
    assert b"moe_overlap.errors" in data
    assert b"_errors" not in data
    back = pickle.loads(data)
    assert type(back) is cls
    assert back.args == error.args
    assert back.__dict__ == error.__dict__  # ScheduleError's position, the notes


def test_an_error_raised_in_a_child_process_reads_from_the_public_module() -> None:
    """The traceback a user sees names ``moe_overlap.errors``, never the private module."""
    code = "from moe_overlap import Microbatch\nMicrobatch(input_ids='not a tensor')\n"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("moe_overlap.errors.ConfigError: Microbatch.input_ids"), last
    assert "._errors" not in done.stderr


def test_the_hierarchy_is_unchanged() -> None:
    assert issubclass(ConfigError, ValueError)
    assert issubclass(IntegrationError, TypeError)
    assert issubclass(ScheduleError, RuntimeError)
    with pytest.raises(ValueError, match="the message"):
        raise ConfigError("the message")
