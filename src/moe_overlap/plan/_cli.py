"""``python -m moe_overlap plan``: predict schedules on a layout from the command line."""

import argparse
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

from moe_overlap.engine import ConfigError
from moe_overlap.plan._layout import Layout, Schedule
from moe_overlap.plan._machine import MACHINES, Machine
from moe_overlap.plan._model import PRESETS, ModelSpec
from moe_overlap.plan._plan import Plan, costs_from_model, costs_from_profile, plan
from moe_overlap.plan._profile import load_profile
from moe_overlap.plan._simulate import Costs

__all__ = ["add_plan_parser", "run_plan"]

if TYPE_CHECKING:
    from typing import TypeAlias

    _Subparsers: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]  # pyright: ignore[reportPrivateUsage]
else:
    # Opaque at run time: argparse's class cannot be subscripted there, and debug mode's
    # beartype resolves the annotation.
    _Subparsers = object

_DEFAULT_SCHEDULES = ("serial", "combined_1f1b", "dualpipev")


def add_plan_parser(sub: _Subparsers) -> None:
    """Add the ``plan`` command to ``python -m moe_overlap``'s subcommands ``sub`` (what
    ``ArgumentParser.add_subparsers()`` returns)."""
    p = sub.add_parser(
        "plan",
        help="predict step time, bubbles and memory of schedules on a layout",
        description=(
            "Predict one training step of each schedule on a layout, from a model preset or "
            "a transformers config.json on a GPU's roofline and alpha-beta links, or from a "
            "measured serial profile."
        ),
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--model",
        choices=PRESETS,
        default="deepseek-v3-671b",
        help="a model preset; with --hf-config or --profile it is not used (default: %(default)s)",
    )
    src.add_argument(
        "--hf-config",
        type=Path,
        help="a transformers config.json of an MoE model, instead of --model (default: none)",
    )
    src.add_argument(
        "--profile",
        type=Path,
        help="serial node durations in ms (JSON rows, e.g. a bench's serial_slot_durations), "
        "instead of a roofline of --model on --machine (default: none)",
    )
    p.add_argument(
        "--layers",
        type=int,
        help="the model's layer count; needed with --profile, unused otherwise (default: none)",
    )
    p.add_argument(
        "--seq-len", type=int, default=4096, help="tokens per sequence (default: %(default)s)"
    )
    p.add_argument(
        "--micro-batch-size",
        type=int,
        default=1,
        help="sequences per microbatch (default: %(default)s)",
    )
    p.add_argument(
        "--machine",
        choices=MACHINES,
        default="h800",
        help="the GPU and links of the roofline (default: %(default)s)",
    )
    p.add_argument(
        "--mfu",
        type=float,
        help="share of peak FLOPs a GEMM reaches, 0-1 (default: the --machine preset's)",
    )
    p.add_argument(
        "--contention",
        type=float,
        default=0.0,
        help="how much longer a copy runs under kernels, as a fraction (fit_contention; H200 "
        "loopback: 0.055) (default: %(default)s)",
    )
    p.add_argument(
        "--weight-split",
        action="store_true",
        help="weight-gradient (W) actions run apart from their backward, as in zero-bubble "
        "schedules (default: off)",
    )
    p.add_argument("--ep", type=int, default=8, help="expert-parallel size (default: %(default)s)")
    p.add_argument(
        "--pp", type=int, default=1, help="pipeline-parallel ranks (default: %(default)s)"
    )
    p.add_argument(
        "--dp", type=int, default=1, help="data-parallel replicas (default: %(default)s)"
    )
    p.add_argument(
        "--vpp",
        type=int,
        default=1,
        help="pipeline stages per rank (virtual pipeline) (default: %(default)s)",
    )
    p.add_argument(
        "--microbatches",
        type=int,
        default=8,
        help="microbatches per training step (default: %(default)s)",
    )
    p.add_argument(
        "--schedule",
        nargs="+",
        default=list(_DEFAULT_SCHEDULES),
        choices=[s.value for s in Schedule],
        metavar="SCHEDULE",
        help="one or more of %(choices)s; the first is the baseline the others are compared "
        f"with (default: {' '.join(_DEFAULT_SCHEDULES)})",
    )
    p.add_argument(
        "--out",
        type=Path,
        help="folder to write plan.json, a Chrome trace and a Gantt PNG per schedule into, "
        "created if missing (default: none, print only)",
    )


