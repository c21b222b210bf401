"""The searched schedules' steps: every microbatch's step graph, the exactness rules, a replay.

A searched schedule is one issue order of :class:`SearchStep` s (``None``: a join, every
later step waits for every earlier one) over two in-order streams, as the engine issues
its steps: a step starts when its stream is free and the steps it reads have ended (a
delayed weight-gradient step waits for its stream only); with
:attr:`~moe_overlap.plan.ScheduleGraph.one_event`, also when its microbatch's forward or
backward step issued before it has ended, as the engine's one event per microbatch orders them. What may
change from today's schedules, each choice keeping every result exact:

- **chunks** (``K``): a MoE layer's dispatch, mlp and combine of one microbatch run as
  ``K`` pieces, chunk ``j``'s mlp after its dispatch chunk and its combine after its mlp
  chunk (each is measured node / ``K`` plus an overhead per chunk);
- **delayed weight gradients**: the mlp's and the pre-dispatch's weight gradients as their
  own ``W`` step, anywhere after their backward;
- **recomputation** of a slot of a microbatch: its forward keeps only part of its
  activations, a recompute step (``R``) runs the slot's forward again before its backward;
- **any number of microbatches in flight**, in any interleaving the rules allow.

The rules (:func:`check_exact`; the paired runs' rules generalised to any number of
microbatches): every microbatch runs its own steps in its own order (the order of plain
``backward()``, a ``W`` after its backward, an ``R`` before it); a slot's forwards (and
recomputes) of different microbatches run in microbatch order, chunk by chunk; a slot's
backward and weight-gradient steps of a microbatch all run before the next microbatch's
backward of that slot, so every parameter accumulates its gradients in microbatch order and
no layer owes two microbatches' weight gradients at once.
"""

import bisect
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, cast

from moe_overlap.args import (
    BOOL,
    POSITIVE,
    Instance,
    Int,
    Items,
    Real,
    Spec,
    check_arg,
    check_fields,
    replaced,
)
from moe_overlap.engine import ConfigError
from moe_overlap.plan._contention import (
    BY_KIND_SPEC,
    COMPUTE_BY_KIND_SPEC,
    ContentionKind,
    check_one_contention,
    lost_share,
    place_streams,
)
from moe_overlap.plan._layout import check_microbatches
from moe_overlap.plan._profile import check_times, refuse_unread
from moe_overlap.steps import Direction, NodeSchedule, Slot, StreamKind

__all__ = [
    "ActivationModel",
    "Replayed",
    "ScheduleGraph",
    "SearchStep",
    "StepTimes",
    "check_exact",
    "node_schedule",
    "replay_order",
]

F, B, W = Direction.FORWARD, Direction.BACKWARD, Direction.WGRAD
COMP, COMM = StreamKind.COMP, StreamKind.COMM
_CHUNKED = (Slot.DISPATCH, Slot.MLP, Slot.COMBINE)
_WGRAD_SLOTS = (Slot.PRE_DISPATCH, Slot.MLP)
_LAYER_SLOTS = (Slot.PRE_DISPATCH, Slot.DISPATCH, Slot.MLP, Slot.COMBINE)
_STEP_SLOTS = (Slot.PRE_PROCESS, *_LAYER_SLOTS, Slot.POST_PROCESS)


class SearchStep(NamedTuple):
    """One step of a searched schedule: microbatch ``microbatch``'s ``slot`` of ``layer``
    (``None``: pre- or post-process) in ``direction``, chunk ``chunk`` of a chunked slot,
    ``recompute`` for the forward run again before the backward.

    Prints as ``L0.dispatch[1].F2@comm`` (layer 0, dispatch chunk 1, microbatch 2's
    forward) or ``L3.mlp.R0@comp`` (microbatch 0's recompute of layer 3's mlp)."""

    microbatch: int
    layer: int | None
    slot: Slot
    direction: Direction
    stream: StreamKind
    chunk: int | None = None
    recompute: bool = False

    def __str__(self) -> str:
        layer = "" if self.layer is None else f"L{self.layer}."
        chunk = "" if self.chunk is None else f"[{self.chunk}]"
        d = "R" if self.recompute else self.direction.value
        return f"{layer}{self.slot.value}{chunk}.{d}{self.microbatch}@{self.stream.value}"


