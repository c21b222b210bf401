"""Choose the paired runs' step orders from measured durations.

:func:`makespan` replays a step list on two in-order streams: a step starts when its
stream is free and, unless it is a delayed weight-gradient step (which waits on nothing but
its stream), when the previous step of its microbatch has ended (the node waits on its
microbatch's event). :func:`search_order` tries every order the rules of
:mod:`~moe_overlap.steps` allow for each kind of paired run of a chunk and keeps the one
with the shortest replayed run; :func:`predict_ms` replays a whole schedule. Durations
are per ``(layer, slot, direction)``, e.g. :meth:`moe_overlap.timeline.Timeline.slot_durations`
of a serial step.
"""

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import NamedTuple, cast

from moe_overlap.args import NON_NEGATIVE, Instance, Real, check_arg, refuse
from moe_overlap.errors import ConfigError

from ._macro_steps import MacroStep, backward_microbatches, format_macro, forward_microbatches
from ._microbatch_order import ScheduleMode, macro_steps
from .core._order import PairKind, PairOrder, ScheduleOrder, before
from .core._steps import (
    ChunkShape,
    Direction,
    Role,
    Slot,
    Step,
    StreamKind,
    backward_pair_steps,
    chunk_steps,
    forward_pair_steps,
)

__all__ = [
    "OrderSearch",
    "ReplayedStep",
    "SlotKey",
    "makespan",
    "predict_ms",
    "replay",
    "search_order",
]

SlotKey = tuple["int | None", Slot, Direction]
"""``(layer, slot, direction)``: what a duration is measured for (``layer`` ``None`` for
pre- and post-process)."""


class ReplayedStep(NamedTuple):
    """One step of a replayed run, milliseconds from the run's start."""

    step: Step
    start_ms: float
    end_ms: float


_STEP_MS = Real(min=0, hint="duration must return each step's milliseconds")


def replay(steps: list[Step], duration: Callable[[Step], float]) -> list[ReplayedStep]:
    """Each step of one run of ``steps`` placed on its stream (hooks take no time and are
    left out): a step starts when its stream is free and, unless it is a delayed
    weight-gradient step, when the previous step of its microbatch has ended.
    ``duration`` gives each step's milliseconds, a finite real number >= 0."""
    free = {StreamKind.COMP: 0.0, StreamKind.COMM: 0.0}
    ready = dict.fromkeys(Role, 0.0)
    out: list[ReplayedStep] = []
    for step in steps:
        role, stream = step.role, step.stream
        if stream is StreamKind.HOST:
            continue
        if role is None or stream is None:
            raise ConfigError(
                f"replay: expected node steps, each with a role and a stream (e.g. "
                f"'f.L0.mlp.F@comp'), received {step}"
            )
        start = free[stream]
        if step.direction is not Direction.WGRAD:
            start = max(start, ready[role])
        ms = duration(step)
        # A NaN or negative time was replayed as it was, a string failed in float's +; the
        # check (and its message naming the step) runs only for a value that is not a
        # finite float >= 0.
        if type(ms) is not float or not 0.0 <= ms < math.inf:
            ms = check_arg("replay", f"duration({step})", ms, _STEP_MS)
        end = start + ms
        free[stream] = end
        if step.direction is not Direction.WGRAD:
            ready[role] = end
        out.append(ReplayedStep(step, start, end))
    return out


def makespan(steps: list[Step], duration: Callable[[Step], float]) -> float:
    """The replayed length of one run of ``steps`` (:func:`replay`'s last end)."""
    return max((r.end_ms for r in replay(steps, duration)), default=0.0)


def _lookup(durations: Mapping[SlotKey, float]) -> Callable[[Step], float]:
    def duration(step: Step) -> float:
        slot = step.slot
        return 0.0 if slot is None else durations.get((step.layer, slot, step.direction), 0.0)

    return duration


