"""Search exact schedules for step time against peak activation memory.

:func:`search_schedules` builds, for each choice of a :class:`SearchSpace` (chunks,
delayed weight gradients, recomputation), every microbatch's step graph
(:class:`~moe_overlap.plan.ScheduleGraph`) and lets a list scheduler issue it under each
priority rule, microbatch limit and memory cap; a local search then tries to shorten each
point of the frontier. Every order it returns passes
:func:`~moe_overlap.plan.check_exact` and is timed by
:func:`~moe_overlap.plan.replay_order`. Today's schedules (serial, combined 1F1B,
fill/drain, each also with recomputation) are replayed from the engine's own step lists as
members of the same space, so that the frontier and today's points are comparable.
"""

import dataclasses
import itertools
import math
import numbers
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, cast

from moe_overlap.args import (
    BOOL,
    NON_NEGATIVE,
    POSITIVE,
    Func,
    Instance,
    Int,
    Items,
    OneOf,
    Opt,
    Real,
    Spec,
    check_arg,
    check_fields,
    refuse,
)
from moe_overlap.engine import ConfigError
from moe_overlap.plan._layout import check_microbatches
from moe_overlap.plan._list_schedule import (
    RULES,
    ScheduleIds,
    improve,
    replay_ids,
    schedule_ids,
)
from moe_overlap.plan._search_steps import (
    ActivationModel,
    Order,
    ScheduleGraph,
    SearchStep,
    StepTimes,
    check_exact,
    replay_order,
)
from moe_overlap.plan._simulate import Costs
from moe_overlap.steps import (
    ChunkShape,
    Direction,
    LayerShape,
    ScheduleMode,
    Slot,
    StreamKind,
    format_macro,
    macro_run_steps,
    macro_steps,
)

__all__ = [
    "Recompute",
    "SearchPoint",
    "SearchResult",
    "SearchSpace",
    "fit_activations",
    "pareto",
    "search_schedules",
    "today_orders",
]


class _RecomputeFields(NamedTuple):
    slots: tuple[Slot, ...] = ()
    layers: tuple[int, ...] | None = None
    microbatches: tuple[int, ...] | None = None


class Recompute(_RecomputeFields):
    """Which slots are recomputed: ``slots`` (pre-dispatch, mlp) of ``layers`` (``None``:
    every layer) of ``microbatches`` (``None``: every one). Checked at construction
    (:class:`~moe_overlap.ConfigError`), and again where it is used."""

    __slots__ = ()

    def __new__(
        cls,
        slots: tuple[Slot, ...] = (),
        layers: tuple[int, ...] | None = None,
        microbatches: tuple[int, ...] | None = None,
    ) -> "Recompute":
        made = super().__new__(cls, slots, layers, microbatches)
        return check_recompute("Recompute", made)

    def __str__(self) -> str:
        if not self.slots:
            return "none"
        text = "+".join(Slot(s).value for s in self.slots)
        if self.layers is not None:
            text += "@L" + ",".join(map(str, self.layers))
        if self.microbatches is not None:
            text += "@mb" + ",".join(map(str, self.microbatches))
        return text

    def triples(self, microbatches: int, layers: int) -> frozenset[tuple[int, int, Slot]]:
        """The ``(microbatch, layer, slot)`` recomputed."""
        mbs = range(microbatches) if self.microbatches is None else self.microbatches
        ls = range(layers) if self.layers is None else self.layers
        return frozenset((m, layer, s) for m in mbs for layer in ls for s in self.slots)


_PRE, _MLP = Slot.PRE_DISPATCH, Slot.MLP
# The slots a recomputation can run again (what ScheduleGraph.recompute takes).
_SLOT_VALUES = frozenset((_PRE.value, _MLP.value))


def _ints(value: object) -> bool:
    """``None``, or a tuple or list of ints >= 0."""
    if value is None:
        return True
    return isinstance(value, (tuple, list)) and all(
        NON_NEGATIVE.accepts(i) for i in cast("Sequence[object]", value)
    )


