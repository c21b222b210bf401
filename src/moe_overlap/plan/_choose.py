"""Which schedule to run: the fastest exact one within a memory budget, and how to run it.

:func:`choose_schedule` searches (:func:`~moe_overlap.plan.search_schedules`) the
schedules :func:`~moe_overlap.combined_1f1b` can run: today's (serial, combined 1F1B,
fill/drain, the last with and without recomputation) and searched orders of whole steps
(any number of microbatches in flight, delayed weight gradients, whole slots recomputed,
early or late). Chunked all-to-all and recomputation of some layers only stay out: the
engine runs a chunked all-to-all inside its nodes and recomputes a slot in every layer.
"""

import dataclasses
from dataclasses import dataclass
from typing import Literal

from moe_overlap import ConfigError, ScheduleOptions
from moe_overlap.args import POSITIVE, Instance, Opt, Real, check_arg
from moe_overlap.plan._layout import check_microbatches
from moe_overlap.plan._search import Recompute, SearchPoint, SearchResult, SearchSpace
from moe_overlap.plan._search import search_schedules as _search
from moe_overlap.plan._search_steps import ActivationModel, Order, node_schedule
from moe_overlap.plan._simulate import Costs
from moe_overlap.steps import NodeSchedule, Slot

__all__ = [
    "CHOICE_SPACE",
    "QUICK_CHOICE_SPACE",
    "Bound",
    "ScheduleChoice",
    "choose_schedule",
]

_PRE, _MLP = Slot.PRE_DISPATCH, Slot.MLP

CHOICE_SPACE = SearchSpace(
    chunks=(1,),
    recompute=(Recompute(), Recompute((_MLP,)), Recompute((_PRE, _MLP))),
    memory_caps=(None, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3),
    rules=("oldest", "critical", "forward"),
    one_event=True,
)
"""The space :func:`choose_schedule` searches by default: ``benchmarks/frontier.py``'s,
less what the engine does not run as steps (chunks, recomputation of some layers), each
order timed as the engine runs it (one event per microbatch,
:attr:`~moe_overlap.plan.SearchSpace.one_event`). Its recompute choices name no layers,
so it fits a model of any layer count."""

QUICK_CHOICE_SPACE = dataclasses.replace(
    CHOICE_SPACE,
    in_flight=(1, 2, 3),
    memory_caps=(None, 1.1, 1.2),
    rules=("oldest", "critical"),
    slack_ms=(0.0,),
    improve_passes=0,
)
"""A smaller space: about twenty times fewer orders, no local search."""

Kind = Literal[
    "serial", "overlapped", "fill_drain", "serial_recompute", "fill_drain_recompute", "searched"
]
Bound = Literal["compute", "communication", "balanced", "no communication"]
"""What a serial step spends most of its time on: compute or communication at least 1.5
times the other, both within 1.5 times of each other (balanced), or no communication."""

_TODAY: dict[str, str] = {
    "serial": "serial",
    "overlapped": "combined 1F1B (overlapped)",
    "fill_drain": "fill/drain",
    "serial_recompute": "serial + recompute",
    "fill_drain_recompute": "fill/drain + recompute",
}
_KINDS: dict[str, Kind] = {
    "serial": "serial",
    "overlapped": "overlapped",
    "fill_drain": "fill_drain",
    "serial_recompute": "serial_recompute",
    "fill_drain_recompute": "fill_drain_recompute",
    "searched": "searched",
}
# Among equally fast schedules, the simplest to run first.
_PREFERENCE = tuple(_KINDS)
_RECOMPUTE_TEXT = "recompute=('pre_dispatch', 'mlp')"
_CALLS: dict[str, str] = {
    "serial": "combined_1f1b(model, microbatches, overlap=False)",
    "overlapped": "combined_1f1b(model, microbatches)",
    "fill_drain": "combined_1f1b(model, microbatches, fill_drain=True)",
    "serial_recompute": (
        f"combined_1f1b(model, microbatches, overlap=False, "
        f"options=ScheduleOptions({_RECOMPUTE_TEXT}))"
    ),
    "fill_drain_recompute": (
        f"combined_1f1b(model, microbatches, fill_drain=True, "
        f"options=ScheduleOptions({_RECOMPUTE_TEXT}))"
    ),
}
_RATIO = 1.5


