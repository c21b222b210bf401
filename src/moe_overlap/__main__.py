"""Command line: ``python -m moe_overlap demo`` and ``python -m moe_overlap plan`` (also the
``moe-overlap`` script).

The demo itself is :mod:`moe_overlap.demo`; the planner :mod:`moe_overlap.plan`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from moe_overlap import MoeOverlapError, __version__
from moe_overlap.demo import DemoArgs, run_demo
from moe_overlap.plan import add_plan_parser, run_plan

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moe-overlap",
        description=(
            "moe_overlap's tools: train a small MoE model with the overlapped schedule and "
            "check it against plain backward (demo), or predict schedules on a cluster "
            "layout (plan). 'moe-overlap COMMAND --help' lists a command's options."
        ),
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {__version__}", help="print the version"
    )
    sub = parser.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")
    d = DemoArgs()
    demo = sub.add_parser(
        "demo",
        help="train the reference MoE model with and without overlap; check they match",
        description=(
            "Train the reference MoE model (4 layers, 8 experts) with combined_1f1b and, "
            "from the same weights, with plain loss.backward() per microbatch; print both "
            "losses per step and whether every gradient is bit-identical; write the last "
            "step's timeline (Chrome trace, and a PNG with matplotlib) to --out. Under "
            "'torchrun --nproc-per-node N' the experts are sharded over N ranks."
        ),
    )
    demo.add_argument(
        "--steps", type=int, default=d.steps, help="training steps (default: %(default)s)"
    )
    demo.add_argument(
        "--microbatches",
        type=int,
        default=d.microbatches,
        help="microbatches per step (default: %(default)s)",
    )
    demo.add_argument(
        "--out",
        type=Path,
        default=d.out,
        help="folder for the timeline files, created if missing (default: %(default)s/)",
    )
    demo.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default=d.device,
        help="where to run; auto takes a GPU when one is visible (default: %(default)s)",
    )
    demo.add_argument(
        "--ep",
        type=int,
        default=None,
        help="expert-parallel size; must equal the number of processes (default: WORLD_SIZE, "
        "1 without torchrun)",
    )
    demo.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=d.dtype,
        help="parameter and activation dtype (default: %(default)s)",
    )
    demo.add_argument(
        "--optimizer",
        choices=("adamw", "sgd"),
        default=d.optimizer,
        help="optimizer of both models (default: %(default)s)",
    )
    demo.add_argument(
        "--lr",
        type=float,
        default=d.lr,
        help="learning rate; SGD takes ten times it (default: %(default)s)",
    )
    demo.add_argument(
        "--no-delay-wgrad",
        dest="delay_wgrad",
        action="store_false",
        help="compute weight gradients at once instead of delaying them into the other "
        "microbatch's forward (default: delayed)",
    )
    demo.add_argument(
        "--dispatcher",
        choices=("alltoall", "loopback"),
        default=d.dispatcher,
        help="how tokens reach the experts: alltoall, or loopback (a round trip through "
        "host memory on the comm stream, standing in for the all-to-all on one device; EP=1 "
        "only) (default: %(default)s)",
    )
    demo.add_argument(
        "--seed",
        type=int,
        default=d.seed,
        help="seed of the weights and data (default: %(default)s)",
    )
    demo.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="no progress bar (default: a bar when stdout and stderr are terminals and tqdm "
        "is installed; plain lines otherwise)",
    )
    add_plan_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m moe_overlap`` and the ``moe-overlap`` script.

    A refused input (the library's :class:`~moe_overlap.MoeOverlapError`) is one line on
    stderr and exit status 2, as argparse reports a bad flag; any other error keeps its
    traceback."""
    parser = _parser()
    ns = parser.parse_args(argv)
    try:
        return _run(ns)
    except MoeOverlapError as e:
        parser.exit(2, f"{parser.prog} {ns.command}: error: {e}\n")


def _run(ns: argparse.Namespace) -> int:
    """The chosen command."""
    if ns.command == "demo":
        args = DemoArgs(
            steps=ns.steps,
            microbatches=ns.microbatches,
            out=ns.out,
            device=ns.device,
            ep=ns.ep,
            dtype=ns.dtype,
            optimizer=ns.optimizer,
            lr=ns.lr,
            delay_wgrad=ns.delay_wgrad,
            dispatcher=ns.dispatcher,
            seed=ns.seed,
            progress=ns.progress,
        )
        return run_demo(args)
    if ns.command == "plan":
        return run_plan(ns)
    raise AssertionError(f"unhandled command {ns.command!r}")


if __name__ == "__main__":
    sys.exit(main())
