"""``python -m moe_overlap plan``: predict schedules on a layout from the command line."""

import argparse
import dataclasses
import errno
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

from moe_overlap.engine import ConfigError
from moe_overlap.plan._choose import CHOICE_SPACE, QUICK_CHOICE_SPACE, choose_schedule
from moe_overlap.plan._contention import ContentionKind, kind_text, parse_contention_by_kind
from moe_overlap.plan._layout import Layout, Schedule
from moe_overlap.plan._machine import MACHINES, Machine
from moe_overlap.plan._model import PRESETS, ModelSpec
from moe_overlap.plan._plan import Plan, costs_from_model, costs_from_profile, plan
from moe_overlap.plan._profile import load_profile
from moe_overlap.plan._search import today_orders
from moe_overlap.plan._search_steps import ActivationModel, ScheduleGraph, StepTimes, replay_order
from moe_overlap.plan._simulate import Costs
from moe_overlap.steps import Slot

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
        help="the model's layer count; needed with --profile, refused without it (default: none)",
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
        "loopback: 0.055); 0 with --contention-by-kind (default: %(default)s)",
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
        help="pipeline stages per rank (virtual pipeline), at --pp 1 too: the model cut into "
        "that many stages on the one rank, in torch's interleaved order; dualpipev always "
        "runs its V of 2 (default: %(default)s)",
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
        "created if missing; with --choose, choice.json (default: none, print only)",
    )
    c = p.add_argument_group(
        "choosing a schedule (one pipeline rank; --schedule is refused)",
        "Say which exact schedule combined_1f1b should run: the fastest of today's and the "
        "searched ones within --memory-budget, and how to run it. These flags are refused "
        "without --choose; with --profile, so are --machine, --mfu, --seq-len and "
        "--micro-batch-size.",
    )
    c.add_argument(
        "--choose",
        action="store_true",
        help="choose a schedule instead of predicting --schedule (default: off)",
    )
    c.add_argument(
        "--memory-budget",
        type=float,
        help="the most peak memory the choice may use, times the serial step's (default: any)",
    )
    c.add_argument(
        "--static-share",
        type=float,
        default=0.0,
        help="the share of the serial step's peak memory that is not activations "
        "(parameters, gradients, optimizer state), 0-1; 0 compares activations alone "
        "(default: %(default)s)",
    )
    c.add_argument(
        "--quick",
        action="store_true",
        help="search a smaller space, about twenty times faster (default: off)",
    )
    c.add_argument(
        "--contention-by-kind",
        nargs="+",
        metavar="KIND=C",
        help="a contention coefficient per communication kind (dispatch.F, dispatch.B, "
        "combine.F, combine.B; a kind not named: 0; fit_contention_by_kind) instead of "
        "--contention (default: none)",
    )
    c.add_argument(
        "--compute-contention-by-kind",
        nargs="+",
        metavar="KIND=C",
        help="a coefficient per compute kind (pre_dispatch.F, mlp.B, mlp.W, mlp.R, ...; a kind "
        "not named: 0; fit_compute_contention_by_kind): its nodes slowed while an all-to-all "
        "runs; instead of --contention (default: none)",
    )
    c.add_argument(
        "--hidden",
        type=int,
        help="hidden size, for the activation model; needed with --profile (default: none)",
    )
    c.add_argument(
        "--moe-ffn",
        type=int,
        help="an expert's FFN size; needed with --profile (default: none)",
    )
    c.add_argument(
        "--top-k", type=int, help="experts per token; needed with --profile (default: none)"
    )


def _read_json(flag: str, path: Path) -> object:
    """The JSON in the file ``path`` given as ``flag``; a missing, unreadable or malformed
    file is a :class:`ConfigError` naming the flag."""
    try:
        return cast(object, json.loads(path.read_text(encoding="utf-8")))
    except OSError as e:
        raise ConfigError(
            f"plan {flag}: expected a readable JSON file, received {str(path)!r} "
            f"({e.strerror or e}); pass the path of the file"
        ) from None
    except ValueError as e:  # json.JSONDecodeError, UnicodeDecodeError
        raise ConfigError(
            f"plan {flag}: expected a JSON file, received {str(path)!r}, which is not JSON "
            f"({e}); pass the path of the file"
        ) from None


