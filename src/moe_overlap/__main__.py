"""Command line: ``python -m moe_overlap demo`` and ``python -m moe_overlap plan`` (also the
``moe-overlap`` script).

The demo itself is :mod:`moe_overlap.demo`; the planner :mod:`moe_overlap.plan`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from moe_overlap.demo import DemoArgs, run_demo
from moe_overlap.plan import add_plan_parser, run_plan

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-overlap", description="moe_overlap tools")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train the reference model, scheduled vs plain")
    d = DemoArgs()
    demo.add_argument("--steps", type=int, default=d.steps)
    demo.add_argument("--microbatches", type=int, default=d.microbatches)
    demo.add_argument("--out", type=Path, default=d.out, help="output dir (default: out/)")
    demo.add_argument("--device", choices=("auto", "cpu", "cuda"), default=d.device)
    demo.add_argument("--ep", type=int, default=None, help="EP size (default: WORLD_SIZE)")
    demo.add_argument("--dtype", choices=("float32", "bfloat16"), default=d.dtype)
    demo.add_argument("--optimizer", choices=("adamw", "sgd"), default=d.optimizer)
    demo.add_argument("--lr", type=float, default=d.lr)
    demo.add_argument(
        "--no-delay-wgrad", dest="delay_wgrad", action="store_false", help="compute wgrad at once"
    )
    demo.add_argument("--dispatcher", choices=("alltoall", "loopback"), default=d.dispatcher)
    demo.add_argument("--seed", type=int, default=d.seed)
    demo.add_argument("--no-progress", dest="progress", action="store_false")
    add_plan_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m moe_overlap`` and the ``moe-overlap`` script."""
    ns = _parser().parse_args(argv)
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
