"""The planner's answer: :func:`plan` and :class:`Plan`."""

import importlib
import json
import numbers
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from moe_overlap.args import BOOL, POSITIVE, Instance, Items, Real, check_arg, refuse
from moe_overlap.engine import ConfigError, Direction, Slot, SlotKey, StreamKind
from moe_overlap.plan._actions import lower, num_stages
from moe_overlap.plan._layout import Layout, Schedule
from moe_overlap.plan._machine import Machine, p2p_ms, roofline_durations
from moe_overlap.plan._model import ModelSpec
from moe_overlap.plan._profile import profile_times
from moe_overlap.plan._simulate import Costs, PlanSpan, RankFigures, simulate, stage_layers

__all__ = ["Plan", "costs_from_model", "costs_from_profile", "fit_contention", "plan"]

_MOE_FLAGS = Items(BOOL, expects="one bool per layer (True: an MoE layer)", ordered=True)
_LAYER_SLOTS = (Slot.PRE_DISPATCH, Slot.DISPATCH, Slot.COMBINE, Slot.MLP)
"""A layer's nodes; ``[::3]`` the dense layer's (pre-dispatch and mlp)."""


def _profiled(times: Mapping[SlotKey, float]) -> set[int]:
    return {k[0] for k in times if k[0] is not None} or {0}


