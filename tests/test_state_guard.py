"""``tests/conftest.py``'s guard fails a test that leaves torch's process state changed and
puts the state back for the tests after it; a test that restores what it changed passes.
The inner runs use the suite's own fixtures, in this process (pytester's in-process run:
~0.05 s each; the suite's fixtures ran first in this process, so torch's lazy imports are
done and nothing the inner run would unload gets imported)."""

from __future__ import annotations

import pytest
import torch

pytest_plugins = ["pytester"]

CONFTEST = """
from tests.conftest import _deterministic, _torch_state_guard

__all__ = ["_deterministic", "_torch_state_guard"]
"""


def _run(pytester: pytest.Pytester, body: str) -> pytest.RunResult:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(body)
    # Hypothesis's plugin would import ~90 modules per run (pytester unloads them after).
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:hypothesispytest")


def test_a_leaked_thread_count_fails_the_test_and_is_put_back(pytester: pytest.Pytester) -> None:
    n = torch.get_num_threads()
    result = _run(
        pytester,
        f"""
        import torch

        def test_leaks():
            torch.set_num_threads({n + 1})

        def test_after_it():
            assert torch.get_num_threads() == {n}
        """,
    )
    # The guard fails in the leaking test's teardown: pytest reports that as an error of it.
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_leaks*",
            f"*the test left torch's process state changed: num_threads: {n} -> {n + 1} (put back)."
            " Restore what a test changes*",
        ]
    )
    assert torch.get_num_threads() == n


def test_each_setting_the_suite_sets_is_guarded(pytester: pytest.Pytester) -> None:
    """Turning off what the suite turns on (deterministic algorithms) is a leak too, as are
    the default dtype and grad mode; the message names each change."""
    result = _run(
        pytester,
        """
        import torch

        def test_leaks():
            torch.use_deterministic_algorithms(False)
            torch.set_default_dtype(torch.float64)
            torch.set_grad_enabled(False)

        def test_after_it():
            assert torch.are_deterministic_algorithms_enabled()
            assert torch.get_default_dtype() == torch.float32
            assert torch.is_grad_enabled()
        """,
    )
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*state changed: default_dtype: torch.float32 -> torch.float64;"
            " deterministic_algorithms: True -> False; grad_enabled: True -> False (put back)*"
        ]
    )
    assert torch.get_default_dtype() == torch.float32


def test_a_test_that_restores_what_it_changed_passes(pytester: pytest.Pytester) -> None:
    result = _run(
        pytester,
        """
        import torch
        import pytest

        from tests.torch_state import num_threads

        @pytest.fixture
        def float64():
            torch.set_default_dtype(torch.float64)
            yield
            torch.set_default_dtype(torch.float32)

        def test_restores(float64):
            assert torch.get_default_dtype() == torch.float64
            with num_threads(1), torch.no_grad():
                assert torch.get_num_threads() == 1
        """,
    )
    result.assert_outcomes(passed=1)