def _out_folder(where: str, out: Path) -> Path:
    """``out`` created if missing; a path that cannot be a folder is a :class:`ConfigError`."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        if not os.access(out, os.W_OK):
            raise PermissionError(errno.EACCES, "Permission denied")
    except OSError as e:
        raise ConfigError(
            f"{where} --out: expected a folder that can be created and written, received "
            f"{str(out)!r} ({e.strerror or e}); pass another folder"
        ) from None
    return out


def _refuse_unused(ns: argparse.Namespace) -> None:
    """Refuse a flag this command line would not use, rather than ignore it."""
    defaults = {"--layers": None, "--memory-budget": None, "--static-share": 0.0}
    given = {
        "--layers": ns.layers,
        "--memory-budget": ns.memory_budget,
        "--static-share": ns.static_share,
        "--quick": ns.quick or None,
        "--contention-by-kind": ns.contention_by_kind,
        "--compute-contention-by-kind": ns.compute_contention_by_kind,
        "--hidden": ns.hidden,
        "--moe-ffn": ns.moe_ffn,
        "--top-k": ns.top_k,
    }
    given = {k: v for k, v in given.items() if v is not None and v != defaults.get(k)}
    unused: list[str] = []
    if ns.profile is None:
        unused += [k for k in ("--layers", "--hidden", "--moe-ffn", "--top-k") if k in given]
    else:
        model_flags = {
            "--machine": (ns.machine, "h800"),
            "--mfu": (ns.mfu, None),
            "--seq-len": (ns.seq_len, 4096),
            "--micro-batch-size": (ns.micro_batch_size, 1),
        }
        unused += [k for k, (v, d) in model_flags.items() if v != d]
    if not ns.choose:
        choose_only = (
            "--memory-budget",
            "--static-share",
            "--quick",
            "--contention-by-kind",
            "--compute-contention-by-kind",
            "--hidden",
            "--moe-ffn",
        )
        unused += [k for k in (*choose_only, "--top-k") if k in given and k not in unused]
    else:
        if list(ns.schedule) != list(_DEFAULT_SCHEDULES):
            unused.append("--schedule")
        # one rank's schedule: replicas do not change it; a profile already holds the
        # all-to-alls of its expert-parallel size
        if ns.dp != 1:
            unused.append("--dp")
        if ns.profile is not None and ns.ep != 8:
            unused.append("--ep")
    if unused:
        why = "--profile gives the costs" if ns.profile is not None else "no --profile"
        mode = "--choose" if ns.choose else "no --choose"
        raise ConfigError(
            f"plan: expected only flags this run uses ({why}, {mode}), received "
            f"{' '.join(unused)}, which it would ignore; drop them (see plan --help)"
        )


def _by_kind(
    ns: argparse.Namespace,
) -> tuple[dict[ContentionKind, float] | None, dict[ContentionKind, float] | None]:
    """``--contention-by-kind`` and ``--compute-contention-by-kind`` parsed (``None``: not
    given); either beside a ``--contention`` other than 0 is refused (one model at a time,
    as :class:`Costs` has it)."""
    words = {
        "--contention-by-kind": cast("list[str] | None", ns.contention_by_kind),
        "--compute-contention-by-kind": cast("list[str] | None", ns.compute_contention_by_kind),
    }
    given = [flag for flag, w in words.items() if w is not None]
    factor = cast(float, ns.contention)
    if given and factor != 0.0:
        raise ConfigError(
            f"plan --choose: expected one contention model, received --contention {factor!r} "
            f"and {' and '.join(given)}; pass --contention 0 (its default) to use the "
            f"coefficients per kind, or drop {' and '.join(given)}"
        )
    comm, comp = (
        None if w is None else parse_contention_by_kind(f"plan {flag}", w, compute=i == 1)
        for i, (flag, w) in enumerate(words.items())
    )
    return comm, comp


def _model(ns: argparse.Namespace) -> ModelSpec:
    if ns.hf_config is not None:
        config = _read_json("--hf-config", Path(ns.hf_config))
        if not isinstance(config, dict):
            raise ConfigError(
                f"plan --hf-config: expected a JSON object (a config.json), received "
                f"{type(config).__name__} in {str(ns.hf_config)!r}; pass a model's config.json"
            )
        config = cast("dict[str, object]", config)
        return ModelSpec.from_hf_config(
            config, seq_len=ns.seq_len, micro_batch_size=ns.micro_batch_size
        )
    return ModelSpec.preset(ns.model, seq_len=ns.seq_len, micro_batch_size=ns.micro_batch_size)


def _check_profile_file(path: Path) -> Path:
    """``path`` once it reads as JSON whose rows (if a list) are objects; the rest of the
    checks are :func:`load_profile`'s."""
    data = _read_json("--profile", path)
    if isinstance(data, dict) and "serial_slot_durations" in data:
        data = cast("dict[str, object]", data)["serial_slot_durations"]
    if isinstance(data, list):
        bad = [r for r in cast("list[object]", data) if not isinstance(r, dict)]
        if bad:
            raise ConfigError(
                f"plan --profile: expected rows that are JSON objects {{'layer', 'slot', "
                f"'direction', 'ms'}} in {str(path)!r}, received {bad[0]!r}; pass a serial "
                "profile"
            )
    return path


