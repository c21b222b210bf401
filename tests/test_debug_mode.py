"""Debug mode (``MOE_OVERLAP_DEBUG=1``): beartype on every call; off: beartype never imported.

Each check runs in a fresh interpreter, since the switch is read at import time.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(code: str, *, debug: bool) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "MOE_OVERLAP_DEBUG"}
    if debug:
        env["MOE_OVERLAP_DEBUG"] = "1"
    # Keep the caller's path after ours (where beartype may be installed aside, on a GPU box).
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-W", "error::UserWarning", "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
        check=False,
    )


def test_off_by_default_imports_no_beartype_and_wraps_nothing() -> None:
    out = run(
        """
        import sys, moe_overlap as m
        assert "beartype" not in sys.modules, "beartype imported"
        for name in m.__all__:
            assert not hasattr(getattr(m, name), "__wrapped__"), name
        print("ok")
        """,
        debug=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_debug_mode_checks_calls() -> None:
    out = run(
        """
        import sys, moe_overlap as m
        assert "beartype" in sys.modules
        assert hasattr(m.combined_1f1b, "__wrapped__")
        try:
            m.should_free_input(1, True, object(), 4)
        except m.TypeHintError as e:  # the library's own error (an IntegrationError)
            assert isinstance(e, m.IntegrationError) and isinstance(e, TypeError)
            assert "should_free_input" in str(e)
            print("ok")
        """,
        debug=True,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


@pytest.mark.slow
def test_debug_mode_step_is_still_exact() -> None:
    """A whole overlapped step under beartype: Protocol checks happen once per plan."""
    out = run(
        """
        import copy, torch
        from moe_overlap import ScheduleOptions, combined_1f1b
        from tests.toy_model import ToyConfig, ToyModel, grads, make_microbatches, plain_step
        config = ToyConfig(shared_expert=True)
        ref = ToyModel(config, "dmt")
        model = copy.deepcopy(ref)
        model.set_delay(True)
        mbs = make_microbatches(3, config)
        plain_step(ref, mbs)
        combined_1f1b(model, mbs, options=ScheduleOptions(delay_wgrad_compute=True))
        g, r = grads(model), grads(ref)
        assert all(torch.equal(g[k], r[k]) for k in g if g[k] is not None)
        print("ok")
        """,
        debug=True,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
