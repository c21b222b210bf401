"""Shared fixtures: deterministic CPU runs; a test that leaves torch's process state changed
fails; ``--reverse-files`` (``make test-order``); ``debug_python``, an interpreter in debug
mode; ``ep2_launches`` and ``ep2_rows``, the EP=2 parity launches."""

from __future__ import annotations

import functools
import subprocess
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from moe_overlap.streams import reset_streams
from tests import forked
from tests.debug_interpreter import DebugInterpreter
from tests.gloo_ranks import SCRIPT_ENV, run_ranks, worker_env
from tests.parallel_runs import ParallelRuns
from tests.torch_state import TorchState


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--reverse-files",
        action="store_true",
        help="run the test files in reverse order (each file's tests in their own order): "
        "a test that passes only after another leaks state (`make test-order`)",
    )


LAUNCHING = {"tests.gloo_ranks", "tests.forked"}
"""What a test module imports (the module, or a function of it) when it launches workers."""
LAUNCHING_FIXTURES = {"ep2_launches", "ep2_rows", "checkpoint_layouts"}
"""The shared fixtures that launch workers."""


def _launching(item: pytest.Item) -> bool:
    """Whether ``item`` or its module launches workers (forked from zygotes)."""
    if LAUNCHING_FIXTURES & set(getattr(item, "fixturenames", ())):
        return True
    imported = vars(getattr(item, "module", None) or object).values()
    return any(
        (v.__name__ if isinstance(v, ModuleType) else getattr(v, "__module__", None)) in LAUNCHING
        for v in imported
    )


def pytest_collection_finish(session: pytest.Session) -> None:
    """When the selected tests of two modules or more launch workers, the zygotes they
    fork from (:mod:`tests.forked`) start now, importing torch beside the first tests
    instead of ahead of the first launch."""
    if session.config.option.collectonly:
        return
    modules = {item.path for item in session.items if _launching(item)}
    if len(modules) >= 2:
        forked.prestart(worker_env(), range(4))  # run_ranks' ranks 0-3
        # torchrun's launcher and ranks, the benchmarks' runs (the same zygotes where the
        # session's environment starts an interpreter as SCRIPT_ENV does)
        forked.prestart(SCRIPT_ENV, range(forked.TORCHRUN_RANKS))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--reverse-files"):
        return
    by_file: dict[Path, list[pytest.Item]] = {}
    for item in items:
        by_file.setdefault(item.path, []).append(item)
    items[:] = [item for path in reversed(by_file) for item in by_file[path]]


@pytest.fixture(autouse=True)
def _deterministic() -> Iterator[None]:
    """Every test runs seeded with deterministic algorithms on; the mode found is put back
    after, so the suite leaves torch as it found it (and fixtures of a wider scope, set up
    between tests, see the same mode whatever ran before)."""
    found = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    reset_streams()
    yield
    torch.use_deterministic_algorithms(found[0], warn_only=found[1])


@pytest.fixture(autouse=True)
def _torch_state_guard(_deterministic: None) -> Iterator[None]:
    """Fails a test that leaves torch's process state (:class:`TorchState`: thread counts,
    default dtype, deterministic mode, grad and inference mode, anomaly mode, ...) other
    than the suite set it, and puts it back, so later tests run as they would alone. Set up
    after ``_deterministic`` (it compares with the state that sets) and before the test's
    own fixtures, so it is torn down after them: what they restore is not a leak."""
    suite = TorchState.read()
    yield
    changed = suite.changes(TorchState.read())
    if not changed:
        return
    stuck = suite.restore()
    note = f" ({', '.join(stuck)} could not be put back)" if stuck else " (put back)"
    pytest.fail(
        "the test left torch's process state changed: "
        + "; ".join(changed)
        + note
        + ". Restore what a test changes (a context manager, try/finally or a fixture; "
        "tests/torch_state.py has some), or later tests run otherwise than alone.",
        pytrace=False,
    )


DebugPython = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture(scope="session")
def debug_python() -> Iterator[DebugPython]:
    """``debug_python(code, warnings_as_errors=True)``: ``code`` (dedented) run as
    ``MOE_OVERLAP_DEBUG=1 python [-W error::UserWarning] -c code`` would run it, in the
    session's one interpreter in debug mode (:mod:`tests.debug_interpreter`; started at the
    first call, and again after a snippet that ended it); its exit status and output."""
    found: list[DebugInterpreter] = []

    def run(code: str, *, warnings_as_errors: bool = True) -> subprocess.CompletedProcess[str]:
        if not found or not found[-1].alive:
            found.append(DebugInterpreter())
        return found[-1].run(textwrap.dedent(code), warnings_as_errors=warnings_as_errors)

    yield run
    for interpreter in found:
        interpreter.close()


EP2_DEBUG_TEST = "test_ep2_debug_first_step_check_compares_on_every_rank"
"""``tests/models/test_ep.py``'s test of the debug-mode launch."""


@pytest.fixture(scope="session")
def ep2_launches(request: pytest.FixtureRequest) -> Iterator[ParallelRuns[list[dict[str, object]]]]:
    """``tests/models/ep_worker.py`` on two gloo ranks: ``"plain"``, every case (and its
    refusals) in one launch, not in debug mode whatever the session's environment (the
    rows of ``tests/models/test_ep.py`` and of the chunked cases of
    ``tests/blocks/test_a2a_chunks.py``); ``"debug"``, two cases in debug mode (``test_ep``'s
    :data:`EP2_DEBUG_TEST`), started beside it when that test is selected."""
    plain: dict[str, str | None] = {"EP_CASES": None, "MOE_OVERLAP_DEBUG": None}
    debug: dict[str, str | None] = {
        "EP_CASES": "shared_delay,padded_aux_delay",
        "MOE_OVERLAP_DEBUG": "1",
    }
    jobs = {
        name: functools.partial(run_ranks, "tests.models.ep_worker", timeout=600, env=env)
        for name, env in (("plain", plain), ("debug", debug))
    }
    wanted = any(item.name == EP2_DEBUG_TEST for item in request.session.items)
    runs = ParallelRuns(jobs, ["plain", "debug"] if wanted else ["plain"])
    yield runs
    runs.close()


@pytest.fixture(scope="session")
def ep2_rows(ep2_launches: ParallelRuns[list[dict[str, object]]]) -> list[dict[str, object]]:
    """The rows of :func:`ep2_launches`' ``"plain"`` launch."""
    return ep2_launches.result("plain")
