"""Contention per node kind: an all-to-all slowed by the compute beside it, compute slowed by
the all-to-all beside it, and their fits.

A communication node of kind ``(slot, direction)`` (dispatch or combine, forward or
backward) with coefficient ``c`` progresses at rate ``1 / (1 + c)`` while the compute stream
runs a node and at rate 1 otherwise: a node of ``d`` ms alone that spends ``b`` ms of its
span beside compute takes ``d + b c / (1 + c)`` ms. A compute node of kind ``(slot,
direction)`` (``F``, ``B``, ``W`` or ``R``, a recompute) with a coefficient of its own does
the same beside the communication stream. A span then depends on nodes of the other stream
placed after it in the issue order, so :func:`place_streams` runs both streams forward in
time (each node's end is an event) rather than one step after another.
"""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, cast

from moe_overlap.args import Instance, Opt, Real, Spec, check_arg
from moe_overlap.engine import ConfigError
from moe_overlap.steps import Direction, Slot, StreamKind

__all__ = [
    "BY_KIND_SPEC",
    "COMPUTE_BY_KIND_SPEC",
    "COMPUTE_CONTENTION_KINDS",
    "CONTENTION_KINDS",
    "ContentionFit",
    "ContentionKind",
    "MeasuredSpan",
    "check_compute_contention_by_kind",
    "check_contention_by_kind",
    "check_one_contention",
    "fit_compute_contention_by_kind",
    "fit_contention_by_kind",
    "lost_share",
    "parse_contention_by_kind",
    "place_streams",
]

ContentionKind = tuple[Slot, Direction]
"""A communication node's kind: its slot and direction."""
CONTENTION_KINDS: tuple[ContentionKind, ...] = (
    (Slot.DISPATCH, Direction.FORWARD),
    (Slot.DISPATCH, Direction.BACKWARD),
    (Slot.COMBINE, Direction.FORWARD),
    (Slot.COMBINE, Direction.BACKWARD),
)
"""The kinds a coefficient may be given for."""
COMPUTE_CONTENTION_KINDS: tuple[ContentionKind, ...] = (
    (Slot.PRE_PROCESS, Direction.FORWARD),
    (Slot.PRE_PROCESS, Direction.BACKWARD),
    (Slot.PRE_DISPATCH, Direction.FORWARD),
    (Slot.PRE_DISPATCH, Direction.BACKWARD),
    (Slot.PRE_DISPATCH, Direction.WGRAD),
    (Slot.PRE_DISPATCH, Direction.RECOMPUTE),
    (Slot.MLP, Direction.FORWARD),
    (Slot.MLP, Direction.BACKWARD),
    (Slot.MLP, Direction.WGRAD),
    (Slot.MLP, Direction.RECOMPUTE),
    (Slot.POST_PROCESS, Direction.FORWARD),
    (Slot.POST_PROCESS, Direction.BACKWARD),
)
"""The compute kinds a coefficient may be given for (``R``: a recompute step)."""
_COEFFICIENT = Real(min=0.0)
BY_KIND_SPEC: Spec[object] = Opt(
    Instance(Mapping, "a mapping of (Slot, Direction) of a communication node to a coefficient")
)
"""A ``contention_by_kind`` field's type (:func:`check_contention_by_kind` its items)."""
COMPUTE_BY_KIND_SPEC: Spec[object] = Opt(
    Instance(Mapping, "a mapping of (Slot, Direction) of a compute node to a coefficient")
)
"""A ``compute_contention_by_kind`` field's type (:func:`check_compute_contention_by_kind`
its items)."""


def kind_text(kind: ContentionKind) -> str:
    """A kind as the flags and files write it, ``slot.direction`` (e.g. ``combine.B``)."""
    return f"{kind[0].value}.{kind[1].value}"