def _with_order(shape: ChunkShape, order: ScheduleOrder) -> ChunkShape:
    return dataclasses.replace(
        shape, layers=tuple(dataclasses.replace(layer, order=order) for layer in shape.layers)
    )


def _run_steps(kind: PairKind, shape: ChunkShape) -> list[Step]:
    if kind is PairKind.MIXED:
        return chunk_steps(shape, shape)
    if kind is PairKind.FORWARDS:
        return forward_pair_steps(shape, shape)
    return backward_pair_steps(shape, shape)


_KIND_FIELD = {
    PairKind.MIXED: "mixed",
    PairKind.FORWARDS: "forwards",
    PairKind.BACKWARDS: "backwards",
}


def _present(kind: PairKind, shape: ChunkShape) -> list[Step]:
    """The template steps some layer of ``shape`` has, in Megatron-Core's order."""
    moe = any(layer.is_moe for layer in shape.layers)
    mtp = any(layer.has_mtp_post for layer in shape.layers)
    delay = any(layer.delay_wgrad for layer in shape.layers)

    def has(s: Step) -> bool:
        if s.slot in (Slot.DISPATCH, Slot.COMBINE) and not moe:
            return False
        if s.slot is Slot.MTP_POST and not mtp:
            return False
        return s.direction is not Direction.WGRAD or delay

    return [s for s in PairOrder.megatron(kind).steps if has(s)]


def valid_orders(kind: PairKind, steps: Sequence[Step]) -> Iterator[tuple[Step, ...]]:
    """Every order of ``steps`` (a subset of the kind's template) the rules allow."""
    rules = before(kind, steps)
    preds: dict[Step, set[Step]] = {s: set() for s in steps}
    for a, b in rules:
        preds[b].add(a)
    out: list[Step] = []
    placed: set[Step] = set()

    def walk() -> Iterator[tuple[Step, ...]]:
        if len(out) == len(steps):
            yield tuple(out)
            return
        for s in steps:
            if s not in placed and preds[s] <= placed:
                out.append(s)
                placed.add(s)
                yield from walk()
                placed.discard(s)
                out.pop()

    yield from walk()


def complete(kind: PairKind, partial: Sequence[Step]) -> PairOrder:
    """A full template from an order of some of its steps: each missing step goes where
    Megatron-Core's order has it relative to the steps before it (then the order is checked)."""
    have = set(partial)
    full = list(partial)
    mega = PairOrder.megatron(kind).steps
    for i, s in enumerate(mega):
        if s in have:
            continue
        # after the last step placed that Megatron's order has before s
        earlier = set(mega[:i])
        at = max((i + 1 for i, t in enumerate(full) if t in earlier), default=0)
        full.insert(at, s)
        have.add(s)
    return PairOrder(kind, full)


class OrderSearch(NamedTuple):
    """What :func:`search_order` found."""

    order: ScheduleOrder
    """The fastest order of each kind (``None`` where Megatron-Core's is as fast)."""
    megatron_ms: dict[PairKind, float]
    """One run of each kind, replayed in Megatron-Core's order."""
    found_ms: dict[PairKind, float]
    """The same run in the order found."""
    tried: dict[PairKind, int]
    """How many valid orders were replayed."""


