"""How much each all-to-all slows beside compute, from a recorded ``explain_prediction.py`` run.

    python benchmarks/contention_by_kind.py \\
        benchmarks/results/h100_2026_12_07b/explain/explain.json

For each configuration of the file and each of its rows (``overlapped``, ``searched``), per
communication node kind (dispatch and combine, forward and backward): the measured time on
the communication stream against the same nodes timed one at a time on one stream
(``searched_serial``: the inflation), the share of that time during which the compute
stream was busy too, and the contention coefficient that share implies, ``(inflation - 1) /
share``. If a node's slowdown is that coefficient times the share of it spent beside
compute, the coefficient is the same in every row: the last line replays the ``searched``
row's communication stream with each kind's coefficient from the ``overlapped`` row, against
what was measured and against the planner's one factor on every node (fitted on the
``overlapped`` row: ``contention_fitted_here["planner"]``). Standard library only; reads the file, writes nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

Json = dict[str, Any]


@dataclass
class KindTotals:
    """One node kind's sums over a row: ms beside compute, ms measured, ms alone."""

    beside: float = 0.0
    measured: float = 0.0
    alone: float = 0.0

    @property
    def inflation(self) -> float:
        return self.measured / self.alone

    @property
    def share(self) -> float:
        return self.beside / self.measured

    @property
    def coefficient(self) -> float:
        return (self.inflation - 1.0) / self.share if self.beside else float("nan")


def _kind(node: str) -> str:
    return ".".join(node.split(".")[-2:])


def kind_totals(row: list[Json], alone: dict[str, float]) -> dict[str, KindTotals]:
    """Per communication node kind of one recorded row, its :class:`KindTotals`."""
    comp = [
        (cast(float, x["start_ms"]), cast(float, x["end_ms"])) for x in row if x["stream"] == "comp"
    ]
    out: dict[str, KindTotals] = defaultdict(KindTotals)
    for x in row:
        node = cast(str, x["node"])
        if x["stream"] != "comm" or node not in alone:
            continue
        lo, hi = cast(float, x["start_ms"]), cast(float, x["end_ms"])
        t = out[_kind(node)]
        t.beside += sum(max(0.0, min(hi, e) - max(lo, s)) for s, e in comp)
        t.measured += hi - lo
        t.alone += alone[node]
    return dict(out)


def report(result: Json) -> list[str]:
    """The lines for one configuration of an ``explain.json``."""
    measured = cast("dict[str, list[Json]]", result["timelines"]["measured"])
    alone = {
        cast(str, x["node"]): cast(float, x["end_ms"]) - cast(float, x["start_ms"])
        for x in measured["searched_serial"]
    }
    rows = {k: kind_totals(measured[k], alone) for k in ("overlapped", "searched")}
    lines = [f"## {result['name']}", ""]
    lines += [
        "| row | kind | measured ms | alone ms | inflation | share beside compute | coefficient |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, kinds in rows.items():
        total = KindTotals()
        for kind, t in sorted(kinds.items()):
            total.beside += t.beside
            total.measured += t.measured
            total.alone += t.alone
            lines.append(
                f"| {name} | {kind} | {t.measured:.1f} | {t.alone:.1f} | {t.inflation:.3f} | "
                f"{t.share:.3f} | {t.coefficient:.3f} |"
            )
        lines.append(
            f"| {name} | all | {total.measured:.1f} | {total.alone:.1f} | {total.inflation:.3f} | "
            f"{total.share:.3f} | {total.coefficient:.3f} |"
        )
    over, searched = rows["overlapped"], rows["searched"]
    replay = sum(
        t.alone * (1.0 + max(over[k].coefficient, 0.0) * t.share)
        for k, t in searched.items()
        if k in over
    )
    got = sum(t.measured for t in searched.values())
    fitted = cast("dict[str, float | None]", result.get("contention_fitted_here", {})).get(
        "planner"
    )
    one = sum(t.alone for t in searched.values()) * (1.0 + (fitted or 0.0))
    lines += [
        "",
        f"searched, communication stream busy: measured {got:.1f} ms; each kind's coefficient "
        f"from overlapped times its share beside compute: {replay:.1f} ms "
        f"({(replay - got) / got:+.1%}); one factor {fitted if fitted is not None else 0.0:.3f} "
        f"on every node: {one:.1f} ms ({(one - got) / got:+.1%})",
        "",
    ]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("explain", type=Path, help="an explain.json of explain_prediction.py")
    args = p.parse_args(argv)
    try:
        doc = cast(Json, json.loads(cast(Path, args.explain).read_text("utf-8")))
        results = cast("list[Json]", doc["results"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        p.error(f"expected an explain.json written by explain_prediction.py: {e}")
    print(f"{doc.get('command', '')} on {doc.get('device', '?')}\n")
    for result in results:
        print("\n".join(report(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