def _costs(ns: argparse.Namespace, layout: Layout) -> tuple[Costs, str]:
    if ns.profile is not None:
        layers = cast("int | None", ns.layers)
        if layers is None:
            raise ConfigError("plan: --profile needs --layers (the model's layer count)")
        profile = load_profile(cast(Path, ns.profile))
        costs = costs_from_profile(
            profile,
            num_layers=layers,
            comm_contention=cast(float, ns.contention),
            weight_split=cast(bool, ns.weight_split),
        )
        return costs, f"profile {ns.profile} ({layers} layers)"
    if ns.hf_config is not None:
        config = json.loads(Path(ns.hf_config).read_text(encoding="utf-8"))
        model = ModelSpec.from_hf_config(
            config, seq_len=ns.seq_len, micro_batch_size=ns.micro_batch_size
        )
    else:
        model = ModelSpec.preset(ns.model, seq_len=ns.seq_len, micro_batch_size=ns.micro_batch_size)
    machine = Machine.preset(ns.machine)
    if ns.mfu is not None:
        machine = dataclasses.replace(machine, mfu=ns.mfu)
    costs = costs_from_model(
        model,
        machine,
        layout,
        comm_contention=cast(float, ns.contention),
        weight_split=cast(bool, ns.weight_split),
    )
    what = (
        f"{model.name}: {model.num_layers} layers, hidden {model.hidden_size}, "
        f"{model.num_experts} experts top-{model.top_k}, {model.tokens} tokens per microbatch; "
        f"{machine.name}: {machine.peak_tflops:g} TFLOPs x mfu {machine.mfu:g}, "
        f"HBM {machine.hbm_GBps:g} GB/s, NVLink {machine.nvlink.beta_GBps:g} GB/s, "
        f"network {machine.network.beta_GBps:g} GB/s per GPU, {machine.gpus_per_node} per node"
    )
    return costs, what


def run_plan(ns: argparse.Namespace) -> int:
    """Run the ``plan`` command; 0 on success."""
    layout = Layout(ep=ns.ep, pp=ns.pp, dp=ns.dp, vpp=ns.vpp, microbatches=ns.microbatches)
    costs, what = _costs(ns, layout)
    hbm_gb = None if ns.profile is not None else Machine.preset(ns.machine).hbm_GB
    print(f"costs from {what}", flush=True)
    plans: list[Plan] = []
    for name in cast("Sequence[str]", ns.schedule):
        lay = layout.replace(vpp=1) if name == "dualpipev" and layout.vpp != 2 else layout
        result = plan(costs, lay, name)
        plans.append(result)
        print(result.summary(), flush=True)
        if hbm_gb is not None and result.peak_activation_bytes / 1e9 > hbm_gb:
            print(
                f"  note: peak activations {result.peak_activation_bytes / 1e9:.1f} GB exceed "
                f"the {hbm_gb:g} GB of HBM before parameters and optimizer state; a real run "
                "needs recompute, more pipeline ranks or fewer tokens per microbatch"
            )
    base = plans[0]
    for other in plans[1:]:
        print(
            f"{other.schedule.value} vs {base.schedule.value}: "
            f"{base.step_ms / other.step_ms:.3f}x, peak activations "
            f"{other.peak_activation_bytes / 1e9:.2f} GB against "
            f"{base.peak_activation_bytes / 1e9:.2f} GB"
        )
    out = cast("Path | None", ns.out)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        data = {"costs": what, "plans": [p.to_json() for p in plans]}
        path = out / "plan.json"
        path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {path}")
        for p in plans:
            trace = p.to_chrome_trace(out / f"plan_{p.schedule.value}_trace.json")
            print(f"wrote {trace}")
            try:
                png = p.gantt_png(out / f"plan_{p.schedule.value}.png")
            except ConfigError as e:
                print(f"no Gantt PNG: {e}")
            else:
                print(f"wrote {png}")
    return 0
