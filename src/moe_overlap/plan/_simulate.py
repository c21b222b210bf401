"""Replay a lowered schedule on every pipeline rank from node durations.

Each rank runs its actions in order, one at a time. An action starts when its rank is free
and its inputs have arrived: a forward waits for the previous stage's forward of its
microbatch (plus a P2P transfer when that stage is on another rank), a backward for the
next stage's backward (the last stage: its own forward), a weight-gradient action for its
input-gradient action. Inside an action the engine's own step list of the chunk run is
replayed on two streams (:func:`moe_overlap.steps.replay`), so an overlapped pair costs its
replayed length, not a sum. Activation memory is counted per rank: a stage's activations of
a microbatch are alive from the start of its forward to the end of its backward (input
part).
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple, cast

from moe_overlap.args import (
    BOOL,
    POSITIVE,
    Instance,
    Items,
    Real,
    check_arg,
    check_fields,
    replaced,
)
from moe_overlap.engine import (
    ChunkShape,
    ConfigError,
    Direction,
    LayerShape,
    Role,
    Slot,
    SlotKey,
    Step,
    StreamKind,
    backward_microbatches,
    chunk_steps,
    forward_microbatches,
    macro_run_steps,
    replay,
)
from moe_overlap.plan._actions import Act, Action, Lowered
from moe_overlap.plan._contention import (
    BY_KIND_SPEC,
    COMPUTE_BY_KIND_SPEC,
    ContentionKind,
    check_one_contention,
)
from moe_overlap.plan._layout import Layout
from moe_overlap.plan._profile import refuse_unread

__all__ = ["Costs", "PlanSpan", "RankFigures", "Simulation", "simulate", "stage_layers"]

_F_ROLES = (Role.F, Role.F2)
_MS = Real(min=0.0)


def _times_spec() -> Instance[Mapping[object, object]]:
    return Instance[Mapping[object, object]](
        Mapping, "a mapping of (layer | None, Slot, Direction) to milliseconds"
    )


_COSTS_SPECS = {
    "times": _times_spec(),
    "moe": Items(BOOL, expects="one bool per layer (True: an MoE layer)", min_len=1, ordered=True),
    "activation_bytes": Items(
        _MS, expects="one byte count per layer (or none: unknown)", ordered=True
    ),
    "pre_activation_bytes": _MS,
    "post_activation_bytes": _MS,
    "p2p_ms": _MS,
    "p2p_node_ms": _MS,
    "gpus_per_node": POSITIVE,
    "comm_contention": _MS,
    "weight_split": BOOL,
    "contention_by_kind": BY_KIND_SPEC,
    "compute_contention_by_kind": COMPUTE_BY_KIND_SPEC,
}


@dataclass(frozen=True, kw_only=True)
class Costs:
    """What one microbatch costs on one rank.

    ``times`` are node milliseconds per ``(layer, slot, direction)`` for every layer of the
    model (global indices; ``None`` for pre- and post-process), as
    :meth:`moe_overlap.timeline.Timeline.slot_durations` records them or
    :func:`~moe_overlap.plan.roofline_durations` estimates them; a key a replay does not
    read (a direction other than ``F``, ``B``, ``W``; a slot the layer has no node for,
    such as a dispatch of a dense layer or a hook) is refused. ``W`` entries (weight
    gradients) are part of the backward unless ``weight_split`` (a runtime that really
    runs them apart, e.g. with delayed wgrad; ``prepare_schedule`` today computes them in
    the input-gradient action). ``comm_contention`` lengthens communication nodes in
    overlapped runs (a measured property of the machine: copies and kernels share memory
    bandwidth and links). P2P milliseconds are per activation send between neighbouring
    stages, within a node and across nodes.

    ``contention_by_kind`` (instead of ``comm_contention``, which must then be 0): a
    coefficient per communication kind, as
    :attr:`~moe_overlap.plan.StepTimes.contention_by_kind` takes it; the schedule search
    (:func:`~moe_overlap.plan.search_schedules`, :func:`~moe_overlap.plan.choose_schedule`)
    uses it, :func:`~moe_overlap.plan.plan` refuses it. ``compute_contention_by_kind``
    likewise: a coefficient per compute kind, as
    :attr:`~moe_overlap.plan.StepTimes.compute_contention_by_kind` takes it.
    """

    times: Mapping[SlotKey, float]
    moe: tuple[bool, ...]
    activation_bytes: tuple[float, ...] = ()
    pre_activation_bytes: float = 0.0
    post_activation_bytes: float = 0.0
    p2p_ms: float = 0.0
    p2p_node_ms: float = 0.0
    gpus_per_node: int = 8
    comm_contention: float = 0.0
    weight_split: bool = False
    contention_by_kind: Mapping[ContentionKind, float] | None = None
    compute_contention_by_kind: Mapping[ContentionKind, float] | None = None

    def __post_init__(self) -> None:
        check_fields(self, _COSTS_SPECS)
        check_one_contention(
            "Costs", self.comm_contention, self.contention_by_kind, self.compute_contention_by_kind
        )
        n = len(self.moe)
        if self.activation_bytes and len(self.activation_bytes) != n:
            raise ConfigError(
                f"Costs.activation_bytes: expected {n} entries (one per layer) or none, "
                f"received {len(self.activation_bytes)}"
            )
        for key, ms in self.times.items():
            parts = cast("tuple[object, ...]", key) if isinstance(cast(object, key), tuple) else ()
            layer, slot, direction = parts if len(parts) == 3 else (-1, None, None)
            kinds_ok = isinstance(slot, Slot) and isinstance(direction, Direction)
            if (
                layer is not None and (type(layer) is not int or not 0 <= layer < n)
            ) or not kinds_ok:
                raise ConfigError(
                    f"Costs.times: expected keys (layer in 0..{n - 1} or None, Slot, "
                    f"Direction), received {key!r}"
                )
            check_arg("Costs.times", f"the milliseconds of {key!r}", ms, _MS)
        refuse_unread("Costs.times", self.times, self.moe)

    @property
    def num_layers(self) -> int:
        """Layers of the model."""
        return len(self.moe)

    def replace(self, **changes: object) -> "Costs":
        """A copy with ``changes``."""
        return replaced(self, changes)


class PlanSpan(NamedTuple):
    """One replayed node: on ``rank``'s ``stream`` from ``start_ms`` to ``end_ms``."""

    rank: int
    stream: StreamKind
    start_ms: float
    end_ms: float
    action: str
    step: str