Order = Sequence[SearchStep | None]
"""An issue order: steps, and ``None`` for a join (later steps wait for every earlier)."""


@dataclass(frozen=True, kw_only=True)
class ScheduleGraph:
    """What every microbatch computes, and the steps' dependencies.

    ``moe``: one flag per layer; ``chunks``: pieces of a MoE layer's dispatch, mlp and
    combine; ``delay_wgrad``: the mlp's and pre-dispatch's weight gradients as ``W`` steps;
    ``recompute``: the ``(microbatch, layer, slot)`` run again before their backward
    (pre-dispatch or mlp): right before it, after the step before it ends (as a backward
    node runs it today), or with ``early_recompute`` as soon as the layer's backward
    begins (in the shadow of its communication); ``pre_post``: the model has pre- and
    post-process steps.

    ``one_event``: each microbatch's forward, backward and recompute steps also wait for
    the last forward or backward step of it issued before them, as
    :func:`~moe_overlap.combined_1f1b` runs a :class:`~moe_overlap.steps.NodeSchedule`:
    every forward and backward node of a microbatch waits on and records the microbatch's
    one event, a recompute waits on it without recording it (its slot's backward, on its
    stream, is its only reader), a ``W`` step does neither. Without it (the default) a step
    waits only for the steps it reads. Unchunked orders with no early recompute replay the
    same either way.
    """

    microbatches: int
    moe: tuple[bool, ...]
    chunks: int = 1
    delay_wgrad: bool = False
    recompute: frozenset[tuple[int, int, Slot]] = frozenset()
    early_recompute: bool = False
    pre_post: bool = True
    one_event: bool = False

    def __post_init__(self) -> None:
        check_fields(self, _GRAPH_SPECS)
        check_microbatches("ScheduleGraph.microbatches", self.microbatches, field=True)
        for item in cast("frozenset[object]", self.recompute):
            ok = isinstance(item, tuple) and len(cast("tuple[object, ...]", item)) == 3
            mb, layer, slot = cast("tuple[object, object, object]", item) if ok else (0, 0, 0)
            if not (ok and isinstance(mb, int) and isinstance(layer, int)):
                why = "give (microbatch, layer, slot) triples"
            elif not 0 <= mb < self.microbatches:
                why = f"the graph has no microbatch {mb}: name only its microbatches"
            elif not 0 <= layer < len(self.moe):
                why = f"the graph has no layer {layer}: name only its layers"
            elif slot not in _WGRAD_SLOTS:
                why = "only the pre-dispatch and the mlp can be recomputed"
            else:
                continue
            raise ConfigError(
                f"ScheduleGraph.recompute: expected (microbatch in 0..{self.microbatches - 1}"
                f", layer in 0..{len(self.moe) - 1}, Slot.PRE_DISPATCH or Slot.MLP) items, "
                f"received {item!r}; {why}"
            )

    def replace(self, **changes: object) -> "ScheduleGraph":
        """A copy with ``changes``."""
        return replaced(self, changes)

    def microbatch_steps(self, mb: int) -> list[tuple[SearchStep, tuple[SearchStep, ...]]]:
        """Microbatch ``mb``'s steps in plain ``backward()``'s order, each with the steps
        whose results it reads (a ``W`` step: its backward, for the order only)."""
        last = self.microbatches - 1
        mb = check_arg(
            "ScheduleGraph.microbatch_steps", "mb", mb, Int(0, last, max_name="microbatches-1")
        )
        out: list[tuple[SearchStep, tuple[SearchStep, ...]]] = []
        prev: tuple[SearchStep, ...] = ()

        def add(step: SearchStep, preds: Sequence[SearchStep]) -> SearchStep:
            out.append((step, tuple(preds)))
            return step

        if self.pre_post:
            prev = (add(SearchStep(mb, None, Slot.PRE_PROCESS, F, COMP), ()),)
        for layer, is_moe in enumerate(self.moe):
            pre = add(SearchStep(mb, layer, Slot.PRE_DISPATCH, F, COMP), prev)
            if not is_moe:
                prev = (add(SearchStep(mb, layer, Slot.MLP, F, COMP), (pre,)),)
                continue
            d_prev, m_prev, c_prev = [pre], list[SearchStep](), list[SearchStep]()
            for j in self._chunk_ids():
                d = add(SearchStep(mb, layer, Slot.DISPATCH, F, COMM, j), d_prev)
                m = add(SearchStep(mb, layer, Slot.MLP, F, COMP, j), [d, *m_prev])
                c = add(SearchStep(mb, layer, Slot.COMBINE, F, COMM, j), [m, *c_prev])
                d_prev, m_prev, c_prev = [d], [m], [c]
            prev = (c_prev[0],)
        if self.pre_post:
            post = add(SearchStep(mb, None, Slot.POST_PROCESS, F, COMP), prev)
            prev = (add(SearchStep(mb, None, Slot.POST_PROCESS, B, COMP), (post,)),)
        else:
            prev = (out[-1][0],)
        for layer in reversed(range(len(self.moe))):
            start = prev
            recompute = {s for s in _WGRAD_SLOTS if (mb, layer, s) in self.recompute}
            early = self.early_recompute
            r_mlp = r_pre = None
            if Slot.MLP in recompute and (early or not self.moe[layer]):
                r_mlp = add(SearchStep(mb, layer, Slot.MLP, F, COMP, None, True), start)
            if self.moe[layer]:
                c_prev, m_prev, d_prev = list(start), list[SearchStep](), list[SearchStep]()
                for j in self._chunk_ids():
                    c = add(SearchStep(mb, layer, Slot.COMBINE, B, COMM, j), c_prev)
                    if r_mlp is None and Slot.MLP in recompute:
                        r_mlp = add(SearchStep(mb, layer, Slot.MLP, F, COMP, None, True), (c,))
                    extra = [r_mlp] if r_mlp is not None and j in (None, 0) else []
                    m = add(SearchStep(mb, layer, Slot.MLP, B, COMP, j), [c, *m_prev, *extra])
                    d = add(SearchStep(mb, layer, Slot.DISPATCH, B, COMM, j), [m, *d_prev])
                    c_prev, m_prev, d_prev = [c], [m], [d]
                last_mlp, before_pre = m_prev[0], d_prev[0]
            else:
                extra = [r_mlp] if r_mlp is not None else []
                last_mlp = add(SearchStep(mb, layer, Slot.MLP, B, COMP), [*start, *extra])
                before_pre = last_mlp
            if self.delay_wgrad:
                add(SearchStep(mb, layer, Slot.MLP, W, COMP), (last_mlp,))
            if Slot.PRE_DISPATCH in recompute:
                after = start if early else (before_pre,)
                r_pre = add(SearchStep(mb, layer, Slot.PRE_DISPATCH, F, COMP, None, True), after)
            preds = [before_pre] + ([r_pre] if r_pre is not None else [])
            pre_b = add(SearchStep(mb, layer, Slot.PRE_DISPATCH, B, COMP), preds)
            if self.delay_wgrad:
                add(SearchStep(mb, layer, Slot.PRE_DISPATCH, W, COMP), (pre_b,))
            prev = (pre_b,)
        if self.pre_post:
            add(SearchStep(mb, None, Slot.PRE_PROCESS, B, COMP), prev)
        return out

    def _chunk_ids(self) -> list[int | None]:
        return [None] if self.chunks == 1 else list(range(self.chunks))

    def steps(self) -> Iterator[SearchStep]:
        """Every step of every microbatch."""
        for mb in range(self.microbatches):
            for step, _ in self.microbatch_steps(mb):
                yield step