def _costs(ns: argparse.Namespace, layout: Layout) -> tuple[Costs, str]:
    if ns.profile is not None:
        layers = cast("int | None", ns.layers)
        if layers is None:
            raise ConfigError("plan: --profile needs --layers (the model's layer count)")
        profile = load_profile(_check_profile_file(cast(Path, ns.profile)))
        costs = costs_from_profile(
            profile,
            num_layers=layers,
            comm_contention=cast(float, ns.contention),
            weight_split=cast(bool, ns.weight_split),
        )
        return costs, f"profile {ns.profile} ({layers} layers)"
    model = _model(ns)
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
    _refuse_unused(ns)
    if ns.out is not None:  # a wrong --out fails before the work, not after it
        _out_folder("plan", cast(Path, ns.out))
    layout = Layout(ep=ns.ep, pp=ns.pp, dp=ns.dp, vpp=ns.vpp, microbatches=ns.microbatches)
    if ns.choose and (layout.pp != 1 or layout.vpp != 1):
        raise ConfigError(
            f"plan --choose: expected one pipeline rank (--pp 1 --vpp 1), received --pp "
            f"{layout.pp} --vpp {layout.vpp}; it chooses the schedule of one rank's layers"
        )
    if ns.choose:
        comm, comp = _by_kind(ns)
        costs, what = _costs(ns, layout)
        costs = costs.replace(contention_by_kind=comm, compute_contention_by_kind=comp)
        print(f"costs from {what}", flush=True)
        return _run_choose(ns, costs)
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
        _out_folder("plan", out)
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


def _activations(ns: argparse.Namespace, costs: Costs) -> ActivationModel:
    """The activation model of ``--hidden/--moe-ffn/--top-k`` (or the model's), with the
    static part that makes ``--static-share`` of the serial step's peak."""
    if ns.profile is not None:
        sizes = {"--hidden": ns.hidden, "--moe-ffn": ns.moe_ffn, "--top-k": ns.top_k}
        missing = [k for k, v in sizes.items() if v is None]
        if missing:
            raise ConfigError(
                f"plan --choose: --profile needs {' '.join(missing)} (the activation model's "
                "sizes), received none"
            )
        hidden, ffn, top_k = cast("tuple[int, int, int]", tuple(sizes.values()))
    else:
        model = _model(ns)
        hidden, ffn, top_k = model.hidden_size, model.moe_ffn_hidden_size, model.top_k
    share = cast(float, ns.static_share)
    if not 0.0 <= share < 1.0:
        raise ConfigError(
            f"plan --choose: --static-share: expected a share in [0, 1), received {share!r}"
        )
    memory = ActivationModel.of_layer(hidden=hidden, moe_ffn=ffn, top_k=top_k)
    graph = ScheduleGraph(microbatches=cast(int, ns.microbatches), moe=costs.moe)
    times = StepTimes(
        times=costs.times,
        comm_contention=costs.comm_contention,
        contention_by_kind=costs.contention_by_kind,
        compute_contention_by_kind=costs.compute_contention_by_kind,
    )
    serial = replay_order(today_orders(graph)["serial"], graph, times, memory).peak_units
    return dataclasses.replace(memory, static_units=serial * share / (1.0 - share))


def _run_choose(ns: argparse.Namespace, costs: Costs) -> int:
    memory = _activations(ns, costs)
    space = QUICK_CHOICE_SPACE if ns.quick else CHOICE_SPACE
    budget = cast("float | None", ns.memory_budget)
    choice = choose_schedule(costs, cast(int, ns.microbatches), memory, budget=budget, space=space)
    share = cast(float, ns.static_share)
    print(
        f"memory: peak activations{' plus the static part' if share else ''}, times the "
        f"serial step's ({share:g} of whose peak is static)"
    )
    print(_contention_line(costs))
    print(choice.summary())
    if choice.kind == "searched":
        print(f"  schedule (NodeSchedule.parse reads it): {choice.schedule}")
    out = cast("Path | None", ns.out)
    if out is not None:
        _out_folder("plan --choose", out)
        c = choice.chosen
        data = {
            "kind": choice.kind,
            "label": choice.label,
            "budget": choice.budget,
            "step_ms": c.step_ms,
            "memory": c.memory,
            "serial_ms": choice.serial.step_ms,
            "bound": choice.bound,
            "reason": choice.reason,
            "call": choice.call,
            "delay_wgrad_compute": choice.options.delay_wgrad_compute,
            "recompute": [Slot(s).value for s in choice.options.recompute],
            "schedule": str(choice.schedule),
            "comm_contention": costs.comm_contention,
            "contention_by_kind": _by_kind_json(costs.contention_by_kind),
            "compute_contention_by_kind": _by_kind_json(costs.compute_contention_by_kind),
        }
        path = out / "choice.json"
        path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {path}")
    return 0


def _by_kind_json(by_kind: Mapping[ContentionKind, float] | None) -> dict[str, float] | None:
    """Coefficients per kind keyed ``slot.direction`` (as the flags take them)."""
    if by_kind is None:
        return None
    return {kind_text(k): c for k, c in by_kind.items()}


def _contention_line(costs: Costs) -> str:
    """The contention model the choice was made with, in one line."""
    models = {
        "communication": _by_kind_json(costs.contention_by_kind),
        "compute": _by_kind_json(costs.compute_contention_by_kind),
    }
    parts = [
        f"{' '.join(f'{k}={c}' for k, c in given.items()) or 'none'} ({node})"
        for node, given in models.items()
        if given is not None
    ]
    if not parts:
        return f"contention: {costs.comm_contention}, one factor for every all-to-all"
    return f"contention per kind (a kind not named: 0): {', '.join(parts)}"
