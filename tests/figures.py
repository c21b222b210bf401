"""Every PNG the library and the benchmarks write says what it shows: the figure objects
are caught as they are saved (never the pixels) and read back."""

from __future__ import annotations

from typing import Any

import pytest


def saved_figures(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The matplotlib figures saved from now until the test ends, in order (each still
    written to its file). Skips the test without matplotlib."""
    figure = pytest.importorskip("matplotlib.figure")
    saved: list[Any] = []
    original = figure.Figure.savefig

    def savefig(self: Any, *args: Any, **kwargs: Any) -> Any:
        saved.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(figure.Figure, "savefig", savefig)
    return saved


def check_figure(fig: Any, *, title: list[str], x_unit: str, legend: set[str]) -> None:
    """``fig``'s one plot has a title naming each of ``title``, an x label with ``x_unit``
    and a legend with at least the labels ``legend``."""
    (ax,) = fig.axes
    shown = ax.get_title()
    for words in title:
        assert words in shown, (words, shown)
    assert x_unit in ax.get_xlabel(), ax.get_xlabel()
    box = ax.get_legend()
    assert box is not None, f"no legend in {shown!r}"
    labels = {t.get_text() for t in box.get_texts()}
    assert legend <= labels, (legend, labels)