@dataclass(frozen=True)
class Plan:
    """A predicted step of ``schedule`` on ``layout`` (milliseconds, bytes)."""

    schedule: Schedule
    layout: Layout
    step_ms: float
    ranks: tuple[RankFigures, ...]
    spans: tuple[PlanSpan, ...]
    torch_class: str | None

    @property
    def bubble_fraction(self) -> float:
        """The largest share of the step a pipeline rank runs no action."""
        if not self.step_ms:
            return 0.0
        return max(r.bubble_ms for r in self.ranks) / self.step_ms

    @property
    def peak_activation_bytes(self) -> float:
        """The largest peak of activation memory over the pipeline ranks."""
        return max(r.peak_activation_bytes for r in self.ranks)

    @property
    def origin(self) -> str:
        """What ran, in words: overlap or not, and whose order (torch's schedule class or
        the engine's macro steps at one pipeline rank)."""
        cls = self.torch_class
        order = f"torch {cls}'s order" if cls else "the engine's macro steps"
        if self.schedule is Schedule.SERIAL:
            return f"no overlap, {order}"
        if self.schedule is Schedule.COMBINED_1F1B:
            paired = "paired in " if cls else ""
            return f"a forward overlapped with another microbatch's backward, {paired}{order}"
        if self.schedule is Schedule.FILL_DRAIN:
            return f"combined 1F1B with the fill and the drain overlapped too, {order}"
        return f"torch {cls}" if cls else order

    def to_json(self) -> dict[str, object]:
        """The figures (no spans) as JSON-ready data."""
        return {
            "schedule": self.schedule.value,
            "torch_class": self.torch_class,
            "layout": {
                "ep": self.layout.ep,
                "pp": self.layout.pp,
                "dp": self.layout.dp,
                "vpp": self.layout.vpp,
                "microbatches": self.layout.microbatches,
            },
            "step_ms": self.step_ms,
            "bubble_fraction": self.bubble_fraction,
            "ranks": [r._asdict() for r in self.ranks],
        }

    def summary(self) -> str:
        """A few lines for a terminal or a log."""
        lines = [
            f"{self.schedule.value}: {self._layout_text()}, {self.origin}",
            f"  step {self.step_ms:.1f} ms, bubble up to {100 * self.bubble_fraction:.1f} %",
            "  rank  busy ms  comp ms  comm ms  bubble ms  peak act GB  (stage, mb) alive",
        ]
        for r in self.ranks:
            lines.append(
                f"  {r.rank:4d} {r.busy_ms:8.1f} {r.comp_busy_ms:8.1f} {r.comm_busy_ms:8.1f} "
                f"{r.bubble_ms:10.1f} {r.peak_activation_bytes / 1e9:12.2f} "
                f"{r.peak_activation_units:6d}"
            )
        return "\n".join(lines)

    def _layout_text(self) -> str:
        lay = self.layout
        per = num_stages(self.schedule, lay) // lay.pp  # a V runs 2 whatever vpp says
        return (
            f"EP={lay.ep} PP={lay.pp} DP={lay.dp} VPP={per} "
            f"microbatches={lay.microbatches} ({lay.gpus} GPUs)"
        )

    def to_chrome_trace(self, path: "str | os.PathLike[str]") -> Path:
        """Write the predicted step as Chrome-trace JSON (Perfetto, chrome://tracing): one
        process per pipeline rank, a track per stream. Returns the path written."""
        out = Path(path)
        events: list[dict[str, object]] = []
        tid = {StreamKind.COMP: 0, StreamKind.COMM: 1}
        for r in self.ranks:
            events.append(
                {
                    "name": "process_name",
                    "ph": "M",
                    "pid": r.rank,
                    "args": {"name": f"PP rank {r.rank}"},
                }
            )
            for kind, t in tid.items():
                events.append(
                    {
                        "name": "thread_name",
                        "ph": "M",
                        "pid": r.rank,
                        "tid": t,
                        "args": {"name": f"{kind.value} stream"},
                    }
                )
        for s in self.spans:
            events.append(
                {
                    "name": s.step,
                    "cat": s.action,
                    "ph": "X",
                    "pid": s.rank,
                    "tid": tid.get(s.stream, 0),
                    "ts": round(s.start_ms * 1e3, 3),
                    "dur": round((s.end_ms - s.start_ms) * 1e3, 3),
                    "args": {"action": s.action},
                }
            )
        out.write_text(json.dumps({"traceEvents": events}), encoding="utf-8")
        return out

    def gantt_png(self, path: "str | os.PathLike[str]", *, title: str | None = None) -> Path:
        """Draw the predicted step (one row per rank and stream; forward blue, backward
        orange, weight gradients grey, with a legend; titled with the schedule, the layout and
        the predicted step time unless ``title``) with matplotlib (``pip install 'moe-overlap[demo]'``). Returns
        the path written."""
        try:
            matplotlib: Any = importlib.import_module("matplotlib")
            matplotlib.use("Agg")
            plt: Any = importlib.import_module("matplotlib.pyplot")
        except ImportError:
            raise ConfigError(
                "Plan.gantt_png: needs matplotlib, which is not installed; pip install "
                "'moe-overlap[demo]', or write Plan.to_chrome_trace and open it in Perfetto"
            ) from None
        out = Path(path)
        rows = [(r.rank, k) for r in self.ranks for k in (StreamKind.COMP, StreamKind.COMM)]
        index = {row: i for i, row in enumerate(rows)}
        colour = {".F@": "tab:blue", ".B@": "tab:orange", ".W@": "tab:grey"}
        fig, ax = plt.subplots(figsize=(12, 0.45 * len(rows) + 1.6))
        bars: dict[tuple[int, str], list[tuple[float, float]]] = {}
        for s in self.spans:
            c = next((v for k, v in colour.items() if k in s.step), "tab:green")
            bars.setdefault((index[(s.rank, s.stream)], c), []).append(
                (s.start_ms, s.end_ms - s.start_ms)
            )
        for (y, c), xs in bars.items():  # one call per row and colour: fast for long steps
            ax.broken_barh(xs, (y - 0.4, 0.8), facecolors=c, lw=0)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([f"rank {r} {k.value}" for r, k in rows])
        ax.invert_yaxis()
        ax.set_xlabel("predicted time from the step's start (ms)")
        default = (
            f"predicted {self.schedule.value} step: {self._layout_text()}, "
            f"{self.step_ms:.1f} ms\n{self.origin}"
        )
        ax.set_title(title or default, fontsize=10)
        used = {c for _, c in bars}
        names = {"tab:blue": "forward", "tab:orange": "backward", "tab:grey": "weight gradient"}
        names["tab:green"] = "hook"
        patches: Any = importlib.import_module("matplotlib.patches")
        handles = [patches.Patch(color=c, label=n) for c, n in names.items() if c in used]
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
        fig.tight_layout()
        fig.savefig(out, dpi=110)
        plt.close(fig)
        return out