def check_recompute(
    where: str,
    value: object,
    *,
    microbatches: int | None = None,
    layers: int | None = None,
) -> Recompute:
    """``value`` if it is a :class:`Recompute` of slots (pre-dispatch and mlp, ``Slot`` s or
    their names) and of layers and microbatches ``None`` or ints >= 0 (with ``layers`` and
    ``microbatches``: of a step of that many), else a :class:`~moe_overlap.ConfigError`."""
    ok = isinstance(value, Recompute)
    if ok:
        rc = cast(Recompute, value)
        slots = cast(object, rc.slots)
        ok = (
            isinstance(slots, (tuple, list))
            and all(
                isinstance(x, str) and x in _SLOT_VALUES for x in cast("Sequence[object]", slots)
            )
            and _ints(rc.layers)
            and _ints(rc.microbatches)
        )
    if not ok:
        raise refuse(
            where,
            "a Recompute: a tuple of Slot s (Slot.PRE_DISPATCH, Slot.MLP), then layers and "
            "microbatches each None (all) or a tuple of ints >= 0",
            value,
            hint="e.g. Recompute((Slot.MLP,)) or Recompute((Slot.MLP,), (0, 1))",
        )
    rc = cast(Recompute, value)
    for name, plural, have, named, owner in (
        ("layer", "layers", layers, rc.layers, "model"),
        ("microbatch", "microbatches", microbatches, rc.microbatches, "step"),
    ):
        past = sorted({i for i in named or () if have is not None and i >= have})
        if have is None or not past:
            continue
        raise refuse(
            where,
            f"a Recompute of the {owner}'s {plural} (0..{have - 1}: the {owner} has {have} "
            f"{name if have == 1 else plural})",
            value,
            detail=f"it names {name if len(past) == 1 else plural} {', '.join(map(str, past))}",
            hint=f"name only the {owner}'s {plural} ({plural}=None: all of them), or drop the "
            "option",
        )
    return rc


# SearchSpace's default recompute choices: the search fits their layer subsets to the model.
_DEFAULT_RECOMPUTE = (
    Recompute(),
    Recompute((_MLP,)),
    Recompute((_PRE, _MLP)),
    Recompute((_PRE, _MLP), (0,)),
    Recompute((_PRE, _MLP), (0, 1)),
)


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """The schedules :func:`search_schedules` tries (every combination).

    ``chunks``: pieces of each MoE layer's dispatch, mlp and combine (each costs its node /
    K plus ``chunk_overhead_ms``); ``delay_wgrad``: weight gradients as their own steps
    (``wgrad_share`` of the slot's backward when the profile has no ``W`` times);
    ``recompute``: :class:`Recompute` choices (a recompute step costs ``recompute_cost``
    times the slot's forward), run right before the backward or, with
    ``early_recompute``, as soon as the layer's backward begins; ``in_flight``: the most
    microbatches started and not finished; ``stagger``: a microbatch starts only after the one before it issued that many
    steps; ``memory_caps``: the most activation memory the scheduler lets a new
    allocation reach, relative to the serial step's peak (``None``: no cap); ``rules`` and
    ``slack_ms``: the list scheduler's priority rules (:data:`RULES`) and how much later a
    step with priority may start than the earliest; ``random_orders``: extra runs per
    combination with random priorities (from ``seed``); ``improve_passes`` and
    ``improve_window``: the local search run from each frontier point (a step moved past up
    to that many steps of its stream; 0 passes: none); ``one_event``: time every order as
    the engine runs it, each microbatch's steps in issue order
    (:attr:`~moe_overlap.plan.ScheduleGraph.one_event`; off: each step waits only for the
    steps it reads).

    The default ``recompute`` (none; the mlp; the pre-dispatch and mlp of every layer, of
    layer 0, of layers 0 and 1) fits any model: its layer subsets are clipped to the
    model's layers, and a choice that then recomputes the same slots as an earlier one is
    dropped (one layer: the first three choices; two: the first four). Other ``recompute``
    choices must name only the model's layers and the step's microbatches
    (:func:`search_schedules` refuses them otherwise).
    """

    chunks: tuple[int, ...] = (1, 2, 4)
    chunk_overhead_ms: float = 0.2
    delay_wgrad: tuple[bool, ...] = (False, True)
    wgrad_share: tuple[tuple[Slot, float], ...] = ((_MLP, 0.5), (_PRE, 0.35))
    recompute: tuple[Recompute, ...] = _DEFAULT_RECOMPUTE
    recompute_cost: float = 1.0
    early_recompute: tuple[bool, ...] = (False, True)
    in_flight: tuple[int, ...] = (1, 2, 3, 4)
    stagger: tuple[int, ...] = (0, 3)
    memory_caps: tuple[float | None, ...] = (None, 1.05, 1.1, 1.2, 1.3, 1.4)
    rules: tuple[str, ...] = RULES
    slack_ms: tuple[float, ...] = (0.0, 2.0)
    random_orders: int = 0
    seed: int = 0
    improve_passes: int = 1
    improve_window: int = 3
    one_event: bool = False

    def __post_init__(self) -> None:
        check_fields(self, _SPACE_SPECS)
        for i, rc in enumerate(self.recompute):
            check_recompute(f"SearchSpace.recompute: item {i}", rc)
        for pair in self.wgrad_share:
            slot, share = pair[0], pair[-1]
            if (
                len(cast("tuple[object, ...]", pair)) != 2
                or slot not in (_PRE, _MLP)
                or not _SHARE.accepts(share)
                or not 0.0 <= share <= 1.0
            ):
                raise ConfigError(
                    f"SearchSpace.wgrad_share: expected (Slot.PRE_DISPATCH or Slot.MLP, a share "
                    f"in [0, 1]) pairs, received {self.wgrad_share!r}"
                )
        slots = [pair[0] for pair in self.wgrad_share]
        if len(set(slots)) != len(slots):
            raise ConfigError(
                f"SearchSpace.wgrad_share: expected each slot once, received {self.wgrad_share!r}"
                "; give one (slot, share) pair per slot"
            )