def search_order(
    shape: ChunkShape,
    durations: Mapping[SlotKey, float],
    *,
    early_attn_release: bool = False,
) -> OrderSearch:
    """The order of each kind of paired run whose replayed run of ``shape`` is shortest.

    ``shape``: the chunk (``ModelChunkSchedulePlan.shape``, or built by hand);
    ``durations``: milliseconds per ``(layer, slot, direction)`` (a missing key takes no
    time). Every valid order of a layer's steps is replayed over the whole chunk (the same
    order in every layer); Megatron-Core's order is kept unless another is strictly faster.
    With ``early_attn_release``, or a shape whose layers release attention early, only
    mixed orders that release attention early are tried.
    """
    shape = check_arg("search_order", "shape", shape, Instance(ChunkShape, "a ChunkShape"))
    durations = _checked(durations)
    duration = _lookup(durations)
    found: dict[str, PairOrder | None] = {}
    megatron_ms: dict[PairKind, float] = {}
    found_ms: dict[PairKind, float] = {}
    tried: dict[PairKind, int] = {}
    # A shape built with early release refuses mixed orders that do not release early.
    early = early_attn_release or any(layer.early_attn_release for layer in shape.layers)
    for kind in PairKind:
        base = ScheduleOrder()
        if early and kind is PairKind.MIXED:
            base = ScheduleOrder(mixed=PairOrder.megatron(kind, early_attn_release=True))
        best_ms = makespan(_run_steps(kind, _with_order(shape, base)), duration)
        megatron_ms[kind] = best_ms
        best: PairOrder | None = None
        count = 0
        for partial in valid_orders(kind, _present(kind, shape)):
            candidate = complete(kind, partial)
            early_only = early and kind is PairKind.MIXED
            if early_only and not candidate.releases_attention_early():
                continue
            count += 1
            trial = ScheduleOrder(**{_KIND_FIELD[kind]: candidate})
            ms = makespan(_run_steps(kind, _with_order(shape, trial)), duration)
            if ms < best_ms - 1e-9:
                best_ms, best = ms, candidate
        found[_KIND_FIELD[kind]] = best
        found_ms[kind] = best_ms
        tried[kind] = count
    order = ScheduleOrder(**found)
    return OrderSearch(order, megatron_ms, found_ms, tried)


def _checked(durations: object) -> dict[SlotKey, float]:
    if not isinstance(durations, Mapping):
        raise refuse(
            "search_order: durations", "a mapping (layer, slot, direction) -> ms", durations
        )
    out: dict[SlotKey, float] = {}
    items = cast("Mapping[object, object]", durations)
    for key, value in items.items():
        layer, slot, direction = _key_parts(key)
        layer_ok = layer is None or (isinstance(layer, int) and not isinstance(layer, bool))
        if not layer_ok or not isinstance(slot, Slot) or not isinstance(direction, Direction):
            raise refuse("search_order: durations key", "(layer: int | None, Slot, Direction)", key)
        out[(cast("int | None", layer), slot, direction)] = check_arg(
            "search_order", f"durations[{key}]", value, _MS
        )
    return out


def _key_parts(key: object) -> tuple[object, object, object]:
    """A durations key's three parts (three ``None`` when it is not a 3-tuple)."""
    if isinstance(key, tuple) and len(cast("tuple[object, ...]", key)) == 3:
        return cast("tuple[object, object, object]", key)
    return (None, None, None)


_MS = Real(min=0.0)


def predict_ms(
    shape: ChunkShape,
    durations: Mapping[SlotKey, float],
    n: int,
    mode: ScheduleMode,
    *,
    order: ScheduleOrder | None = None,
) -> float:
    """The replayed step of ``n`` microbatches of one chunk in ``mode``: the sum of each
    run's makespan (a run ends with both microbatches joined, so runs do not overlap)."""
    n = check_arg("predict_ms", "n", n, NON_NEGATIVE)
    duration = _lookup(_checked(durations))
    if order is not None:
        shape = _with_order(shape, order)
    return sum(makespan(macro_run_steps(step, shape), duration) for step in macro_steps(n, mode))


def macro_run_steps(step: MacroStep, shape: ChunkShape) -> list[Step]:
    """The steps of one macro step (one chunk run) of a chunk of ``shape``."""
    forward, backward = forward_microbatches(step), backward_microbatches(step)
    if len(forward) == 2:
        return forward_pair_steps(shape, shape)
    if len(backward) == 2:
        return backward_pair_steps(shape, shape)
    if len(forward) > 2 or len(backward) > 2:
        raise ConfigError(
            f"macro_run_steps: expected at most two microbatches, received {format_macro([step])}"
        )
    return chunk_steps(shape if forward else None, shape if backward else None)