@dataclass(frozen=True, kw_only=True)
class ScheduleChoice:
    """What :func:`choose_schedule` recommends.

    ``chosen``: the fastest schedule whose peak memory is within ``budget`` (times the
    serial step's; ``None``: any), the simplest of equally fast ones; ``kind``: today's
    name or ``"searched"``; ``label``: it in words. ``runner_up``: for a searched
    schedule the fastest of today's within the budget, else the next fastest within it
    (``None``: nothing else fits). ``over_budget``: the schedule with the least memory
    beyond the budget that is faster than ``chosen`` (``None``: none is). ``fastest``:
    the fastest at any memory; ``serial``: the serial step. ``bound``: what the serial
    step spends most time on; ``reason``: the choice in one line of words.

    How to run it: ``call`` (the :func:`~moe_overlap.combined_1f1b` call; today's
    schedules by their flags, which follow the layers' weight-gradient delay), or for any
    kind ``combined_1f1b(model, microbatches, options=choice.options,
    schedule=choice.schedule)``: ``schedule`` is the order as a
    :class:`~moe_overlap.steps.NodeSchedule` (``str()`` of it is the text
    :meth:`~moe_overlap.steps.NodeSchedule.parse` reads) and ``options`` the weight-gradient
    delay and recomputed slots it needs (the layers must delay as it says).
    """

    chosen: SearchPoint
    kind: Kind
    label: str
    runner_up: SearchPoint | None
    runner_up_label: str | None
    over_budget: SearchPoint | None
    fastest: SearchPoint
    serial: SearchPoint
    budget: float | None
    bound: Bound
    reason: str
    options: ScheduleOptions
    schedule: NodeSchedule
    call: str

    @property
    def step_ms(self) -> float:
        """The chosen schedule's predicted step time."""
        return self.chosen.step_ms

    @property
    def memory(self) -> float:
        """The chosen schedule's predicted peak memory, times the serial step's."""
        return self.chosen.memory

    def summary(self) -> str:
        """The recommendation, a few lines of text."""
        c, s = self.chosen, self.serial
        within = (
            "any peak memory"
            if self.budget is None
            else f"{self.budget:g}x the serial step's peak memory"
        )
        lines = [
            f"choice within {within}: {self.label}",
            f"  predicted: {c.step_ms:.1f} ms ({s.step_ms / c.step_ms:.3f}x serial's "
            f"{s.step_ms:.1f} ms), peak memory {c.memory:.3f}x serial's",
        ]
        if self.runner_up is not None:
            r = self.runner_up
            lines.append(
                f"  runner-up: {self.runner_up_label}: {r.step_ms:.1f} ms at {r.memory:.3f}x"
            )
        lines.append(f"  why: {self.reason}")
        lines.append(f"  run: {self.call}")
        return "\n".join(lines)


def choose_schedule(
    costs: Costs,
    microbatches: int,
    memory: ActivationModel,
    *,
    budget: float | None = None,
    space: SearchSpace | None = None,
) -> ScheduleChoice:
    """The fastest exact schedule of ``microbatches`` microbatches of ``costs``' model
    (one pipeline rank) whose peak memory (by ``memory``, with its static part) is within
    ``budget`` times the serial step's (``None``: any), among today's schedules and the
    orders searched in ``space`` (default :data:`CHOICE_SPACE`; ``budget`` is added to its
    memory caps). Honest when nothing beats serial, or when the budget leaves only serial.

    Refused (:class:`~moe_overlap.ConfigError`): a space with chunks or with recomputation
    of some layers or microbatches only (the engine runs neither as steps), and a budget
    below every schedule's memory.
    """
    where = "choose_schedule"
    costs = check_arg(where, "costs", costs, Instance(Costs, "a Costs"))
    microbatches = check_arg(where, "microbatches", microbatches, POSITIVE)
    check_microbatches(f"{where}: microbatches", microbatches)
    memory = check_arg(where, "memory", memory, Instance(ActivationModel, "an ActivationModel"))
    budget = check_arg(where, "budget", budget, Opt(Real(above=0.0)))
    space = check_arg(where, "space", space, Opt(Instance(SearchSpace, "a SearchSpace")))
    space = space or CHOICE_SPACE
    _check_runnable(space)
    if budget is not None and budget not in space.memory_caps:
        space = dataclasses.replace(space, memory_caps=(*space.memory_caps, budget))
    return pick(_search(costs, microbatches, memory, space), budget)