def _check_by_kind(
    where: str, value: object, kinds: tuple[ContentionKind, ...], node: str, why: str
) -> Mapping[ContentionKind, float] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"{where}: expected None or a mapping of (Slot, Direction) of a {node} "
            f"node to a coefficient >= 0, received {type(value).__name__}"
        )
    known = ", ".join(kind_text(k) for k in kinds)
    given = cast("Mapping[object, object]", value)
    for key in given:
        if key not in kinds:
            raise ConfigError(
                f"{where}: expected keys among ({known}) as (Slot, Direction), received "
                f"{key!r}; {why}"
            )
    for kind in kinds:
        if kind in given:
            check_arg(where, f"[{kind_text(kind)}]", given[kind], _COEFFICIENT)
    return cast("Mapping[ContentionKind, float]", value)


def check_contention_by_kind(where: str, value: object) -> Mapping[ContentionKind, float] | None:
    """Refuse a value that is not ``None`` or a mapping of known kinds
    (:data:`CONTENTION_KINDS`) to finite coefficients ``>= 0``."""
    why = "only the dispatch and the combine communicate"
    return _check_by_kind(where, value, CONTENTION_KINDS, "communication", why)


def check_compute_contention_by_kind(
    where: str, value: object
) -> Mapping[ContentionKind, float] | None:
    """Refuse a value that is not ``None`` or a mapping of known compute kinds
    (:data:`COMPUTE_CONTENTION_KINDS`) to finite coefficients ``>= 0``."""
    why = (
        "the compute nodes are the pre- and post-process (F, B), the pre-dispatch and the "
        "mlp (F, B, W, R: a recompute); the dispatch and the combine take contention_by_kind"
    )
    return _check_by_kind(where, value, COMPUTE_CONTENTION_KINDS, "compute", why)


def parse_contention_by_kind(
    flag: str, words: Sequence[str], *, compute: bool = False
) -> dict[ContentionKind, float]:
    """Command-line words ``KIND=C`` (``KIND`` as ``slot.direction``, e.g.
    ``combine.B=0.739``) as a coefficient per kind, in the order given, for
    :attr:`~moe_overlap.plan.Costs.contention_by_kind` (``compute``:
    :attr:`~moe_overlap.plan.Costs.compute_contention_by_kind`).

    ``flag`` names the words in an error: a word without ``=``, a kind not among
    :data:`CONTENTION_KINDS` (``compute``: :data:`COMPUTE_CONTENTION_KINDS`), a kind twice, or
    a coefficient that is not a finite number ``>= 0`` is a :class:`~moe_overlap.ConfigError`
    naming the word."""
    given = cast(object, words)
    if isinstance(given, (str, bytes)) or not isinstance(given, Sequence):
        raise ConfigError(
            f"{flag}: expected a sequence of KIND=C words, received {type(given).__name__}; "
            "pass a list such as ['combine.B=0.739']"
        )
    kinds = COMPUTE_CONTENTION_KINDS if compute else CONTENTION_KINDS
    by_name = {kind_text(k): k for k in kinds}
    known = ", ".join(by_name)
    if compute:
        node, example, other = "compute", "mlp.B=0.1", "the dispatch and the combine are not"
    else:
        node, example, other = "communication", "combine.B=0.7", "only those communicate"
    out: dict[ContentionKind, float] = {}
    for word in cast("Sequence[object]", given):
        if not isinstance(word, str) or "=" not in word:
            raise ConfigError(
                f"{flag}: expected KIND=C (e.g. {example}), received "
                f"{word!r}; write each kind and its coefficient joined by '='"
            )
        name, _, value = word.partition("=")
        if name not in by_name:
            raise ConfigError(
                f"{flag}: expected KIND among the {node} kinds ({known}), received {word!r} "
                f"({other}); write the kind as slot.direction"
            )
        try:
            c = float(value)
        except ValueError:
            raise ConfigError(
                f"{flag}: expected a coefficient C that is a number, received {word!r}; "
                "write e.g. 0.5"
            ) from None
        if not 0.0 <= c < math.inf:
            raise ConfigError(
                f"{flag}: expected a finite coefficient >= 0, received {word!r}; 0 is no contention"
            )
        if by_name[name] in out:
            raise ConfigError(
                f"{flag}: expected each kind once, received {name} again in {word!r}; "
                "give one coefficient per kind"
            )
        out[by_name[name]] = c
    return out