def _some(spec: Spec[object]) -> Items[object]:
    return Items(spec, min_len=1)


_MS = Real(min=0.0)
_SHARE = Real(min=0.0)
_SPACE_SPECS: dict[str, Spec[object]] = {
    "chunks": _some(POSITIVE),
    "chunk_overhead_ms": _MS,
    "delay_wgrad": _some(BOOL),
    "wgrad_share": Items(
        Items(Instance(object, "a Slot or a share"), min_len=2, ordered=True),
        expects="(Slot, share) pairs",
    ),
    "recompute": _some(Instance(Recompute, "a Recompute")),
    "recompute_cost": _MS,
    "early_recompute": _some(BOOL),
    "in_flight": _some(POSITIVE),
    "stagger": _some(NON_NEGATIVE),
    "memory_caps": _some(Opt(Real(above=0.0))),
    "rules": _some(OneOf(RULES)),
    "slack_ms": _some(_MS),
    "random_orders": NON_NEGATIVE,
    "seed": Int(),
    "improve_passes": NON_NEGATIVE,
    "improve_window": POSITIVE,
    "one_event": BOOL,
}


class SearchPoint(NamedTuple):
    """One replayed schedule."""

    schedule: str
    """What it is: today's name, or the choices and rule that made it."""
    step_ms: float
    memory: float
    """Peak memory relative to the serial step's (activations plus the static part)."""
    peak_units: float
    comp_ms: float
    comm_ms: float
    order: tuple[SearchStep | None, ...]
    graph: ScheduleGraph


class SearchResult(NamedTuple):
    """What :func:`search_schedules` found."""

    today: dict[str, SearchPoint]
    """``serial``, combined 1F1B (``overlapped``), ``fill_drain``; ``serial_recompute``
    and ``fill_drain_recompute`` with today's recomputation."""
    tried: list[tuple[float, float]]
    """``(step ms, memory)`` of every distinct schedule the list scheduler made, as it timed
    them (the frontier's are replayed)."""
    frontier: list[SearchPoint]
    """The schedules (today's too) no other beats in both time and memory, by memory."""