class RankFigures(NamedTuple):
    """One pipeline rank's figures of a replayed step."""

    rank: int
    busy_ms: float
    """Time with an action running (the rest is pipeline bubble)."""
    comp_busy_ms: float
    comm_busy_ms: float
    bubble_ms: float
    peak_activation_bytes: float
    peak_activation_units: int
    """The most (stage, microbatch) activations alive at once."""


class Simulation(NamedTuple):
    """A replayed step."""

    step_ms: float
    ranks: tuple[RankFigures, ...]
    spans: tuple[PlanSpan, ...]


def stage_layers(num_layers: int, num_stages: int) -> list[range]:
    """Contiguous layers of each stage; the first ``num_layers % num_stages`` stages get one
    more (Megatron-Core's even split when it divides)."""
    num_layers = check_arg("stage_layers", "num_layers", num_layers, POSITIVE)
    num_stages = check_arg("stage_layers", "num_stages", num_stages, POSITIVE)
    if num_layers < num_stages:
        raise ConfigError(
            f"plan: expected at least one layer per stage, received {num_layers} layers for "
            f"{num_stages} stages; use fewer pipeline ranks or virtual stages"
        )
    base, extra = divmod(num_layers, num_stages)
    out: list[range] = []
    lo = 0
    for s in range(num_stages):
        hi = lo + base + (1 if s < extra else 0)
        out.append(range(lo, hi))
        lo = hi
    return out


def _busy(spans: list[tuple[float, float]]) -> float:
    busy, end = 0.0, float("-inf")
    for lo, hi in sorted(spans):
        lo = max(lo, end)
        if hi > lo:
            busy += hi - lo
        end = max(end, hi)
    return busy