def check_one_contention(
    where: str, factor: float, by_kind: object, compute_by_kind: object = None
) -> None:
    """Refuse a ``contention_by_kind`` or ``compute_contention_by_kind`` that is not one, or
    either given beside a ``comm_contention`` other than 0 (one contention model at a
    time)."""
    check_contention_by_kind(f"{where}.contention_by_kind", by_kind)
    check_compute_contention_by_kind(f"{where}.compute_contention_by_kind", compute_by_kind)
    for name, value in (
        ("contention_by_kind", by_kind),
        ("compute_contention_by_kind", compute_by_kind),
    ):
        if value is not None and factor != 0.0:
            raise ConfigError(
                f"{where}: expected one contention model, received comm_contention={factor!r} "
                f"and {name}; set comm_contention=0.0 to use the coefficients per kind"
            )


def lost_share(by_kind: Mapping[ContentionKind, float], slot: Slot, direction: Direction) -> float:
    """``c / (1 + c)`` of the kind (0 for a kind not given): the share of its time beside
    the other stream a node loses."""
    c = by_kind.get((slot, direction), 0.0)
    return c / (1.0 + c)


def place_streams(
    comm: Sequence[bool],
    ms: Sequence[float],
    lost: Sequence[float],
    deps: Sequence[Sequence[int]],
) -> list[tuple[float, float]]:
    """Each step's ``(start, end)`` on two in-order streams, steps given in issue order.

    A step starts when the previous step of its stream and its ``deps`` (earlier steps)
    have ended. A step takes ``ms`` plus ``lost`` (``c / (1 + c)``, below 1) times the
    milliseconds the other stream is busy during it. Both streams advance together from
    one end to the next, so the answer is exact: no rounds, no tolerance. With ``lost`` all
    0 every end is its start plus ``ms``; a compute step of ``lost`` 0 ends there whatever
    the communication steps' ``lost``."""
    n = len(ms)
    queues: tuple[list[int], list[int]] = ([], [])
    for i in range(n):
        queues[comm[i]].append(i)
    head = [0, 0]
    done = [False] * n
    spans: list[tuple[float, float]] = [(0.0, 0.0)] * n
    free = [0.0, 0.0]
    running: list[int | None] = [None, None]  # per stream: compute, communication
    beside = [0.0, 0.0]  # per stream: its running step's ms beside the other's so far
    t = 0.0
    while True:
        for s in (0, 1):  # start each stream's next step if its deps have ended
            if running[s] is not None or head[s] == len(queues[s]):
                continue
            i = queues[s][head[s]]
            if all(done[d] for d in deps[i]):
                start = max([free[s], *(spans[d][1] for d in deps[i])])
                head[s] += 1
                running[s] = i
                spans[i] = (start, start + ms[i])
                beside[s] = 0.0
        if running[0] is None and running[1] is None:
            if head[0] < len(queues[0]) or head[1] < len(queues[1]):
                raise ConfigError(
                    "place_streams: expected each step's deps earlier in the order than it, "
                    "received a step waiting for a later one"
                )
            return spans
        ends = [math.inf, math.inf]  # when each ends if the other stream stays as it is
        for s in (0, 1):
            on = running[s]
            if on is None:
                continue
            if s == 0 and not lost[on]:  # a compute step no contention slows
                ends[s] = spans[on][1]
                continue
            left = max(0.0, spans[on][0] + ms[on] + lost[on] * beside[s] - t)
            ends[s] = t + (left if running[1 - s] is None else left / (1.0 - lost[on]))
        nxt = max(t, min(ends))
        if running[0] is not None and running[1] is not None:
            beside[0] += nxt - t
            beside[1] += nxt - t
        t = nxt
        for s in (0, 1):
            on = running[s]
            if on is not None and ends[s] <= nxt:
                end = spans[on][0] + ms[on] + lost[on] * beside[s]
                spans[on] = (spans[on][0], end)
                free[s] = end
                done[on], running[s] = True, None