_GRAPH_SPECS: dict[str, Spec[object]] = {
    "microbatches": POSITIVE,
    "moe": Items(BOOL, expects="one bool per layer (True: a MoE layer)", min_len=1, ordered=True),
    "chunks": POSITIVE,
    "delay_wgrad": BOOL,
    "recompute": Instance(frozenset, "a frozenset of (microbatch, layer, slot)"),
    "early_recompute": BOOL,
    "pre_post": BOOL,
    "one_event": BOOL,
}
_SHARE = Real(min=0.0)
_MS = Real(min=0.0)


def _fractions(where: str, values: Mapping[Slot, float]) -> None:
    """Refuse a mapping that is not Slot -> a share in [0, 1]."""
    for key, value in values.items():
        share = check_arg(where, f"[{key!r}]", value, _SHARE)
        if not isinstance(cast(object, key), Slot) or share > 1.0:
            raise ConfigError(
                f"{where}: expected Slot keys and shares in [0, 1], received {key!r}: {value!r}"
            )


def node_schedule(order: Order) -> NodeSchedule:
    """``order`` as the :class:`~moe_overlap.steps.NodeSchedule` that
    :func:`~moe_overlap.combined_1f1b` runs (``schedule=``): its joins left out (the engine
    needs none), recompute steps as ``R``. A chunked order is refused
    (:class:`~moe_overlap.ConfigError`): the engine runs a chunked all-to-all inside one
    dispatch, mlp and combine node (``moe_overlap.blocks``), not as steps of its own."""
    steps: list[str] = []
    for i, step in enumerate(_order_arg("node_schedule", order)):
        if step is None:
            continue
        if not isinstance(cast(object, step), SearchStep):
            raise ConfigError(
                f"node_schedule: step {i}: expected a SearchStep or None (a join), received "
                f"{type(cast(object, step)).__name__}"
            )
        if step.chunk is not None:
            raise ConfigError(
                f"node_schedule: step {i} ({step}): expected unchunked steps (chunks=1), "
                "received a chunk; the engine chunks an all-to-all inside its nodes "
                "(moe_overlap.blocks), so search with SearchSpace(chunks=(1,)) for a "
                "schedule to run"
            )
        steps.append(str(step))
    return NodeSchedule(steps)