class _Replayer:
    """Replays one action's steps with the costs' durations."""

    def __init__(self, lowered: Lowered, costs: Costs) -> None:
        self.costs = costs
        self.last = lowered.num_stages - 1
        layers = stage_layers(costs.num_layers, lowered.num_stages)
        self.layers = layers
        self.shapes = [
            ChunkShape(
                layers=tuple(LayerShape(index=i, is_moe=costs.moe[i]) for i in r),
                has_post_process=s == self.last,
            )
            for s, r in enumerate(layers)
        ]
        self._cache: dict[tuple[object, ...], list[tuple[Step, float, float]]] = {}
        acts = costs.activation_bytes
        self.act_bytes = [sum(acts[i] for i in r) if acts else 0.0 for r in layers]
        if acts:
            self.act_bytes[0] += costs.pre_activation_bytes
            self.act_bytes[self.last] += costs.post_activation_bytes

    def _duration(
        self, f_stage: int, b_stage: int, *, paired: bool, fold_w: bool
    ) -> Callable[[Step], float]:
        times, costs = self.costs.times, self.costs
        stretch = 1.0 + costs.comm_contention if paired else 1.0

        def duration(step: Step) -> float:
            stage = f_stage if step.role in _F_ROLES else b_stage
            if step.slot is Slot.PRE_PROCESS and stage != 0:
                return 0.0
            if step.slot is Slot.POST_PROCESS and stage != self.last:
                return 0.0
            slot = step.slot
            if slot is None:
                return 0.0
            ms = times.get((step.layer, slot, step.direction), 0.0)
            if fold_w and step.direction is Direction.BACKWARD:
                ms += times.get((step.layer, slot, Direction.WGRAD), 0.0)
            if step.stream is StreamKind.COMM:
                ms *= stretch
            return ms

        return duration

    def weight_ms(self, stage: int) -> float:
        """The weight-gradient nodes of ``stage``: a ``W`` action of a runtime that splits
        them off (``Costs.weight_split``), else 0 (computed in the ``I`` action)."""
        if not self.costs.weight_split:
            return 0.0
        keys: list[int | None] = list(self.layers[stage])
        if stage == self.last:
            keys.append(None)
        return sum(
            ms
            for (layer, _slot, direction), ms in self.costs.times.items()
            if direction is Direction.WGRAD and layer in keys
        )

    def run(self, action: Action) -> list[tuple[Step, float, float]]:
        """The action's replayed steps, from its start (one replay per kind of action: the
        microbatch does not change the durations)."""
        macro = action.macro
        key = (
            action.act,
            action.stage,
            action.b_stage,
            (len(forward_microbatches(macro)), len(backward_microbatches(macro)))
            if macro is not None
            else None,
        )
        found = self._cache.get(key)
        if found is None:
            found = self._cache[key] = self._run(action)
        return found

    def _run(self, action: Action) -> list[tuple[Step, float, float]]:
        """A full backward (``B``, the backward of an ``FB``) includes the weight gradients;
        ``I`` leaves them to ``W`` when the runtime splits them."""
        shapes = self.shapes
        if action.act is Act.W:
            ms = self.weight_ms(action.stage)
            if ms == 0.0:
                return []
            step = Step(Direction.WGRAD, role=Role.B, slot=Slot.MLP, stream=StreamKind.COMP)
            return [(step, 0.0, ms)]
        if action.act is Act.RUN:
            assert action.macro is not None
            paired = len(action.macro) > 1
            steps = macro_run_steps(action.macro, shapes[0])
            duration = self._duration(0, 0, paired=paired, fold_w=True)
        elif action.act is Act.FB:
            steps = chunk_steps(shapes[action.stage], shapes[action.b_stage])
            duration = self._duration(action.stage, action.b_stage, paired=True, fold_w=True)
        elif action.act is Act.F:
            steps = chunk_steps(shapes[action.stage], None)
            duration = self._duration(action.stage, action.stage, paired=False, fold_w=True)
        else:
            steps = chunk_steps(None, shapes[action.stage])
            fold = action.act is Act.B or not self.costs.weight_split
            duration = self._duration(action.stage, action.stage, paired=False, fold_w=fold)
        return [(r.step, r.start_ms, r.end_ms) for r in replay(steps, duration)]