# --------------------------------------------------------------------------------- the fit


class MeasuredSpan(NamedTuple):
    """One node of a recorded step: its slot, direction (``R``: a recompute) and stream,
    when it ran, and its milliseconds alone (the same node timed with nothing beside it,
    e.g. on one stream), which a fit reads of the nodes whose coefficients it fits."""

    slot: Slot
    direction: Direction
    stream: StreamKind
    start_ms: float
    end_ms: float
    alone_ms: float | None = None


@dataclass(frozen=True, kw_only=True)
class ContentionFit:
    """What :func:`fit_contention_by_kind` (or :func:`fit_compute_contention_by_kind`)
    found, per kind (:data:`CONTENTION_KINDS`, or :data:`COMPUTE_CONTENTION_KINDS`).

    ``coefficients``: the coefficient of every kind, as
    :attr:`~moe_overlap.plan.StepTimes.contention_by_kind` (or
    :attr:`~moe_overlap.plan.StepTimes.compute_contention_by_kind`) takes them;
    ``measured_ms``, ``alone_ms`` and ``beside_ms``: the kind's nodes' sums (measured span,
    alone, beside the other stream busy); ``unseen``: the kinds never beside the other
    stream (coefficient 0: nothing measured them); ``clamped``: the kinds no slower than
    alone (coefficient 0, the least the model takes)."""

    coefficients: Mapping[ContentionKind, float]
    measured_ms: Mapping[ContentionKind, float]
    alone_ms: Mapping[ContentionKind, float]
    beside_ms: Mapping[ContentionKind, float]
    unseen: tuple[ContentionKind, ...]
    clamped: tuple[ContentionKind, ...]