def refuse_by_kind(where: str, costs: object) -> None:
    """Refuse a :class:`Costs` with contention per kind: the engine's step lists are
    replayed with one factor on every paired communication node."""
    if not isinstance(costs, Costs):
        return
    for name in ("contention_by_kind", "compute_contention_by_kind"):
        if getattr(costs, name) is not None:
            raise ConfigError(
                f"{where}: expected costs with {name}=None (it replays each action's "
                "steps with one factor, comm_contention), received coefficients per kind; "
                "use search_schedules, choose_schedule or replay_order for them, or "
                f"costs.replace({name}=None, comm_contention=...) here"
            )


def plan(costs: Costs, layout: Layout, schedule: "Schedule | str") -> Plan:
    """Predict one training step of ``schedule`` on ``layout`` from ``costs``.

    The schedule is lowered by the code that runs it (the engine's macro steps at one
    pipeline rank, torch's schedule classes and the library's pairing with a pipeline) and
    replayed action by action, each action's node steps on two streams with ``costs``'
    durations (see :mod:`moe_overlap.plan`)."""
    if not isinstance(cast(object, costs), Costs):
        raise ConfigError(f"plan: costs must be a Costs, received {type(costs).__name__}")
    if not isinstance(cast(object, layout), Layout):
        raise ConfigError(f"plan: layout must be a Layout, received {type(layout).__name__}")
    refuse_by_kind("plan", costs)
    which = Schedule.of(schedule)
    stage_layers(costs.num_layers, num_stages(which, layout))  # refused before lowering
    lowered = lower(which, layout)
    sim = simulate(lowered, costs, layout)
    return Plan(which, layout, sim.step_ms, sim.ranks, sim.spans, lowered.torch_class)


def costs_from_profile(
    profile: Mapping[SlotKey, float],
    *,
    num_layers: int,
    moe: Sequence[bool] | None = None,
    comm_contention: float = 0.0,
    weight_split: bool = False,
) -> Costs:
    """Costs from measured node durations (:func:`~moe_overlap.plan.load_profile`),
    repeated over ``num_layers`` layers (:func:`~moe_overlap.plan.profile_times`). ``moe``
    per layer; by default a layer is MoE when the profile has a dispatch for it. No
    activation bytes (memory is predicted from a :class:`~moe_overlap.plan.ModelSpec`).
    Refused: a ``moe`` of another length than ``num_layers``, and a profile without the
    forward or backward of a node a layer runs (its time would be taken as 0)."""
    where = "costs_from_profile"
    num_layers = check_arg(where, "num_layers", num_layers, POSITIVE)
    times = profile_times(profile, num_layers)
    if moe is None:
        moe = [(i, Slot.DISPATCH, Direction.FORWARD) in times for i in range(num_layers)]
    flags = check_arg(where, "moe", moe, _MOE_FLAGS)
    if len(flags) != num_layers:
        raise ConfigError(
            f"{where}: moe must have one flag per layer (num_layers={num_layers}), received "
            f"{len(flags)}; give one bool per layer, or none to read them from the profile"
        )
    for i, is_moe in enumerate(flags):
        for slot in _LAYER_SLOTS if is_moe else _LAYER_SLOTS[::3]:
            for d in (Direction.FORWARD, Direction.BACKWARD):
                if (i, slot, d) not in times:
                    what = f"a MoE layer (moe[{i}] True)" if is_moe else "a layer"
                    raise ConfigError(
                        f"{where}: expected the profile to time every node of {what}, "
                        f"received none for layer {i}'s {slot.value} {d.name.lower()} "
                        f"(profile layer {i % len(_profiled(profile))}); profile a step that "
                        "runs it, or set moe for the layers the profile has"
                    )
    return Costs(
        times=times,
        moe=flags,
        comm_contention=comm_contention,
        weight_split=weight_split,
    )