def simulate(lowered: Lowered, costs: Costs, layout: Layout) -> Simulation:
    """Replay ``lowered`` with ``costs`` on ``layout``'s pipeline ranks."""
    rep = _Replayer(lowered, costs)
    last = lowered.num_stages - 1
    rank_of = lowered.stage_to_rank

    def hop(src: int, dst: int) -> float:
        a, b = rank_of[src], rank_of[dst]
        if a == b:
            return 0.0
        per = costs.gpus_per_node
        same = layout.first_gpu(a) // per == layout.first_gpu(b) // per
        return costs.p2p_ms if same else costs.p2p_node_ms

    f_done: dict[tuple[int, int], float] = {}
    b_done: dict[tuple[int, int], float] = {}

    def ready(action: Action) -> float | None:
        """When the inputs of ``action`` are there (``None``: not yet known)."""
        waits: list[float] = []
        if action.act in (Act.F, Act.FB):
            s, m = action.stage, action.mb
            if s > 0:
                t = f_done.get((s - 1, m))
                if t is None:
                    return None
                waits.append(t + hop(s - 1, s))
        if action.act in (Act.B, Act.I, Act.FB):
            s, m = (
                (action.b_stage, action.b_mb) if action.act is Act.FB else (action.stage, action.mb)
            )
            if s == last:
                t = f_done.get((s, m))
                dep = 0.0
            else:
                t = b_done.get((s + 1, m))
                dep = hop(s + 1, s)
            if t is None:
                return None
            waits.append(t + dep)
        if action.act is Act.W:
            t = b_done.get((action.stage, action.mb))
            if t is None:
                return None
            waits.append(t)
        return max(waits, default=0.0)

    order = lowered.ranks
    pos = dict.fromkeys(order, 0)
    free = dict.fromkeys(order, 0.0)
    busy: dict[int, list[tuple[float, float]]] = {r: [] for r in order}
    stream_spans: dict[tuple[int, StreamKind], list[tuple[float, float]]] = {}
    memory: dict[int, list[tuple[float, int, float, int]]] = {r: [] for r in order}
    spans: list[PlanSpan] = []
    remaining = sum(len(a) for a in order.values())
    while remaining:
        progressed = False
        for r, acts in order.items():
            while pos[r] < len(acts):
                action = acts[pos[r]]
                t = ready(action)
                if t is None:
                    break
                start = max(free[r], t)
                replayed = rep.run(action)
                length = max((e for _, _, e in replayed), default=0.0)
                end = start + length
                label = str(action)
                for step, lo, hi in replayed:
                    stream = step.stream
                    assert stream is not None, f"replayed step {step} without a stream"
                    stream_spans.setdefault((r, stream), []).append((start + lo, start + hi))
                    spans.append(PlanSpan(r, stream, start + lo, start + hi, label, str(step)))
                busy[r].append((start, end))
                _account(action, start, end, rep, memory[r], f_done, b_done)
                free[r] = end
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: str(order[r][pos[r]]) for r in order if pos[r] < len(order[r])}
            raise ConfigError(f"plan: the schedule cannot proceed; ranks wait at {stuck}")
    step_ms = max(free.values(), default=0.0)
    figures: list[RankFigures] = []
    for r in sorted(order):
        peak_b, peak_u = _peaks(memory[r])
        on = _busy(busy[r])
        figures.append(
            RankFigures(
                rank=r,
                busy_ms=on,
                comp_busy_ms=_busy(stream_spans.get((r, StreamKind.COMP), [])),
                comm_busy_ms=_busy(stream_spans.get((r, StreamKind.COMM), [])),
                bubble_ms=step_ms - on,
                peak_activation_bytes=peak_b,
                peak_activation_units=peak_u,
            )
        )
    return Simulation(step_ms, tuple(figures), tuple(spans))


def _account(
    action: Action,
    start: float,
    end: float,
    rep: _Replayer,
    memory: list[tuple[float, int, float, int]],
    f_done: dict[tuple[int, int], float],
    b_done: dict[tuple[int, int], float],
) -> None:
    """Record what ``action`` produced and its activation memory events (``(time, order,
    bytes, units)``; at one instant frees come before allocations)."""
    act = action.act
    if act is Act.RUN:
        assert action.macro is not None
        for m in forward_microbatches(action.macro):
            f_done[(0, m)] = end
            memory.append((start, 1, rep.act_bytes[0], 1))
        for m in backward_microbatches(action.macro):
            b_done[(0, m)] = end
            memory.append((end, 0, -rep.act_bytes[0], -1))
        return
    if act in (Act.F, Act.FB):
        f_done[(action.stage, action.mb)] = end
        memory.append((start, 1, rep.act_bytes[action.stage], 1))
    if act in (Act.B, Act.I, Act.FB):
        s, m = (action.b_stage, action.b_mb) if act is Act.FB else (action.stage, action.mb)
        b_done[(s, m)] = end
        memory.append((end, 0, -rep.act_bytes[s], -1))


def _peaks(events: list[tuple[float, int, float, int]]) -> tuple[float, int]:
    alive_b, alive_u, peak_b, peak_u = 0.0, 0, 0.0, 0
    for _, _, nbytes, units in sorted(events):
        alive_b += nbytes
        alive_u += units
        peak_b, peak_u = max(peak_b, alive_b), max(peak_u, alive_u)
    return peak_b, peak_u
