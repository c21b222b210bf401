"""Each committed frontier's best order, replayed under every frontier's model: does a model
rank the orders as a GPU did?

    python benchmarks/rank_orders.py \\
        --frontiers frontier_one_event frontier_by_kind --configs 'main N=4' 'main N=8'

For each configuration, each frontier's best order (``best_order``) is replayed with each
frontier's model (its shares, event model and contention: one factor, or per kind), from the
serial profile the frontiers were searched from (``source``; they must share one), as
``bench_schedules.py`` predicts it (:func:`bench_schedules.predict`). A frontier's own order
under its own model is its committed ``best_ms``. ``--measured FRONTIER=MS ...`` adds a
column of measured step times (per configuration: give the flag once per ``--configs`` entry
in the same order, e.g. ``--measured frontier_one_event=487.0 frontier_by_kind=514.6``).
Reads the committed files, writes nothing; CPU, a few seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_schedules as bs

Json = dict[str, Any]
RESULTS = Path(__file__).resolve().parent / "results"


def load(name: str) -> Json:
    """The committed frontier ``results/NAME/frontier.json``."""
    return cast(Json, json.loads((RESULTS / name / "frontier.json").read_text("utf-8")))


def rank(frontiers: Sequence[str], config_name: str) -> dict[str, dict[str, float]]:
    """``{order's frontier: {model's frontier: predicted step ms}}`` for ``config_name``."""
    docs = {f: load(f) for f in frontiers}
    sources = {cast(str, d["source"]) for d in docs.values()}
    if len(sources) != 1:
        raise ValueError(f"expected frontiers searched from one profile, received {sources}")
    rows = cast("list[Json]", json.loads(Path(sources.pop()).read_text("utf-8"))["results"])
    configs = {
        f: next(c for c in cast("list[Json]", d["configs"]) if c["name"] == config_name)
        for f, d in docs.items()
    }
    first = next(iter(configs.values()))
    row = next(
        r
        for r in rows
        if (r["config"]["ffn"], r["microbatches"]) == (first["ffn"], first["microbatches"])
    )
    profile = cast("list[Json]", row["order_search"]["serial_slot_durations"])
    layers = cast(int, row["config"]["num_layers"])
    out: dict[str, dict[str, float]] = {}
    for order_of, config in configs.items():
        out[order_of] = {}
        for model_of, doc in docs.items():
            predicted = bs.predict(
                profile,
                {**config, "space": doc["space"]},
                num_layers=layers,
                contention=cast(float, doc["comm_contention"]),
                contention_by_kind=bs.by_kind_of(doc),
                compute_contention_by_kind=bs.by_kind_of(doc, "compute_contention_by_kind"),
            )
            out[order_of][model_of] = predicted["searched"]
    return out


def table(config_name: str, ranked: dict[str, dict[str, float]], measured: dict[str, float]) -> str:
    models = list(next(iter(ranked.values())))
    head = ["order of", *(f"{m} model ms" for m in models)] + (["measured ms"] if measured else [])
    lines = [f"## {config_name}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for order_of, by_model in ranked.items():
        cells = [order_of, *(f"{by_model[m]:.1f}" for m in models)]
        if measured:
            cells.append(f"{measured[order_of]:.1f}" if order_of in measured else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--frontiers", nargs="+", default=["frontier_one_event", "frontier_by_kind"])
    p.add_argument("--configs", nargs="+", default=["main N=4"])
    p.add_argument(
        "--measured",
        nargs="+",
        action="append",
        default=[],
        metavar="FRONTIER=MS",
        help="measured step ms of a frontier's order; once per --configs entry, in its order",
    )
    args = p.parse_args(argv)
    if args.measured and len(cast("list[list[str]]", args.measured)) != len(args.configs):
        p.error("--measured: expected one per --configs entry, in the same order")
    given = cast("list[list[str]]", args.measured)
    for i, name in enumerate(cast("list[str]", args.configs)):
        measured: dict[str, float] = {}
        for word in given[i] if given else []:
            key, _, ms = word.partition("=")
            if key not in args.frontiers:
                p.error(
                    f"--measured: expected FRONTIER=MS of one of --frontiers, received {word!r}"
                )
            try:
                measured[key] = float(ms)
            except ValueError:
                p.error(f"--measured: expected a number of ms, received {word!r}")
        try:
            ranked = rank(args.frontiers, name)
        except (OSError, ValueError, KeyError, StopIteration) as e:
            p.error(f"expected committed frontiers holding {name!r}: {e!r}")
        print(table(name, ranked, measured))


if __name__ == "__main__":
    main()