def _order_arg(where: str, order: object, *, items: bool = True) -> list[SearchStep | None]:
    """``order`` as a list; ``items``: each item checked a :class:`SearchStep` or ``None``
    (a join)."""
    kind = type(order).__name__
    if isinstance(order, (str, bytes, Mapping)) or not isinstance(order, Iterable):
        raise ConfigError(
            f"{where}: order must be a sequence of SearchStep s and None (joins), received "
            f"{kind}; pass a SearchPoint's order"
        )
    steps = list(cast("Iterable[object]", order))
    for i, step in enumerate(steps):
        if items and step is not None and not isinstance(step, SearchStep):
            raise ConfigError(
                f"{where}: step {i}: expected a SearchStep or None (a join), received "
                f"{type(step).__name__}"
            )
    return cast("list[SearchStep | None]", steps)


def _slot_key(step: SearchStep) -> tuple[int | None, Slot]:
    return (step.layer, step.slot)


def check_exact(order: Order, graph: ScheduleGraph) -> None:
    """Refuse an order that is not exact for ``graph`` (:class:`~moe_overlap.ConfigError`
    naming the first step that breaks a rule and the rule)."""
    graph = check_arg("check_exact", "graph", graph, Instance(ScheduleGraph, "a ScheduleGraph"))
    order = _order_arg("check_exact", order, items=False)
    want = {s: p for mb in range(graph.microbatches) for s, p in graph.microbatch_steps(mb)}
    seen: set[SearchStep] = set()
    forwards: dict[tuple[int | None, Slot, int | None, bool], int] = {}
    backwards: dict[tuple[int | None, Slot], int] = {}
    for i, step in enumerate(order):
        if step is None:
            continue
        where = f"check_exact: step {i} ({step})"
        if not isinstance(cast(object, step), SearchStep):
            raise ConfigError(
                f"{where}: expected each step of the graph once, received it not a step of "
                f"this graph (a {type(cast(object, step)).__name__}; expected a SearchStep, "
                "or None for a join)"
            )
        preds = want.get(step)
        if preds is None or step in seen:
            why = "twice" if step in seen else "not a step of this graph"
            raise ConfigError(f"{where}: expected each step of the graph once, received it {why}")
        missing = [str(p) for p in preds if p not in seen]
        if missing:
            raise ConfigError(
                f"{where}: expected after {missing} (a microbatch runs its own steps in "
                "order), received before"
            )
        if step.direction is F:
            key = (step.layer, step.slot, step.chunk, step.recompute)
            last = forwards.get(key, -1)
            if step.microbatch < last:
                raise ConfigError(
                    f"{where}: expected a slot's forwards in microbatch order, received it "
                    f"after microbatch {last}'s"
                )
            forwards[key] = step.microbatch
        else:
            slot = _slot_key(step)
            last = backwards.get(slot, -1)
            if step.microbatch < last:
                raise ConfigError(
                    f"{where}: expected every backward and weight-gradient step of a slot "
                    f"before the next microbatch's backward of it, received it after "
                    f"microbatch {last}'s"
                )
            if step.direction is B:
                backwards[slot] = step.microbatch
        seen.add(step)
    if len(seen) != len(want):
        absent = sorted(str(s) for s in want.keys() - seen)
        raise ConfigError(
            f"check_exact: expected every step of the graph, received {len(seen)} of "
            f"{len(want)} (missing {absent[:4]}{' ...' if len(absent) > 4 else ''})"
        )