def _check_runnable(space: SearchSpace) -> None:
    """Refuse a space with schedules the engine cannot run as node steps."""
    if space.chunks != (1,):
        raise ConfigError(
            f"choose_schedule: space.chunks: expected (1,), received {space.chunks!r}; "
            "combined_1f1b runs a chunked all-to-all inside its dispatch, mlp and combine "
            "nodes (moe_overlap.blocks), not as steps of a schedule: search chunks=(1,)"
        )
    for rc in space.recompute:
        if rc.layers is not None or rc.microbatches is not None:
            raise ConfigError(
                f"choose_schedule: space.recompute: expected whole slots (Recompute(slots), "
                f"layers and microbatches None), received {rc!r}; ScheduleOptions.recompute "
                "recomputes a slot in every layer of every microbatch"
            )


def pick(found: SearchResult, budget: float | None) -> ScheduleChoice:
    """The choice among ``found``'s schedules (today's and its frontier) within ``budget``."""
    named = {id(p): k for k, p in found.today.items()}
    points = list(found.today.values())
    points += [p for p in found.frontier if id(p) not in named]

    def kind(p: SearchPoint) -> Kind:
        return _KINDS[named.get(id(p), "searched")]

    def rank(p: SearchPoint) -> tuple[float, int, float]:
        return (round(p.step_ms, 9), _PREFERENCE.index(kind(p)), p.memory)

    fits = sorted((p for p in points if budget is None or p.memory <= budget + 1e-9), key=rank)
    if not fits:
        least = min(points, key=lambda p: p.memory)
        raise ConfigError(
            f"choose_schedule: budget: expected at least the least memory of any schedule, "
            f"{least.memory:.3f}x the serial step's ({_label(least, kind(least))}), "
            f"received {budget!r}; raise the budget"
        )
    chosen = fits[0]
    chosen_kind = kind(chosen)
    if chosen_kind == "searched":
        runner_up = next((p for p in fits if kind(p) != "searched"), None)
    else:
        runner_up = fits[1] if len(fits) > 1 else None
    faster = [p for p in points if p.step_ms < chosen.step_ms - 1e-9]
    over = min(faster, key=lambda p: (p.memory, p.step_ms)) if faster else None
    serial = found.today["serial"]
    bound = _bound(serial)
    label = _label(chosen, chosen_kind)
    runner_label = None if runner_up is None else _label(runner_up, kind(runner_up))
    options = _options(chosen)
    reason = _reason(
        chosen=(chosen, label),
        kind=chosen_kind,
        runner_up=None if runner_up is None else (runner_up, runner_label or ""),
        over=None if over is None else (over, _label(over, kind(over))),
        serial=serial,
        bound=bound,
        budget=budget,
    )
    schedule = node_schedule(chosen.order)
    call = _CALLS.get(chosen_kind) or (
        f"combined_1f1b(model, microbatches, options={_options_text(options)}, "
        f"schedule=NodeSchedule.parse(text)), text: the {len(schedule.steps)} steps of "
        "choice.schedule"
    )
    return ScheduleChoice(
        chosen=chosen,
        kind=chosen_kind,
        label=label,
        runner_up=runner_up,
        runner_up_label=runner_label,
        over_budget=over,
        fastest=min(points, key=rank),
        serial=serial,
        budget=budget,
        bound=bound,
        reason=reason,
        options=options,
        schedule=schedule,
        call=call,
    )


