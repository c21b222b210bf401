"""A whole schedule as one list of node steps over every microbatch, and its exactness rules.

A :class:`NodeSchedule` is what the planner's search returns (``search_schedules``'s
``order``, ``frontier.json``'s ``best_order``) and what :func:`~moe_overlap.combined_1f1b`
runs with ``schedule=``: every node step of every microbatch once, each written
``[L<layer>.]<slot>.<D><microbatch>[@stream]`` (``L3.mlp.R0@comp``: microbatch 0's
recompute of layer 3's mlp), in the order the host issues them. Any number of microbatches
may be in flight.

The rules (:func:`check_node_order`) keep every result bit-identical to plain
``backward()`` per microbatch:

1. every microbatch runs its own steps in plain ``backward()``'s order; its ``W`` steps
   (delayed weight gradients) anywhere after that slot's backward, its ``R`` steps
   (recompute) after that slot's forward and before its backward;
2. a slot's forwards, and its recomputes, of different microbatches in microbatch order;
3. a slot's backward and weight-gradient steps of a microbatch all before the next
   microbatch's backward of that slot, so every parameter accumulates its gradients in
   microbatch order and no layer owes two microbatches' weight gradients at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import cast

from moe_overlap.args import refuse

from ._errors import ConfigError
from ._kinds import Direction, Slot, StreamKind
from ._step import Step
from ._steps import ChunkShape, LayerShape

__all__ = ["NodeSchedule", "check_node_order", "microbatch_node_steps"]

_F, _B, _W, _R = Direction.FORWARD, Direction.BACKWARD, Direction.WGRAD, Direction.RECOMPUTE
_WGRAD_SLOTS = (Slot.PRE_DISPATCH, Slot.MLP)
_LAYER_FORWARD = (Slot.PRE_DISPATCH, Slot.DISPATCH, Slot.MLP, Slot.COMBINE)
_GRAMMAR = "[L<layer>.]<slot>.<D><microbatch>[@stream]"


class NodeSchedule:
    """Every node step of every microbatch, in issue order (checked as data here, against a
    model by :func:`check_node_order` when run).

    ``NodeSchedule(steps)``: :class:`~moe_overlap.steps.Step` s or their string forms, or
    one space-separated string (``str(schedule)`` reads back). Each step names a
    microbatch, a slot and a direction (``F``, ``B``, ``W``, ``R``), no role.
    """

    __slots__ = ("_hash", "_microbatches", "steps")
    steps: tuple[Step, ...]
    _hash: int
    _microbatches: int

    def __init__(self, steps: str | Iterable[Step | str]) -> None:
        if isinstance(steps, str):
            items: list[object] = list(steps.split())
        elif isinstance(cast(object, steps), Iterable):
            items = list(cast("Iterable[object]", steps))
        else:
            raise refuse(
                "NodeSchedule: steps",
                f"node steps ('{_GRAMMAR}', e.g. 'L0.mlp.F1@comp'), or one string of them",
                steps,
            )
        parsed = tuple(_node_step(i, item) for i, item in enumerate(items))
        object.__setattr__(self, "steps", parsed)
        object.__setattr__(self, "_hash", hash(parsed))  # immutable: hashed once
        count = 1 + max((cast(int, s.microbatch) for s in parsed), default=-1)
        object.__setattr__(self, "_microbatches", count)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"NodeSchedule is immutable: cannot set {name!r}")

    def __str__(self) -> str:
        return " ".join(map(str, self.steps))

    def __repr__(self) -> str:
        return f"NodeSchedule({len(self.steps)} steps, {self.microbatches} microbatches)"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NodeSchedule) and other.steps == self.steps

    def __hash__(self) -> int:
        return self._hash

    def __len__(self) -> int:
        return len(self.steps)

    @classmethod
    def parse(cls, text: str) -> NodeSchedule:
        """Read a schedule back from its string form."""
        if not isinstance(cast(object, text), str):
            raise refuse("NodeSchedule.parse: text", "the node steps, space-separated", text)
        return cls(text)

    @property
    def microbatches(self) -> int:
        """How many microbatches it runs (one more than the largest index)."""
        return self._microbatches


def _node_step(index: int, item: object) -> Step:
    """One step of a :class:`NodeSchedule`, parsed and checked for the fields it needs."""
    step = Step.parse(item) if isinstance(item, str) else item
    if not isinstance(step, Step):
        raise refuse(f"NodeSchedule: step {index}", f"a Step or '{_GRAMMAR}'", item)
    problem = None
    if step.microbatch is None:
        problem = "no microbatch"
    elif step.role is not None:
        problem = f"a role ({step.role.value}.): a schedule's steps name microbatches instead"
    elif step.slot is None:
        problem = "no slot"
    elif step.direction not in (_F, _B, _W, _R):
        problem = f"direction {step.direction.value} (expected F, B, W or R)"
    elif (step.layer is None) != (step.slot in (Slot.PRE_PROCESS, Slot.POST_PROCESS)):
        problem = "a layer slot without a layer, or a layer on pre/post-process"
    if problem is not None:
        raise ConfigError(
            f"NodeSchedule: step {index} ({step}): expected '{_GRAMMAR}' with a microbatch, "
            f"a slot and F, B, W or R, received {problem}"
        )
    return step


def _layer_steps(
    mb: int, layer: LayerShape, recompute: frozenset[Slot]
) -> tuple[list[Step], list[Step], list[Step]]:
    """One layer's forward steps, backward steps (with ``W`` after their backward) and
    recompute steps, of microbatch ``mb``."""
    i, moe = layer.index, layer.is_moe
    slots = _LAYER_FORWARD if moe else (Slot.PRE_DISPATCH, Slot.MLP)
    forward = [Step(_F, mb, None, i, s, _stream(s, moe)) for s in slots]
    if layer.has_mtp_post:
        forward.append(Step(_F, mb, None, i, Slot.MTP_POST, StreamKind.COMP))
    backward: list[Step] = []
    if layer.has_mtp_post:
        backward.append(Step(_B, mb, None, i, Slot.MTP_POST, StreamKind.COMP))
    for s in reversed(slots):
        backward.append(Step(_B, mb, None, i, s, _stream(s, moe)))
        if layer.delay_wgrad and s in _WGRAD_SLOTS:
            backward.append(Step(_W, mb, None, i, s, StreamKind.COMP))
    recomputes = [Step(_R, mb, None, i, s, StreamKind.COMP) for s in _WGRAD_SLOTS if s in recompute]
    return forward, backward, recomputes


def _stream(slot: Slot, moe: bool) -> StreamKind:
    return StreamKind.COMM if moe and slot in (Slot.DISPATCH, Slot.COMBINE) else StreamKind.COMP


def microbatch_node_steps(
    shape: ChunkShape, mb: int, *, recompute: Iterable[Slot] = ()
) -> tuple[list[Step], list[Step]]:
    """Microbatch ``mb``'s steps of a chunk of ``shape`` in plain ``backward()``'s order, and
    the recompute steps it may list (one per recomputed slot of each layer)."""
    slots = frozenset(recompute)
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
    slots = frozenset(recompute)
    key = (schedule, tuple(shapes), slots)
    if key in _EXACT:
        return
    _check_node_order(schedule, key[1], slots)
    if len(_EXACT) >= _EXACT_KEPT:
        _EXACT.pop(next(iter(_EXACT)))
    _EXACT[key] = None


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