@dataclass(frozen=True, kw_only=True)
class StepTimes:
    """Each step's milliseconds from a serial profile's node durations.

    ``times``: node milliseconds per ``(layer, slot, direction)``
    (:attr:`~moe_overlap.plan.Costs.times`); a chunk takes its node's time / ``chunks`` plus
    ``chunk_overhead_ms``; a delayed ``W`` step its measured time, or else
    ``wgrad_share`` of the slot's backward (the backward keeps the rest); a recompute step
    ``recompute_cost`` times the slot's forward. A communication step of a microbatch
    issued while another microbatch is in flight takes ``1 + comm_contention`` times its
    time (the planner's contention).

    ``contention_by_kind`` (instead of ``comm_contention``, which must then be 0): per
    communication kind ``(slot, direction)``, a coefficient ``c``: such a step progresses at
    rate ``1 / (1 + c)`` while the compute stream runs a step and at rate 1 otherwise, so it
    is slowed by the compute actually beside it
    (:func:`~moe_overlap.plan.fit_contention_by_kind` fits it on a recorded step; a kind
    not given: 0). ``compute_contention_by_kind`` (also instead of ``comm_contention``):
    the same for compute kinds (:data:`~moe_overlap.plan.COMPUTE_CONTENTION_KINDS`, a
    recompute step's kind ``(slot, R)``), slowed while the communication stream runs a step
    (:func:`~moe_overlap.plan.fit_compute_contention_by_kind`); either alone or both.

    A key of ``times`` no replay reads is refused (a direction other than ``F``, ``B``,
    ``W``; a slot no layer, or no pre- or post-process, has a node for), and
    :func:`replay_order` refuses a dispatch or combine of a layer its graph makes dense.
    """

    times: Mapping[tuple[int | None, Slot, Direction], float]
    chunks: int = 1
    chunk_overhead_ms: float = 0.0
    wgrad_share: Mapping[Slot, float] = dataclasses.field(
        default_factory=lambda: {Slot.MLP: 0.5, Slot.PRE_DISPATCH: 0.35}
    )
    recompute_cost: float = 1.0
    comm_contention: float = 0.0
    delay_wgrad: bool = False
    contention_by_kind: Mapping[ContentionKind, float] | None = None
    compute_contention_by_kind: Mapping[ContentionKind, float] | None = None

    def __post_init__(self) -> None:
        check_fields(
            self,
            {
                "times": Instance(Mapping, "a mapping of (layer, Slot, Direction) to ms"),
                "chunks": POSITIVE,
                "chunk_overhead_ms": _MS,
                "wgrad_share": Instance(Mapping, "a mapping of Slot to a share in [0, 1]"),
                "recompute_cost": _MS,
                "comm_contention": _MS,
                "delay_wgrad": BOOL,
                "contention_by_kind": BY_KIND_SPEC,
                "compute_contention_by_kind": COMPUTE_BY_KIND_SPEC,
            },
        )
        check_times("StepTimes.times", self.times)
        refuse_unread("StepTimes.times", self.times, None, "the replay's graph.moe")
        _fractions("StepTimes.wgrad_share", self.wgrad_share)
        for slot in self.wgrad_share:
            if slot not in _WGRAD_SLOTS:
                raise ConfigError(
                    f"StepTimes.wgrad_share: expected keys Slot.PRE_DISPATCH or Slot.MLP (the "
                    f"slots with weight-gradient steps), received {slot!r}; drop it (no step "
                    "reads its share)"
                )
        check_one_contention(
            "StepTimes",
            self.comm_contention,
            self.contention_by_kind,
            self.compute_contention_by_kind,
        )

    @property
    def by_kind(self) -> bool:
        """Whether a contention per kind is given (either stream's)."""
        return self.contention_by_kind is not None or self.compute_contention_by_kind is not None

    def lost_share(self, step: SearchStep) -> float:
        """The share of its time beside the other stream ``step`` loses with
        :attr:`contention_by_kind` (a communication step) or
        :attr:`compute_contention_by_kind` (a compute step; a recompute as ``(slot, R)``);
        0 without it."""
        if step.stream is COMM:
            by_kind = self.contention_by_kind
            direction = step.direction
        else:
            by_kind = self.compute_contention_by_kind
            direction = Direction.RECOMPUTE if step.recompute else step.direction
        if by_kind is None:
            return 0.0
        return lost_share(by_kind, step.slot, direction)

    def base_ms(self, step: SearchStep) -> float:
        """``step``'s milliseconds without contention."""
        t = self.times
        key = (step.layer, step.slot)
        if step.recompute:
            return self.recompute_cost * t.get((*key, F), 0.0)
        if step.direction is F:
            ms = t.get((*key, F), 0.0)
        else:
            back = t.get((*key, B), 0.0)
            measured_w = t.get((*key, W))
            share = self.wgrad_share.get(step.slot, 0.0)
            if step.direction is W:
                return back * share if measured_w is None else measured_w
            if measured_w is None and self.delay_wgrad and step.slot in _WGRAD_SLOTS:
                ms = back * (1.0 - share)
            elif measured_w is not None and not self.delay_wgrad:
                ms = back + measured_w
            else:
                ms = back
        if step.chunk is not None:
            return ms / self.chunks + self.chunk_overhead_ms
        return ms