def _merged(spans: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _sequence(where: str, spans: Sequence[MeasuredSpan]) -> Sequence[object]:
    given = cast(object, spans)
    if isinstance(given, (str, bytes, Mapping)) or not isinstance(given, Sequence):
        raise ConfigError(
            f"{where}: spans must be a sequence of MeasuredSpan, received "
            f"{type(cast(object, spans)).__name__}"
        )
    return cast("Sequence[object]", given)


def _checked_span(where: str, i: int, span: object) -> MeasuredSpan:
    """``spans[i]`` checked a :class:`MeasuredSpan` ending no earlier than it starts."""
    if not isinstance(span, MeasuredSpan):
        raise ConfigError(
            f"{where}: spans[{i}]: expected a MeasuredSpan, received {type(span).__name__}"
        )
    lo = check_arg(where, f"spans[{i}].start_ms", span.start_ms, Real())
    check_arg(where, f"spans[{i}].end_ms", span.end_ms, Real(min=lo))
    return span


def _fit(
    where: str,
    kinds: tuple[ContentionKind, ...],
    fitted: Sequence[MeasuredSpan],
    other: Sequence[MeasuredSpan],
    other_name: str,
) -> ContentionFit:
    """The coefficient of each of ``kinds`` from the ``fitted`` nodes (``alone_ms`` checked)
    beside the ``other`` stream's."""
    busy = _merged([(s.start_ms, s.end_ms) for s in other])
    zero = dict.fromkeys(kinds, 0.0)
    measured, alone, beside = dict(zero), dict(zero), dict(zero)
    for span in fitted:
        kind = (span.slot, span.direction)
        measured[kind] += span.end_ms - span.start_ms
        alone[kind] += cast(float, span.alone_ms)
        beside[kind] += sum(
            max(0.0, min(span.end_ms, hi) - max(span.start_ms, lo)) for lo, hi in busy
        )
    coefficients = dict(zero)
    unseen: list[ContentionKind] = []
    clamped: list[ContentionKind] = []
    for kind in kinds:
        if beside[kind] <= 0.0:
            unseen.append(kind)
            continue
        share = (measured[kind] - alone[kind]) / beside[kind]  # c / (1 + c)
        if share >= 1.0:
            raise ConfigError(
                f"{where}: {kind_text(kind)}: expected the nodes' time past alone "
                f"({measured[kind] - alone[kind]:.3f} ms) below their time beside "
                f"{other_name} ({beside[kind]:.3f} ms), received it not; something other than "
                f"the {other_name} beside them slowed them (check that alone_ms times the "
                "same nodes)"
            )
        if share <= 0.0:
            clamped.append(kind)
            continue
        coefficients[kind] = share / (1.0 - share)
    return ContentionFit(
        coefficients=coefficients,
        measured_ms=measured,
        alone_ms=alone,
        beside_ms=beside,
        unseen=tuple(unseen),
        clamped=tuple(clamped),
    )


def fit_contention_by_kind(spans: Sequence[MeasuredSpan]) -> ContentionFit:
    """Each communication kind's coefficient from one recorded overlapped step.

    ``spans``: every node of the step (compute ones tell when the compute stream was
    busy; communication ones need ``alone_ms``). Per kind, with ``m``, ``d`` and ``b`` its
    nodes' summed measured, alone and beside-compute milliseconds, the coefficient ``c``
    solves ``m = d + b c / (1 + c)``: the model (:func:`place_streams`) with the recorded
    compute spans gives each kind's measured total. A kind whose nodes lost more than all
    their time beside compute is refused (:class:`~moe_overlap.ConfigError`): contention
    does not explain it."""
    where = "fit_contention_by_kind"
    expected = "a compute span or a communication one of a dispatch or combine forward or backward"
    comms, comp = _split(where, spans, StreamKind.COMM, CONTENTION_KINDS, expected)
    return _fit(where, CONTENTION_KINDS, comms, comp, "compute")


def _split(
    where: str,
    spans: Sequence[MeasuredSpan],
    fitted: StreamKind,
    kinds: tuple[ContentionKind, ...],
    expected: str,
) -> tuple[list[MeasuredSpan], list[MeasuredSpan]]:
    """``spans`` checked and split: the ``fitted`` stream's (of ``kinds``, each with its
    ``alone_ms``), the other stream's."""
    own: list[MeasuredSpan] = []
    other: list[MeasuredSpan] = []
    for i, given in enumerate(_sequence(where, spans)):
        span = _checked_span(where, i, given)
        if span.stream is not fitted and span.stream in (StreamKind.COMP, StreamKind.COMM):
            other.append(span)
            continue
        if span.stream is not fitted or (span.slot, span.direction) not in kinds:
            raise ConfigError(
                f"{where}: spans[{i}]: expected {expected}, received {span.slot!r}, "
                f"{span.direction!r} on {span.stream!r}"
            )
        check_arg(where, f"spans[{i}].alone_ms", span.alone_ms, Real(min=0.0))
        own.append(span)
    return own, other


def fit_compute_contention_by_kind(spans: Sequence[MeasuredSpan]) -> ContentionFit:
    """Each compute kind's coefficient (:data:`COMPUTE_CONTENTION_KINDS`) from one recorded
    overlapped step: :func:`fit_contention_by_kind` the other way round.

    ``spans``: every node of the step (communication ones tell when the communication
    stream was busy; compute ones need ``alone_ms``, e.g. the one-stream profile's). Per
    kind, with ``m``, ``d`` and ``b`` its nodes' summed measured, alone and
    beside-communication milliseconds, the coefficient ``c`` solves ``m = d + b c / (1 +
    c)``. A kind whose nodes lost more than all their time beside communication is refused
    (:class:`~moe_overlap.ConfigError`)."""
    where = "fit_compute_contention_by_kind"
    kinds = ", ".join(kind_text(k) for k in COMPUTE_CONTENTION_KINDS)
    expected = f"a communication span or a compute one of {kinds}"
    comp, comms = _split(where, spans, StreamKind.COMP, COMPUTE_CONTENTION_KINDS, expected)
    return _fit(where, COMPUTE_CONTENTION_KINDS, comp, comms, "communication")
