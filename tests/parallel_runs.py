"""Jobs started ahead of the tests that read them, a few at a time (for subprocess runs of
one busy core each, which a serial test session would leave the other cores idle beside)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

import pytest

T = TypeVar("T")


class ParallelRuns(Generic[T]):
    """``jobs`` by name; those in ``ahead`` start at once, in that order, at most
    ``workers`` at a time (default: two, or one on a one-core machine); :meth:`result`
    waits for one (starting it if it was not ahead) and returns what it returned or
    raises what it raised. :meth:`close` waits for the started ones, drops the others."""

    def __init__(
        self,
        jobs: Mapping[str, Callable[[], T]],
        ahead: Iterable[str],
        *,
        workers: int | None = None,
    ) -> None:
        self._jobs = jobs
        self._pool = ThreadPoolExecutor(max_workers=workers or min(2, os.cpu_count() or 1))
        self._started: dict[str, Future[T]] = {}
        for name in ahead:
            self._start(name)

    def _start(self, name: str) -> Future[T]:
        if name not in self._started:
            self._started[name] = self._pool.submit(self._jobs[name])
        return self._started[name]

    def result(self, name: str) -> T:
        return self._start(name).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def selected_in(request: pytest.FixtureRequest) -> list[str]:
    """The names (``test_x[param]``) of the session's selected tests in ``request``'s module,
    in run order, but those a ``skip`` mark or a ``skipif`` mark with a true condition
    skips: the runs to start ahead are theirs."""
    return [
        item.name
        for item in request.session.items
        if getattr(item, "module", None) is request.module and not _skipped(item)
    ]


def _skipped(item: pytest.Item) -> bool:
    if item.get_closest_marker("skip") is not None:
        return True
    return any(m.args[:1] == (True,) for m in item.iter_markers("skipif"))