# ----------------------------------------------------------------- today's schedules


def _roles(text: str) -> dict[str, int]:
    """``F1+B0`` -> ``{f: 1, b: 0}``; ``F0+F1`` -> ``{f: 0, g: 1}``; ``B2+B3`` -> ``{b, c}``."""
    fwd = [int(p[1:]) for p in text.split("+") if p.startswith("F")]
    bwd = [int(p[1:]) for p in text.split("+") if p.startswith("B")]
    return dict(zip("fg", fwd, strict=False)) | dict(zip("bc", bwd, strict=False))


# A node step's text form (``b.L3.combine.B@comm``); hooks (``@host``) take no time.
_NODE = re.compile(
    r"(?P<role>[fgbc])\.(?:L(?P<layer>\d+)\.)?(?P<slot>[a-z_]+)\.(?P<d>[FBW])@(?P<stream>comp|comm)"
)


def today_orders(graph: ScheduleGraph) -> dict[str, Order]:
    """Serial, combined 1F1B (``overlapped``) and fill/drain as orders: the engine's step
    lists of each macro step (read through their text form), a join after each; with
    ``graph``'s recomputation, each recompute step right before its backward (as the
    backward node runs it). A graph with chunks, delayed weight gradients or early
    recomputation is refused: today's schedules have none of those steps."""
    where = "today_orders"
    graph = check_arg(where, "graph", graph, Instance(ScheduleGraph, "a ScheduleGraph"))
    if graph.chunks != 1 or graph.delay_wgrad or graph.early_recompute:
        raise ConfigError(
            f"{where}: graph: expected a graph of today's schedules (chunks=1, "
            f"delay_wgrad=False, early_recompute=False), received chunks={graph.chunks}, "
            f"delay_wgrad={graph.delay_wgrad}, early_recompute={graph.early_recompute}; "
            "their orders have no chunk, W or early recompute steps (search such a graph "
            "with search_schedules)"
        )
    shape = ChunkShape(
        layers=tuple(LayerShape(index=i, is_moe=m) for i, m in enumerate(graph.moe)),
        has_post_process=True,
    )
    out: dict[str, Order] = {}
    for name, mode in _MODES.items():
        order: list[SearchStep | None] = []
        for macro in macro_steps(graph.microbatches, mode):
            roles = _roles(format_macro([macro]))
            for node in macro_run_steps(macro, shape):
                m = _NODE.fullmatch(str(node))
                if m is None:
                    continue
                step = SearchStep(
                    microbatch=roles[m["role"]],
                    layer=None if m["layer"] is None else int(m["layer"]),
                    slot=Slot(m["slot"]),
                    direction=Direction(m["d"]),
                    stream=StreamKind(m["stream"]),
                )
                if step.direction is Direction.BACKWARD and (
                    (step.microbatch, step.layer, step.slot) in graph.recompute
                ):
                    order.append(step._replace(direction=Direction.FORWARD, recompute=True))
                order.append(step)
            order.append(None)
        out[name] = order
    return out


_MODES = {
    "serial": ScheduleMode.SERIAL,
    "overlapped": ScheduleMode.OVERLAPPED,
    "fill_drain": ScheduleMode.FILL_DRAIN,
}