def fit_contention(
    costs: Costs,
    layout: Layout,
    schedule: "Schedule | str",
    measured_ms: float,
    *,
    upper: float = 2.0,
) -> float:
    """The ``comm_contention`` at which :func:`plan` predicts ``measured_ms`` for this
    overlapped step (bisection on ``[0, upper]``): a machine's figure, measured once on one
    step and used for other layouts and sizes. Refused when the step is faster than the
    prediction without contention or slower than with ``upper``, and for a step whose
    prediction does not depend on contention (no communication overlapped)."""
    where = "fit_contention"
    refuse_by_kind(where, costs)
    costs = check_arg(where, "costs", costs, Instance(Costs, "a Costs"))
    if isinstance(measured_ms, bool) or not isinstance(measured_ms, numbers.Real):
        raise refuse(f"{where}: measured_ms", "the measured step's milliseconds", measured_ms)
    upper = check_arg(where, "upper", upper, Real(above=0.0))
    lo_ms = plan(costs.replace(comm_contention=0.0), layout, schedule).step_ms
    hi_ms = plan(costs.replace(comm_contention=upper), layout, schedule).step_ms
    if not lo_ms <= measured_ms <= hi_ms:
        raise ConfigError(
            f"fit_contention: expected a measured step between {lo_ms:.3f} ms (no contention) "
            f"and {hi_ms:.3f} ms (contention {upper}), received {measured_ms:.3f} ms; the "
            "profile and the step are not of the same model and machine, or the step is "
            "bound by something the replay does not model (host time)"
        )
    if hi_ms <= lo_ms:
        raise ConfigError(
            f"fit_contention: expected a step whose prediction grows with contention, received "
            f"{Schedule.of(schedule).value} on this layout, predicted {lo_ms:.3f} ms with and "
            "without it (no communication overlapped): any contention fits; fit it on an "
            "overlapped step (combined_1f1b)"
        )
    lo, hi = 0.0, upper
    for _ in range(50):
        mid = (lo + hi) / 2
        if plan(costs.replace(comm_contention=mid), layout, schedule).step_ms < measured_ms:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def costs_from_model(
    model: ModelSpec,
    machine: Machine,
    layout: Layout,
    *,
    comm_contention: float = 0.0,
    weight_split: bool = False,
) -> Costs:
    """Costs of ``model`` on ``machine`` from the roofline and the alpha-beta links
    (:func:`~moe_overlap.plan.roofline_durations`): every node's milliseconds at
    ``layout.ep``, the activation bytes of each layer, and one activation's P2P send within
    a node and across nodes."""
    where = "costs_from_model"
    model = check_arg(where, "model", model, Instance(ModelSpec, "a ModelSpec"))
    machine = check_arg(where, "machine", machine, Instance(Machine, "a Machine"))
    layout = check_arg(where, "layout", layout, Instance(Layout, "a Layout"))
    layers = range(model.num_layers)
    nbytes = float(model.tokens * model.hidden_size * model.dtype_bytes)
    return Costs(
        times=roofline_durations(model, machine, ep=layout.ep),
        moe=tuple(model.is_moe(i) for i in layers),
        activation_bytes=tuple(model.activation_bytes(model.layer_kind(i)) for i in layers),
        pre_activation_bytes=model.activation_bytes("pre"),
        post_activation_bytes=model.activation_bytes("post"),
        p2p_ms=p2p_ms(machine, nbytes, same_node=True),
        p2p_node_ms=p2p_ms(machine, nbytes, same_node=False),
        gpus_per_node=machine.gpus_per_node,
        comm_contention=comm_contention,
        weight_split=weight_split,
    )