@dataclass(frozen=True, kw_only=True)
class ActivationModel:
    """Activation memory of one microbatch, in units (one ``tokens x hidden`` tensor).

    ``units``: per layer by slot (pre- and post-process: per microbatch); a slot's
    forward allocates them when it starts and its backward frees them when it ends (a
    chunk its share). ``static_units``: the rest of a step's peak (parameters, gradients,
    buffers) in the same units. A recomputed slot drops ``recompute_saves`` of its units
    when its forward ends and its ``R`` step allocates them again; a delayed ``W`` keeps
    ``wgrad_keeps`` of its slot's units from the backward to its end.
    """

    units: Mapping[Slot, float]
    static_units: float = 0.0
    recompute_saves: float = 0.5
    wgrad_keeps: float = 0.5

    def __post_init__(self) -> None:
        check_fields(
            self,
            {
                "units": Instance(Mapping, "a mapping of Slot to activation units >= 0"),
                "static_units": _MS,
                "recompute_saves": _SHARE,
                "wgrad_keeps": _SHARE,
            },
        )
        for key, value in self.units.items():
            if not isinstance(cast(object, key), Slot):
                raise ConfigError(f"ActivationModel.units: expected Slot keys, received {key!r}")
            if key not in _STEP_SLOTS:
                raise ConfigError(
                    f"ActivationModel.units: expected keys among the slots a step runs "
                    f"({', '.join(s.value for s in _STEP_SLOTS)}), received {key!r}; drop it "
                    "(no step allocates its units)"
                )
            check_arg("ActivationModel", f"units[{key.value}]", value, _MS)
        for name in ("recompute_saves", "wgrad_keeps"):
            share: float = getattr(self, name)
            if share > 1.0:
                raise ConfigError(
                    f"ActivationModel.{name}: expected a share in [0, 1], received {share!r}"
                )

    @classmethod
    def of_layer(
        cls,
        *,
        hidden: int,
        moe_ffn: int,
        top_k: int,
        static_units: float = 0.0,
        recompute_saves: float = 0.5,
        wgrad_keeps: float = 0.5,
    ) -> "ActivationModel":
        """Units a MoE layer's slots save (the planner's activation model, per slot): the
        norms, ``q, k, v`` and the attention output (8); the dispatched rows
        (``top_k``); the experts' gate/up and SwiGLU outputs (``3 top_k moe_ffn / hidden``);
        the expert outputs the combine weighs (``top_k``); the embedding output (1) and
        the final norm's input and output (2)."""
        where = "ActivationModel.of_layer"
        hidden = check_arg(where, "hidden", hidden, POSITIVE)
        moe_ffn = check_arg(where, "moe_ffn", moe_ffn, POSITIVE)
        top_k = check_arg(where, "top_k", top_k, POSITIVE)
        return cls(
            units={
                Slot.PRE_PROCESS: 1.0,
                Slot.PRE_DISPATCH: 8.0,
                Slot.DISPATCH: float(top_k),
                Slot.MLP: 3.0 * top_k * moe_ffn / hidden,
                Slot.COMBINE: float(top_k),
                Slot.POST_PROCESS: 2.0,
            },
            static_units=static_units,
            recompute_saves=recompute_saves,
            wgrad_keeps=wgrad_keeps,
        )

    def events(self, step: SearchStep, graph: ScheduleGraph) -> tuple[float, float]:
        """``(allocated at start, freed at end)`` units of ``step``."""
        u = self.units.get(step.slot, 0.0)
        share = u / graph.chunks if step.chunk is not None else u
        recomputed = (step.microbatch, step.layer, step.slot) in graph.recompute
        keeps = self.wgrad_keeps if graph.delay_wgrad and step.slot in _WGRAD_SLOTS else 0.0
        if step.layer is not None and step.slot in _WGRAD_SLOTS and step.direction is W:
            return 0.0, keeps * u
        if step.recompute:
            return self.recompute_saves * u, 0.0
        if step.direction is F:
            return share, self.recompute_saves * share if recomputed else 0.0
        return 0.0, share * (1.0 - keeps)