def _bound(serial: SearchPoint) -> Bound:
    comp, comm = serial.comp_ms, serial.comm_ms
    if comm <= 0.0:
        return "no communication"
    if comp >= _RATIO * comm:
        return "compute"
    if comm >= _RATIO * comp:
        return "communication"
    return "balanced"


def _slots(point: SearchPoint) -> tuple[Slot, ...]:
    found = {slot for _, _, slot in point.graph.recompute}
    return tuple(s for s in (_PRE, _MLP) if s in found)


def _options(point: SearchPoint) -> ScheduleOptions:
    return ScheduleOptions(delay_wgrad_compute=point.graph.delay_wgrad, recompute=_slots(point))


def _options_text(options: ScheduleOptions) -> str:
    slots = ", ".join(repr(Slot(s).value) for s in options.recompute)
    comma = "," if len(options.recompute) == 1 else ""
    return (
        f"ScheduleOptions(delay_wgrad_compute={options.delay_wgrad_compute}, "
        f"recompute=({slots}{comma}))"
    )


def _most_in_flight(order: Order) -> int:
    """The most microbatches started and not finished at once in ``order``."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    steps = [s for s in order if s is not None]
    for i, s in enumerate(steps):
        first.setdefault(s.microbatch, i)
        last[s.microbatch] = i
    return max((sum(first[m] <= i <= last[m] for m in first) for i in range(len(steps))), default=0)


def _label(point: SearchPoint, kind: str) -> str:
    if kind != "searched":
        return _TODAY[kind]
    n = _most_in_flight(point.order)
    parts = [f"up to {n} microbatch{'es' if n > 1 else ''} in flight"]
    if point.graph.delay_wgrad:
        parts.append("delayed weight gradients")
    slots = _slots(point)
    if slots:
        when = " as soon as the layer's backward begins" if point.graph.early_recompute else ""
        parts.append(f"{' and '.join(s.value for s in slots)} recomputed{when}")
    return f"searched order ({', '.join(parts)})"


def _less(a: SearchPoint, b: SearchPoint) -> str:
    """How much less (or more) time ``a`` takes than ``b``, in words."""
    share = 1.0 - a.step_ms / b.step_ms
    return f"{share:.1%} less time" if share >= 0.0 else f"{-share:.1%} more time"


def _reason(
    *,
    chosen: tuple[SearchPoint, str],
    kind: Kind,
    runner_up: tuple[SearchPoint, str] | None,
    over: tuple[SearchPoint, str] | None,
    serial: SearchPoint,
    bound: Bound,
    budget: float | None,
) -> str:
    point, label = chosen
    comp, comm = serial.comp_ms, serial.comm_ms
    head = {
        "no communication": f"no communication to hide ({comp:.1f} ms of compute per step)",
        "compute": f"compute-bound ({comp:.1f} ms of compute, {comm:.1f} ms of communication "
        "per step)",
        "communication": f"communication-bound ({comm:.1f} ms of communication, {comp:.1f} ms "
        "of compute per step)",
        "balanced": f"balanced ({comp:.1f} ms of compute, {comm:.1f} ms of communication per step)",
    }[bound]
    within = "at any memory" if budget is None else f"within {budget:g}x the serial step's memory"
    more = (
        ""
        if over is None
        else (f"; a budget of {over[0].memory:.3f}x would allow {over[1]}, {_less(over[0], point)}")
    )
    if kind in ("serial", "serial_recompute"):
        if over is None:
            best = runner_up[1] if runner_up is not None else "no other schedule"
            return f"{head}: nothing beats serial {within}, the next best being {best}; run {label}"
        return f"{head}: the budget leaves {label} the fastest{more}"
    hideable = serial.step_ms - max(comp, comm)
    hidden = serial.step_ms - point.step_ms
    text = f"{head}: {label} takes {_less(point, serial)} than serial"
    if hideable > 0.0 and hidden > 0.0:
        text += f", hiding {hidden / hideable:.0%} of the {hideable:.1f} ms overlap could hide"
    if runner_up is not None and runner_up[0] is not serial:
        other, other_label = runner_up
        text += f"; {within} it takes {_less(point, other)} than {other_label}"
    return text + more