def _peak(where: str, name: str, value: object) -> float:
    """A measured peak: a real number, not infinite (NaN and the rest: the fit's range
    checks refuse them, naming the figures)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isinf(value):
        raise refuse(f"{where}: {name}", "a measured peak (a finite real number > 0)", value)
    return float(value)


def fit_activations(
    memory: ActivationModel,
    costs: Costs,
    microbatches: int,
    *,
    serial: float,
    fill_drain: float,
    serial_recompute: float | None = None,
    recompute: Recompute | None = None,
) -> tuple[ActivationModel, float]:
    """``memory`` fitted to measured peaks (any unit, e.g. GB) of today's serial and
    fill/drain steps: the size of a unit and the static part, and with
    ``serial_recompute`` (the serial step with ``recompute``, default pre-dispatch and mlp
    of every layer) the share a recomputed slot drops. Returns the model and the size of
    a unit (the measured peaks' unit per activation unit)."""
    where = "fit_activations"
    memory = check_arg(where, "memory", memory, Instance(ActivationModel, "an ActivationModel"))
    costs = check_arg(where, "costs", costs, Instance(Costs, "a Costs"))
    microbatches = check_arg(where, "microbatches", microbatches, Int(2))
    check_microbatches(f"{where}: microbatches", microbatches)
    serial = _peak(where, "serial", serial)
    fill_drain = _peak(where, "fill_drain", fill_drain)
    if serial_recompute is not None:
        serial_recompute = _peak(where, "serial_recompute", serial_recompute)
    if recompute is not None:
        recompute = check_recompute(
            f"{where}: recompute", recompute, microbatches=microbatches, layers=len(costs.moe)
        )
    base = ScheduleGraph(microbatches=microbatches, moe=costs.moe)
    times = StepTimes(
        times=costs.times,
        comm_contention=costs.comm_contention,
        contention_by_kind=costs.contention_by_kind,
        compute_contention_by_kind=costs.compute_contention_by_kind,
    )
    orders = today_orders(base)
    p_serial = replay_order(orders["serial"], base, times, memory).peak_units
    p_fd = replay_order(orders["fill_drain"], base, times, memory).peak_units
    if not fill_drain > serial > 0 or p_fd <= p_serial:
        raise ConfigError(
            f"fit_activations: expected a fill/drain peak above the serial one, both above 0, "
            f"received serial {serial}, fill/drain {fill_drain}"
        )
    unit = (fill_drain - serial) / (p_fd - p_serial)
    static = serial / unit - p_serial
    fitted = dataclasses.replace(memory, static_units=static)
    if serial_recompute is None:
        return fitted, unit
    rc = recompute or Recompute((_PRE, _MLP))
    graph = base.replace(recompute=rc.triples(microbatches, len(costs.moe)))
    order = today_orders(graph)["serial"]

    def ratio(saves: float) -> float:
        model = dataclasses.replace(fitted, recompute_saves=saves)
        return (static + replay_order(order, graph, times, model).peak_units) / (static + p_serial)

    want = serial_recompute / serial
    if not ratio(1.0) <= want <= ratio(0.0):
        raise ConfigError(
            f"fit_activations: expected a serial step with recomputation between "
            f"{ratio(1.0):.3f} and 1 times the serial step's peak, received {want:.3f}"
        )
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ratio(mid) > want else (lo, mid)
    return dataclasses.replace(fitted, recompute_saves=(lo + hi) / 2), unit


# ------------------------------------------------------------------------ the search


def _point(
    name: str,
    order: Order,
    graph: ScheduleGraph,
    times: StepTimes,
    memory: ActivationModel,
    serial_units: float,
) -> SearchPoint:
    check_exact(order, graph)
    r = replay_order(order, graph, times, memory)
    ratio = (memory.static_units + r.peak_units) / (memory.static_units + serial_units)
    return SearchPoint(
        name, r.step_ms, ratio, r.peak_units, r.comp_ms, r.comm_ms, tuple(order), graph
    )


def pareto(points: Sequence[SearchPoint]) -> list[SearchPoint]:
    """The points no other beats in both step time and memory, by memory."""
    out: list[SearchPoint] = []
    for p in sorted(points, key=lambda p: (round(p.memory, 4), p.step_ms)):
        if not out or p.step_ms < out[-1].step_ms - 1e-9:
            out.append(p)
    return out


def _recompute_choices(
    where: str, space: SearchSpace, microbatches: int, layers: int
) -> list[Recompute]:
    """``space.recompute`` for a step of ``microbatches`` of a model of ``layers`` layers:
    the default's layer subsets clipped (a choice equal to an earlier one dropped), any
    other choice checked to name only the model's layers and the step's microbatches."""
    if space.recompute != _DEFAULT_RECOMPUTE:
        for i, rc in enumerate(space.recompute):
            check_recompute(
                f"{where}: space.recompute: item {i}",
                rc,
                microbatches=microbatches,
                layers=layers,
            )
        return list(space.recompute)
    out: list[Recompute] = []
    seen: set[frozenset[tuple[int, int, Slot]]] = set()
    for rc in space.recompute:
        if rc.layers is not None:
            rc = Recompute(rc.slots, tuple(i for i in rc.layers if i < layers), rc.microbatches)
        triples = rc.triples(microbatches, layers)
        if triples not in seen:
            seen.add(triples)
            out.append(rc)
    return out


def _recomputes(choices: Sequence[Recompute], space: SearchSpace) -> list[tuple[Recompute, bool]]:
    out: list[tuple[Recompute, bool]] = []
    for rc in choices:
        for early in space.early_recompute if rc.slots else (False,):
            out.append((rc, early))
    return out


def search_schedules(
    costs: Costs,
    microbatches: int,
    memory: ActivationModel,
    space: SearchSpace | None = None,
    *,
    today_recompute: Recompute | None = None,
    progress: Callable[[str], None] | None = None,
) -> SearchResult:
    """Search ``space`` for ``microbatches`` microbatches of ``costs``' model (its node
    times, MoE layers and ``comm_contention`` or ``contention_by_kind`` and
    ``compute_contention_by_kind``); memory by ``memory``, relative to the serial step.
    ``space``: default ``SearchSpace()``, its recompute choices fitted to the model's
    layers. ``today_recompute``: the recomputation of today's schedules with recompute
    (default: pre-dispatch and mlp of every layer). A recompute choice or
    ``today_recompute`` naming a layer or microbatch the model or step lacks is refused
    (:class:`~moe_overlap.ConfigError`). The frontier's orders are checked
    (:func:`~moe_overlap.plan.check_exact`) and replayed
    (:func:`~moe_overlap.plan.replay_order`)."""
    where = "search_schedules"
    costs = check_arg(where, "costs", costs, Instance(Costs, "a Costs"))
    microbatches = check_arg(where, "microbatches", microbatches, POSITIVE)
    check_microbatches(f"{where}: microbatches", microbatches)
    memory = check_arg(where, "memory", memory, Instance(ActivationModel, "an ActivationModel"))
    space = check_arg(where, "space", space, Opt(Instance(SearchSpace, "a SearchSpace")))
    space = space or SearchSpace()
    if today_recompute is not None:
        today_recompute = check_recompute(
            f"{where}: today_recompute",
            today_recompute,
            microbatches=microbatches,
            layers=len(costs.moe),
        )
    check_arg(where, "progress", progress, Opt(Func("a callable taking a str")))
    choices = _recompute_choices(where, space, microbatches, len(costs.moe))
    base = ScheduleGraph(microbatches=microbatches, moe=costs.moe, one_event=space.one_event)
    share = dict(space.wgrad_share)

    def times_of(graph: ScheduleGraph) -> StepTimes:
        return StepTimes(
            times=costs.times,
            chunks=graph.chunks,
            chunk_overhead_ms=space.chunk_overhead_ms,
            wgrad_share=share,
            recompute_cost=space.recompute_cost,
            comm_contention=costs.comm_contention,
            delay_wgrad=graph.delay_wgrad,
            contention_by_kind=costs.contention_by_kind,
            compute_contention_by_kind=costs.compute_contention_by_kind,
        )

    plain = times_of(base)
    serial_units = replay_order(today_orders(base)["serial"], base, plain, memory).peak_units
    today: dict[str, SearchPoint] = {}
    for name, order in today_orders(base).items():
        today[name] = _point(name, order, base, plain, memory, serial_units)
    rc = today_recompute or Recompute((_PRE, _MLP))
    rc_graph = base.replace(recompute=rc.triples(microbatches, len(costs.moe)))
    rc_times = times_of(rc_graph)
    for name, order in today_orders(rc_graph).items():
        if name != "overlapped":
            label = f"{name}_recompute"
            today[label] = _point(label, order, rc_graph, rc_times, memory, serial_units)
    total = memory.static_units + serial_units
    factor = 1.0 + costs.comm_contention
    found: dict[tuple[float, float], _Found] = {}
    for k in space.chunks:
        for delay in space.delay_wgrad:
            for rc, early in _recomputes(choices, space):
                triples = rc.triples(microbatches, len(costs.moe))
                graph = base.replace(
                    chunks=k, delay_wgrad=delay, recompute=triples, early_recompute=early
                )
                times = times_of(graph)
                g = ScheduleIds(graph, times, memory)
                when = " early" if early else ""
                label = f"K={k} wgrad={'delayed' if delay else 'in B'} recompute={rc}{when}"
                if progress is not None:
                    progress(label)
                runs: list[tuple[str, int | None]] = [(r, None) for r in space.rules]
                runs += [("random", space.seed + s) for s in range(space.random_orders)]
                for flight, stagger, cap, (rule, seed), slack in itertools.product(
                    space.in_flight, space.stagger, space.memory_caps, runs, space.slack_ms
                ):
                    if flight == 1 and stagger:
                        continue  # one microbatch at a time: nothing to stagger
                    cap_units = None if cap is None else cap * total - memory.static_units
                    ids, ms, units = schedule_ids(
                        g, times, rule, flight, slack, cap_units, seed, stagger
                    )
                    key = (round(ms, 3), round((memory.static_units + units) / total, 4))
                    if key not in found:
                        name = (
                            f"{label} in_flight={flight} stagger={stagger} cap={cap} "
                            f"rule={rule}{'' if seed is None else seed} slack={slack}"
                        )
                        found[key] = _Found(name, g, ids, ms, units, False)
    tried = sorted(found)
    best = _replayed_pareto(list(found.values()), factor, memory.static_units, total)
    if space.improve_passes:
        more: list[_Found] = []
        for f in best:
            if progress is not None:
                progress(f"local search from {f.name}")
            ids, ms, units = improve(
                f.g,
                f.ids,
                factor,
                max_units=f.units,
                window=space.improve_window,
                passes=space.improve_passes,
            )
            if ms < f.ms - 1e-9:
                more.append(_Found(f"{f.name} +local search", f.g, ids, ms, units, True))
        best = _replayed_pareto(best + more, factor, memory.static_units, total)
    frontier: list[SearchPoint] = []
    for f in best:
        order = [f.g.steps[i] for i in f.ids]
        point = _point(f.name, order, f.g.graph, f.g.times, memory, serial_units)
        assert abs(point.step_ms - f.ms) < 1e-6, (point.step_ms, f.ms)
        frontier.append(point)
    return SearchResult(today, tried, pareto(frontier + list(today.values())))


class _Found(NamedTuple):
    name: str
    g: ScheduleIds
    ids: list[int]
    ms: float
    units: float
    replayed: bool
    """``ms`` and ``units`` are the replay's, not the scheduler's estimate (which can miss
    the contention of a microbatch starting at the same instant)."""


def _replayed_pareto(
    found: list[_Found], factor: float, static: float, total: float
) -> list[_Found]:
    """The frontier of ``found`` with every member replayed: replay the members still
    estimated, until the frontier holds only replayed ones."""
    found = list(found)
    while True:
        front = _pareto_found(found, static, total)
        if all(f.replayed for f in front):
            return front
        where = {id(f): k for k, f in enumerate(found)}
        for f in front:
            if not f.replayed:
                ms, units = replay_ids(f.g, f.ids, factor)
                found[where[id(f)]] = f._replace(ms=ms, units=units, replayed=True)


def _pareto_found(found: list[_Found], static: float, total: float) -> list[_Found]:
    out: list[_Found] = []
    for f in sorted(found, key=lambda f: (round((static + f.units) / total, 4), f.ms)):
        if not out or f.ms < out[-1].ms - 1e-9:
            out.append(f)
    return out
