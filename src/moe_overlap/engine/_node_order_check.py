"""The exactness rules of a whole node schedule: a check the driver runs before the runner.

A :class:`~moe_overlap.steps.NodeSchedule` (the schedule core's data) lists every node step
of every microbatch in issue order; :func:`check_node_order` refuses, before any step runs,
one that would not keep every result bit-identical to plain ``backward()`` per microbatch:

1. every microbatch runs its own steps in plain ``backward()``'s order; its ``W`` steps
   (delayed weight gradients) anywhere after that slot's backward, its ``R`` steps
   (recompute) after that slot's forward and before its backward;
2. a slot's forwards, and its recomputes, of different microbatches in microbatch order;
3. a slot's backward and weight-gradient steps of a microbatch all before the next
   microbatch's backward of that slot, so every parameter accumulates its gradients in
   microbatch order and no layer owes two microbatches' weight gradients at once.

The order of rule 1, each microbatch's steps in plain ``backward()``'s order with the
recompute steps it may list, is :func:`microbatch_node_steps`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import cast

from moe_overlap.args import Instance, Int, Items, check_arg, refuse
from moe_overlap.errors import ConfigError

from .core._node_schedule import NodeSchedule
from .core._steps import ChunkShape, Direction, LayerShape, Slot, Step, StreamKind, stream_of

__all__ = ["check_node_order", "microbatch_node_steps"]

_F, _B, _W, _R = Direction.FORWARD, Direction.BACKWARD, Direction.WGRAD, Direction.RECOMPUTE
_WGRAD_SLOTS = (Slot.PRE_DISPATCH, Slot.MLP)
_LAYER_FORWARD = (Slot.PRE_DISPATCH, Slot.DISPATCH, Slot.MLP, Slot.COMBINE)


def _bare(step: Step) -> Step:
    """``step`` without its stream (the key the rules compare by)."""
    return step._replace(stream=None)


_EXACT: dict[tuple[NodeSchedule, tuple[ChunkShape, ...], frozenset[Slot]], None] = {}
"""The (schedule, shapes, recomputed slots) that passed :func:`check_node_order` lately: the
verdict is a function of them alone (all immutable), so a training loop's later steps with
the same schedule skip the walk."""
_EXACT_KEPT = 16


def check_node_order(
    schedule: NodeSchedule, shapes: Sequence[ChunkShape], *, recompute: Iterable[Slot] = ()
) -> None:
    """Refuse a schedule that is not exact for chunks of ``shapes`` (one per microbatch):
    a :class:`~moe_overlap.ConfigError` naming the first step that breaks a rule, and the rule.

    ``recompute``: the slots every layer recomputes (their ``R`` steps may be listed; an
    unlisted one runs at the slot's backward). A step's stream, when written, must be its
    node's. A verdict is remembered for the last few (schedule, shapes, slots) that passed.
    """
    given: object = recompute
    if isinstance(recompute, Iterator):  # read once (the driver passes a map)
        given = tuple(cast("Iterator[object]", recompute))
    try:
        hit = (schedule, tuple(shapes), frozenset(cast("Iterable[Slot]", given))) in _EXACT
    except TypeError:  # not iterable, or unhashable: refused by the checks below
        hit = False
    if hit:
        return
    where = "check_node_order"
    schedule = check_arg(where, "schedule", schedule, _SCHEDULE)
    checked = check_arg(where, "shapes", shapes, _SHAPES)
    slots = _recomputed(where, given)
    key = (schedule, checked, slots)
    _check_node_order(schedule, checked, slots)
    if len(_EXACT) >= _EXACT_KEPT:
        _EXACT.pop(next(iter(_EXACT)))
    _EXACT[key] = None


_SCHEDULE = Instance(NodeSchedule, "a NodeSchedule")
_SHAPES = Items(Instance(ChunkShape, "a ChunkShape"), expects="one ChunkShape per microbatch")
_SLOT_NAMES = {s.value: s for s in _WGRAD_SLOTS}


def _recomputed(where: str, recompute: object) -> frozenset[Slot]:
    """``recompute`` as the recomputable slots, or a :class:`~moe_overlap.ConfigError`."""
    if isinstance(recompute, (str, bytes)) or not isinstance(recompute, Iterable):
        raise refuse(f"{where}: recompute", _RECOMPUTE_WORDS, recompute)
    out: set[Slot] = set()
    for item in cast("Iterable[object]", recompute):
        slot = _SLOT_NAMES.get(item) if isinstance(item, str) else None
        if slot is None:
            raise refuse(f"{where}: recompute", _RECOMPUTE_WORDS, item)
        out.add(slot)
    return frozenset(out)


_RECOMPUTE_WORDS = "a collection of Slot.PRE_DISPATCH and/or Slot.MLP (the recomputable slots)"


def _check_node_order(
    schedule: NodeSchedule, shapes: Sequence[ChunkShape], slots: frozenset[Slot]
) -> None:
    """:func:`check_node_order`'s walk."""
    where = "combined_1f1b: schedule"
    n = len(shapes)
    if schedule.microbatches != n:
        raise ConfigError(
            f"{where}: expected the steps of {n} microbatches (0..{n - 1}), received "
            f"{schedule.microbatches}; list every microbatch's steps"
        )
    orders: list[list[Step]] = []  # per microbatch: its plain order (streams left out)
    own: list[dict[Step, int]] = []  # the same, step -> position
    recomputable: dict[Step, Step] = {}  # an R step -> its slot's backward
    forward_of: dict[Step, Step] = {}  # an R step -> its slot's forward
    streams: dict[Step, StreamKind | None] = {}
    for mb, shape in enumerate(shapes):
        if any(layer.has_mtp_post for layer in shape.layers):
            raise ConfigError(
                f"{where}: expected layers without a multi-token-prediction post-process "
                "(its backward feeds the pre-dispatch's weight gradients: the paired "
                "schedules run it alone), received an MTP layer; run it with "
                "combined_1f1b's macro steps (no schedule=)"
            )
        plain, recomputes = microbatch_node_steps(shape, mb, recompute=slots)
        orders.append([_bare(s) for s in plain])
        own.append({s: i for i, s in enumerate(orders[-1])})
        for s in (*plain, *recomputes):
            streams[_bare(s)] = s.stream
        for r in recomputes:
            recomputable[_bare(r)] = Step(_B, mb, None, r.layer, r.slot)
            forward_of[_bare(r)] = Step(_F, mb, None, r.layer, r.slot)
    seen: set[Step] = set()
    position = [-1] * n  # each microbatch's last plain step's position in its own order
    last_forward: dict[tuple[int | None, Slot | None, Direction], int] = {}
    last_backward: dict[tuple[int | None, Slot | None], int] = {}
    for i, step in enumerate(schedule.steps):
        at = _At(where, i, step)
        key = _bare(step)
        mb = cast(int, step.microbatch)
        if key in seen:
            raise ConfigError(f"{at}: expected each step once, received it twice")
        if key not in streams:
            raise ConfigError(
                f"{at}: expected a step of this model (its layers, its slots; W only with "
                f"delayed weight gradients, R only for recomputed slots {sorted(s.value for s in slots)}), "
                "received one it does not have"
            )
        if step.stream is not None and step.stream is not streams[key]:
            raise ConfigError(
                f"{at}: expected it on the {cast(StreamKind, streams[key]).value} stream (its "
                f"node's), received @{step.stream.value}"
            )
        if step.direction is _R:
            if forward_of[key] not in seen:
                raise ConfigError(
                    f"{at}: expected after {forward_of[key]} (a recompute reruns a forward "
                    "that ran), received before"
                )
            if recomputable[key] in seen:
                raise ConfigError(
                    f"{at}: expected before {recomputable[key]} (a recompute is for its "
                    "backward), received after"
                )
        else:
            mine = own[mb]
            p = mine[key]
            if step.direction is _W:
                backward = Step(_B, mb, None, step.layer, step.slot)
                if backward not in seen:
                    raise ConfigError(
                        f"{at}: expected after {backward} (a weight gradient needs its "
                        "backward), received before"
                    )
            elif p != _next_plain(orders[mb], position[mb]):
                expected = orders[mb][_next_plain(orders[mb], position[mb])]
                raise ConfigError(
                    f"{at}: expected microbatch {mb}'s steps in plain backward()'s order, "
                    f"its next being {expected}, received this one"
                )
            else:
                position[mb] = p
        if step.direction in (_F, _R):
            fkey = (step.layer, step.slot, step.direction)
            last = last_forward.get(fkey, -1)
            if mb < last:
                raise ConfigError(
                    f"{at}: expected a slot's {'recomputes' if step.direction is _R else 'forwards'}"
                    f" in microbatch order, received it after microbatch {last}'s"
                )
            last_forward[fkey] = mb
        else:
            bkey = (step.layer, step.slot)
            last = last_backward.get(bkey, -1)
            if mb < last:
                raise ConfigError(
                    f"{at}: expected every backward and weight-gradient step of a slot before "
                    f"the next microbatch's backward of it, received it after microbatch {last}'s"
                )
            if step.direction is _B:
                last_backward[bkey] = mb
        seen.add(key)
    missing = [s for order in orders for s in order if s not in seen]
    if missing:
        shown = ", ".join(map(str, missing[:4])) + (" ..." if len(missing) > 4 else "")
        raise ConfigError(
            f"{where}: expected every step of every microbatch, received {len(missing)} "
            f"missing ({shown})"
        )


class _At:
    """Where a refusal is, formatted only when one is raised: ``<where>: step <i> (<step>)``."""

    __slots__ = ("i", "step", "where")

    def __init__(self, where: str, i: int, step: Step) -> None:
        self.where, self.i, self.step = where, i, step

    def __format__(self, spec: str) -> str:
        return f"{self.where}: step {self.i} ({self.step})"


def _next_plain(order: list[Step], position: int) -> int:
    """The position of the next non-``W`` step after ``position`` in a microbatch's order."""
    p = position + 1
    while order[p].direction is _W:
        p += 1
    return p


def _layer_steps(
    mb: int, layer: LayerShape, recompute: frozenset[Slot]
) -> tuple[list[Step], list[Step], list[Step]]:
    """One layer's forward steps, backward steps (with ``W`` after their backward) and
    recompute steps, of microbatch ``mb``."""
    i, moe = layer.index, layer.is_moe
    slots = _LAYER_FORWARD if moe else (Slot.PRE_DISPATCH, Slot.MLP)
    forward = [Step(_F, mb, None, i, s, stream_of(s, moe)) for s in slots]
    if layer.has_mtp_post:
        forward.append(Step(_F, mb, None, i, Slot.MTP_POST, StreamKind.COMP))
    backward: list[Step] = []
    if layer.has_mtp_post:
        backward.append(Step(_B, mb, None, i, Slot.MTP_POST, StreamKind.COMP))
    for s in reversed(slots):
        backward.append(Step(_B, mb, None, i, s, stream_of(s, moe)))
        if layer.delay_wgrad and s in _WGRAD_SLOTS:
            backward.append(Step(_W, mb, None, i, s, StreamKind.COMP))
    recomputes = [Step(_R, mb, None, i, s, StreamKind.COMP) for s in _WGRAD_SLOTS if s in recompute]
    return forward, backward, recomputes


def microbatch_node_steps(
    shape: ChunkShape, mb: int, *, recompute: Iterable[Slot] = ()
) -> tuple[list[Step], list[Step]]:
    """Microbatch ``mb``'s steps of a chunk of ``shape`` in plain ``backward()``'s order, and
    the recompute steps it may list (one per recomputed slot of each layer)."""
    where = "microbatch_node_steps"
    shape = check_arg(where, "shape", shape, Instance(ChunkShape, "a ChunkShape"))
    mb = check_arg(where, "mb", mb, Int(0, exact=True))
    slots = _recomputed(where, recompute)
    out = [Step(_F, mb, None, None, Slot.PRE_PROCESS, StreamKind.COMP)]
    backwards: list[Step] = []
    recomputes: list[Step] = []
    for layer in shape.layers:
        forward, backward, r = _layer_steps(mb, layer, slots)
        out += forward
        backwards = backward + backwards
        recomputes += r
    if shape.has_post_process:
        out.append(Step(_F, mb, None, None, Slot.POST_PROCESS, StreamKind.COMP))
        out.append(Step(_B, mb, None, None, Slot.POST_PROCESS, StreamKind.COMP))
    out += backwards
    out.append(Step(_B, mb, None, None, Slot.PRE_PROCESS, StreamKind.COMP))
    return out, recomputes