class Replayed(NamedTuple):
    """A replayed order."""

    step_ms: float
    peak_units: float
    comp_ms: float
    comm_ms: float
    spans: tuple[tuple[SearchStep, float, float], ...]


def in_flight_flags(
    mbs: Sequence[int], comm: Sequence[bool], spans: Sequence[tuple[float, float]]
) -> list[bool]:
    """Per step: a communication step that starts while another microbatch is in flight,
    i.e. after that microbatch's first step starts and before its last step ends."""
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    for m, (lo, hi) in zip(mbs, spans, strict=True):
        first[m] = min(first.get(m, lo), lo)
        last[m] = max(last.get(m, hi), hi)
    if not all(first[o] <= last[o] for o in first):  # (not from a placement) one by one
        return [
            c and any(o != m and first[o] <= lo < last[o] for o in first)
            for m, c, (lo, _) in zip(mbs, comm, spans, strict=True)
        ]
    # The microbatches in flight at ``lo``: those started by then less those ended by then
    # (an ended one started before it ended), less the step's own.
    starts, ends = sorted(first.values()), sorted(last.values())
    return [
        c
        and bisect.bisect_right(starts, lo) - bisect.bisect_right(ends, lo)
        > (first[m] <= lo < last[m])
        for m, c, (lo, _) in zip(mbs, comm, spans, strict=True)
    ]


def settle(
    place: Callable[[list[bool]], list[tuple[float, float]]],
    mbs: Sequence[int],
    comm: Sequence[bool],
    issued: list[bool],
) -> tuple[list[bool], list[tuple[float, float]]]:
    """The contention flags consistent with the times they give: start from ``issued``
    (another microbatch issued a step before and its last one after), place, recompute
    the flags from the times, until they agree (after 4 rounds a flag once set stays)."""
    flags = issued
    spans = place(flags)
    for round_ in range(12):
        new = in_flight_flags(mbs, comm, spans)
        if round_ >= 4:
            new = [a or b for a, b in zip(flags, new, strict=True)]
        if new == flags:
            break
        flags = new
        spans = place(flags)
    return flags, spans


def issued_flags(mbs: Sequence[int]) -> list[bool]:
    """Per position: another microbatch issued a step before and issues one after."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, m in enumerate(mbs):
        first.setdefault(m, i)
        last[m] = i
    # +1 where a microbatch's open span (first, last) starts, -1 where it ends: the running
    # sum at ``i`` counts the microbatches whose span holds ``i``, the step's own among them.
    change = [0] * (len(mbs) + 1)
    for o, start in first.items():
        if last[o] - start >= 2:
            change[start + 1] += 1
            change[last[o]] -= 1
    flags: list[bool] = []
    open_ = 0
    for i, m in enumerate(mbs):
        open_ += change[i]
        flags.append(open_ > (first[m] < i < last[m]))
    return flags


def peak(events: list[tuple[float, int, float]]) -> float:
    """The most units alive: ``(time, 0 free / 1 allocate, units)`` events."""
    alive = top = 0.0
    for _, _, units in sorted(events):
        alive += units
        top = max(top, alive)
    return top


def order_deps(
    order: Order, preds: Mapping[SearchStep, Sequence[SearchStep]], *, chained: bool
) -> list[list[int]]:
    """Per step of ``order`` (joins left out), the earlier steps it waits for besides its
    stream's previous one, as :func:`replay_order` places them: those it reads (a ``W``:
    none), with ``chained`` its microbatch's last forward or backward step (a ``W``: none),
    and after a join each stream's last step before it."""
    pos: dict[SearchStep, int] = {}
    last_on: dict[StreamKind, int] = {}
    joined: list[int] = []
    event: dict[int, int] = {}
    out: list[list[int]] = []
    for item in order:
        if item is None:
            joined = sorted({*joined, *last_on.values()})
            continue
        k = len(out)
        deps = list(joined)
        if item.direction is not W:
            deps += [pos[p] for p in preds[item]]
            if chained and item.microbatch in event:
                deps.append(event[item.microbatch])
            if not item.recompute:
                event[item.microbatch] = k
        out.append(deps)
        pos[item] = last_on[item.stream] = k
    return out


def replay_order(
    order: Order, graph: ScheduleGraph, times: StepTimes, memory: ActivationModel
) -> Replayed:
    """Place ``order``'s steps on two in-order streams; its step time and peak units.

    A step starts when its stream is free and the steps it reads have ended (a ``W`` step:
    its stream only); with ``graph.one_event`` also when its microbatch's forward or
    backward step issued before it has ended. A communication step takes ``1 + comm_contention``
    times its time when it starts while another microbatch is in flight (between its first
    step's start and its last step's end): the planner's paired runs, timed by what runs at
    once rather than by runs; with :attr:`StepTimes.contention_by_kind` it is slowed by the
    compute beside it instead, per kind (and with
    :attr:`StepTimes.compute_contention_by_kind` a compute step by the communication beside
    it). An order that is not exact for ``graph`` is refused (:func:`check_exact`), and so
    are times of a dispatch or combine of a layer ``graph`` makes dense."""
    where = "replay_order"
    times = check_arg(where, "times", times, Instance(StepTimes, "a StepTimes"))
    memory = check_arg(where, "memory", memory, Instance(ActivationModel, "an ActivationModel"))
    check_exact(order, graph)
    refuse_unread(f"{where}: times.times", times.times, graph.moe, "graph.moe")
    preds = {s: p for mb in range(graph.microbatches) for s, p in graph.microbatch_steps(mb)}
    steps = [s for s in order if s is not None]
    mbs = [s.microbatch for s in steps]
    comm = [s.stream is COMM for s in steps]
    base = [times.base_ms(s) for s in steps]
    factor = 1.0 + times.comm_contention
    chained = graph.one_event

    def place(flags: list[bool]) -> list[tuple[float, float]]:
        free = {COMP: 0.0, COMM: 0.0}
        floor = 0.0
        end: dict[SearchStep, float] = {}
        event: dict[int, float] = {}  # per microbatch: when its last F/B/R step ends
        out: list[tuple[float, float]] = []
        for item in order:
            if item is None:
                floor = max([floor, *free.values()])
                continue
            k = len(out)
            start = max(free[item.stream], floor)
            if item.direction is not W:
                start = max([start, *(end[p] for p in preds[item])])
                if chained:
                    start = max(start, event.get(item.microbatch, 0.0))
            stop = start + base[k] * (factor if flags[k] else 1.0)
            free[item.stream] = end[item] = stop
            if item.direction is not W and not item.recompute:
                event[item.microbatch] = stop
            out.append((start, stop))
        return out

    if times.by_kind:
        lost = [times.lost_share(s) for s in steps]
        spans = place_streams(comm, base, lost, order_deps(order, preds, chained=chained))
    else:
        issued = [c and f for c, f in zip(comm, issued_flags(mbs), strict=True)]
        _, spans = settle(place, mbs, comm, issued)
    events: list[tuple[float, int, float]] = []
    busy = {COMP: 0.0, COMM: 0.0}
    for step, (lo, hi) in zip(steps, spans, strict=True):
        busy[step.stream] += hi - lo
        alloc, freed = memory.events(step, graph)
        if alloc:
            events.append((lo, 1, alloc))
        if freed:
            events.append((hi, 0, -freed))
    step_ms = max((hi for _, hi in spans), default=0.0)
    return Replayed(
        step_ms,
        peak(events),
        busy[COMP],
        busy[COMM],
        tuple((s, lo, hi) for s, (lo, hi) in zip(steps, spans, strict=True)),
    )
