"""Schedules as data: the ``OVERLAP_F_B`` lowering and the checks of a rank's actions.

Pure functions over torch's action lists (``schedule.pipeline_order``): no process group,
no stage, no plan; tested on schedule data as torch tests its own lowering.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn

from moe_overlap import ConfigError
from moe_overlap.args import CALLABLE, POSITIVE, Instance, check_arg
from moe_overlap.integrations.pipelining import _torch
from moe_overlap.integrations.pipelining._torch import Action, check_torch
from moe_overlap.integrations.pipelining._waits import WaitGraph

__all__ = [
    "SCHEDULE_CLASSES",
    "Order",
    "check_actions",
    "describe",
    "pair_overlap_f_b",
    "schedule_order",
    "stage_rank",
]

Order = Mapping[int, Sequence["Action | None"]]
"""A compute-only schedule: per rank, its actions and ``None`` bubbles."""
_ORDER = Instance[Mapping[object, object]](Mapping, "a mapping of each rank to its actions")


def pair_overlap_f_b(
    order: Order, *, num_stages: int, stage_to_rank: Callable[[int], int]
) -> dict[int, list[Action | None]]:
    """Pair each rank's neighbouring forward and full backward into ``OVERLAP_F_B`` actions.

    ``order`` is a compute-only schedule (``schedule.pipeline_order``: per rank, ``F``,
    ``B`` (full backward) and ``None`` bubbles). Two neighbours on one rank are paired when
    one is a forward and the other a full backward of another microbatch (a backward needs
    the loss, hence every forward, of its own microbatch) and the schedule with the pair
    still lowers to communication without a deadlock: torch's own send/recv placement
    must succeed for every rank, the pair waiting for both of its inputs. Each rank's
    compute actions keep their order; ranks are paired in rank order.

    A backward is paired with the forward after it first, over every rank; only then a
    forward with the backward after it. In the steady state of a pipeline the first kind
    lets every rank's pair wait for its neighbours' previous pairs only; pairing a forward
    with the next backward first makes a pair wait for the next rank's pair of the same
    step, so the ranks take turns (``moe_overlap.plan`` predicted 0.65-0.95x of the unpaired
    step that way, ``docs/planning.md``). The pair is ``(forward, backward)``, as
    ``ScheduleDualPipeV`` orders its own.

    Each trial pairing is checked on a graph of what each action waits for, in time linear
    in the stretch of schedule between the two actions; torch's placement confirms each
    refusal and the result. The pairs are those of trying each with torch's placement, in
    time about linear in the number of microbatches rather than quadratic.
    """
    check_torch()
    w = "pair_overlap_f_b"
    check_arg(w, "order", order, _ORDER)
    check_arg(w, "num_stages", num_stages, POSITIVE)
    check_arg(w, "stage_to_rank", stage_to_rank, CALLABLE)
    _check_order(w, order, num_stages, stage_to_rank)
    start = {r: list(order[r]) for r in sorted(order)}
    graph = WaitGraph(start, num_stages, stage_to_rank)
    out, unconfirmed = _pair(start, num_stages, stage_to_rank, graph if graph.acyclic else None)
    if unconfirmed and not _lowers(out, num_stages, stage_to_rank):
        # The graph made a pair torch would not have: pair again, every trial torch's.
        out, _ = _pair({r: list(order[r]) for r in sorted(order)}, num_stages, stage_to_rank, None)
    return out


def _pair(
    out: dict[int, list[Action | None]],
    num_stages: int,
    stage_to_rank: Callable[[int], int],
    graph: WaitGraph | None,
) -> tuple[dict[int, list[Action | None]], bool]:
    """Pair ``out``'s neighbours in place; whether a pair was made on ``graph``'s word alone.

    A pairing is made when ``graph`` finds no cycle, else when torch's placement of the
    trial succeeds (then the graph misjudged and is dropped). A pairing torch refuses leaves
    every later schedule refused too (a pair only adds waits), so when the result lowers,
    each pairing the graph made is one torch would have made: the same pairs as trying each
    with torch.
    """
    kinds = _torch.kinds()
    forward, full_backward = kinds.forward, kinds.full_backward

    def pairable(a: Action | None, b: Action | None, first: object) -> Action | None:
        if a is None or b is None or a.sub_actions is not None or b.sub_actions is not None:
            return None
        if a.computation_type != first or a.microbatch_index == b.microbatch_index:
            return None
        if {a.computation_type, b.computation_type} != {forward, full_backward}:
            return None
        f, bwd = (a, b) if a.computation_type == forward else (b, a)
        return _torch.overlap_action(f, bwd)

    unconfirmed = False
    for first in (full_backward, forward):
        for rank in out:
            acts = out[rank]
            i = 0
            while i + 1 < len(acts):
                pair = pairable(acts[i], acts[i + 1], first)
                if pair is not None:
                    if graph is not None and graph.try_merge(*graph.ids[rank][i : i + 2]):
                        acts[i : i + 2] = [pair]
                        del graph.ids[rank][i + 1]
                        unconfirmed = True
                    elif _lowers(
                        {**out, rank: [*acts[:i], pair, *acts[i + 2 :]]}, num_stages, stage_to_rank
                    ):
                        acts[i : i + 2] = [pair]
                        graph = None
                i += 1
    return out, unconfirmed


def _check_order(
    w: str, order: Order, num_stages: int, stage_to_rank: Callable[[int], int]
) -> None:
    """Refuse an ``order`` that is not ranks to torch's actions (or ``None``) of stages
    ``0..num_stages-1`` placed where ``stage_to_rank`` puts them, or that does not lower to
    communication as given: every pairing would fail its lowering, and the order would be
    returned unpaired without a word."""
    for rank, acts in order.items():
        if type(rank) is not int or isinstance(acts, (str, bytes)):
            raise ConfigError(
                f"{w}: order: expected a mapping of each pipeline rank (an int) to its "
                f"actions, received {rank!r}: {type(acts).__name__}; pass "
                "schedule.pipeline_order or schedule_order(...)"
            )
        for action in acts:
            if action is None:
                continue
            if not _torch.is_action(action):
                raise ConfigError(
                    f"{w}: order[{rank}]: expected torch actions or None (bubbles), received "
                    f"{type(action).__name__} {action!r}; pass schedule.pipeline_order or "
                    "schedule_order(...)"
                )
            for part in action.sub_actions or (action,):
                stage = part.stage_index
                where = stage_to_rank(stage) if 0 <= stage < num_stages else None
                if where != rank:
                    raise ConfigError(
                        f"{w}: expected each action on the rank stage_to_rank gives its stage "
                        f"(stages 0..{num_stages - 1}), received {part} on rank {rank}, "
                        + (
                            f"outside num_stages={num_stages}"
                            if where is None
                            else f"whose stage stage_to_rank puts on {where!r}"
                        )
                        + "; pass the schedule's own num_stages and stage_to_rank (stage_rank)"
                    )
    missing = sorted({stage_to_rank(s) for s in range(num_stages)} - set(order), key=repr)
    if order and missing:
        raise ConfigError(
            f"{w}: order: expected the actions of every rank stage_to_rank places a stage on, "
            f"received none for rank(s) {missing}; pass the whole pipeline_order (every "
            "rank's, as torch keeps it on each rank)"
        )
    if not _lowers(order, num_stages, stage_to_rank):
        raise ConfigError(
            f"{w}: expected an order torch lowers to communication without a deadlock, "
            "received one where a rank would wait forever before any pairing; pass a "
            "schedule's own pipeline_order (or schedule_order(...))"
        )


def _lowers(order: Order, num_stages: int, stage_to_rank: Callable[[int], int]) -> bool:
    """torch's send/recv placement succeeds (no rank waits forever). A rank of bubbles only
    that another rank sends to is left out of torch's placement, which then fails on its
    missing rank (a ``KeyError``): that rank would never receive, so the order does not
    lower either."""
    compute = {r: [a for a in acts if a is not None] for r, acts in order.items()}
    compute = {r: acts for r, acts in compute.items() if acts}
    try:
        _torch.add_send_recv(compute, stage_to_rank, num_stages)
    except (AssertionError, KeyError):
        return False
    return True


def check_actions(actions: Sequence[Action]) -> int:
    """Every compute action of a rank (``actions``, with communication) is one the plans
    run; returns the number of ``OVERLAP_F_B`` pairs."""
    kinds = _torch.kinds()
    pairs = 0
    for action in actions:
        if action.computation_type != kinds.overlap_f_b:
            continue
        parts = action.sub_actions or ()
        found = tuple(a.computation_type for a in parts)
        if found != (kinds.forward, kinds.full_backward):
            raise ConfigError(
                f"prepare_schedule: expected each OVERLAP_F_B as (FORWARD, FULL_BACKWARD), "
                f"received {action} with parts {[str(k) for k in found]}"
            )
        pairs += 1
    return pairs


def describe(action: Action) -> str:
    """``stage 1 microbatch 2 (forward) with stage 0 microbatch 1 (full backward)``."""
    names = {"F": "forward", "B": "full backward", "I": "input backward", "W": "weight backward"}
    parts = action.sub_actions or (action,)
    named = [
        f"stage {a.stage_index} microbatch {a.microbatch_index} "
        f"({names.get(str(a.computation_type.value), str(a.computation_type))})"
        for a in parts
    ]
    return " with ".join(named) + f" [action {action}]"


SCHEDULE_CLASSES = (
    "ScheduleGPipe",
    "Schedule1F1B",
    "ScheduleInterleaved1F1B",
    "ScheduleLoopedBFS",
    "ScheduleInterleavedZeroBubble",
    "ScheduleZBVZeroBubble",
    "ScheduleDualPipeV",
)
"""The ``torch.distributed.pipelining`` schedules :func:`schedule_order` lowers."""

_V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
_SINGLE = ("ScheduleGPipe", "Schedule1F1B")


class _StageData:
    """What a schedule's constructor reads of a stage, and nothing else (no module run)."""

    def __init__(self, index: int, num_stages: int, pp: int) -> None:
        self.stage_index = index
        self.num_stages = num_stages
        self.group_size = pp
        self.group_rank = 0
        self.is_first = index == 0
        self.is_last = index == num_stages - 1
        self.submod = nn.Identity()


def stage_rank(schedule_class: str, pp: int) -> Callable[[int], int]:
    """The pipeline rank of each stage: a V (``s`` and ``2 * pp - 1 - s`` on rank ``s``)
    for ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV``, else a loop (``s % pp``). The
    function refuses a stage that is not an int >= 0 (and, for a V, one beyond its
    ``2 * pp`` stages) with a :class:`~moe_overlap.ConfigError`."""
    w = "stage_rank"
    _check_class(w, schedule_class)
    pp = check_arg(w, "pp", pp, POSITIVE)
    if schedule_class in _V_SHAPED:
        n = 2 * pp

        def v_rank(s: int) -> int:
            if type(s) is not int or not 0 <= s < n:
                raise _bad_stage(schedule_class, s, f"an int in [0, {n - 1}] ({pp} ranks x 2)")
            return s if s < pp else n - 1 - s

        return v_rank

    def loop_rank(s: int) -> int:
        if type(s) is not int or s < 0:
            raise _bad_stage(schedule_class, s, "an int >= 0")
        return s % pp

    return loop_rank


def _bad_stage(schedule_class: str, stage: object, expects: str) -> ConfigError:
    return ConfigError(
        f"stage_rank({schedule_class!r}): a stage index must be {expects}, received "
        f"{type(stage).__name__} {stage!r}; pass a stage of the schedule"
    )


def _check_class(w: str, schedule_class: object) -> None:
    if not isinstance(schedule_class, str) or schedule_class not in SCHEDULE_CLASSES:
        raise ConfigError(
            f"{w}: schedule_class must be one of {list(SCHEDULE_CLASSES)}, "
            f"received {schedule_class!r}"
        )


def schedule_order(
    schedule_class: str, *, pp: int, stages_per_rank: int, n_microbatches: int
) -> dict[int, list[Action | None]]:
    """torch's own per-rank compute actions of ``schedule_class`` (``pipeline_order``),
    built by its constructor from stage data alone: no process group, no model.

    ``pp`` pipeline ranks with ``stages_per_rank`` stages each (1 for ``ScheduleGPipe`` and
    ``Schedule1F1B``, 2 for the V-shaped ``ScheduleZBVZeroBubble`` and
    ``ScheduleDualPipeV``). ``None`` entries are torch's bubbles; ``REDUCE_GRAD`` actions are
    dropped. Errors of torch's own checks (a microbatch count the schedule does not take)
    are raised as :class:`~moe_overlap.ConfigError` naming the schedule.
    """
    check_torch()
    w = "schedule_order"
    _check_class(w, schedule_class)
    pp = check_arg(w, "pp", pp, POSITIVE)
    per = check_arg(w, "stages_per_rank", stages_per_rank, POSITIVE)
    n_mb = check_arg(w, "n_microbatches", n_microbatches, POSITIVE)
    need = 1 if schedule_class in _SINGLE else 2 if schedule_class in _V_SHAPED else None
    if need is not None and per != need:
        raise ConfigError(
            f"{w}: {schedule_class} has {need} stage(s) per rank, received "
            f"stages_per_rank={per}; pass {need}"
        )
    n = pp * per
    rank_of = stage_rank(schedule_class, pp)
    mine: list[Any] = [_StageData(s, n, pp) for s in range(n) if rank_of(s) == 0]
    cls = _torch.schedule_class(schedule_class)
    try:
        made = cls(mine[0] if need == 1 else mine, n_microbatches=n_mb, loss_fn=_no_loss)
    except (AssertionError, ValueError, RuntimeError) as e:
        raise ConfigError(
            f"{w}: torch's {schedule_class} refused pp={pp}, stages_per_rank={per}, "
            f"n_microbatches={n_mb}: {e}"
        ) from None
    order = _torch.pipeline_order(made)
    out = {r: [a for a in order[r] if a is None or not _torch.is_reduce_grad(a)] for r in order}
    _check_complete(out, schedule_class, n, n_mb, rank_of)
    return out


def _check_complete(
    order: Order, name: str, num_stages: int, n_mb: int, rank_of: Callable[[int], int]
) -> None:
    """Each (stage, microbatch) has one forward and one backward (full, or input and
    weight), on its stage's rank: torch's single-stage schedules keep a ``pipeline_order``
    for show only, and torch 2.13's ``Schedule1F1B`` shifts the last rank's microbatches."""
    kinds = _torch.kinds()
    seen: dict[tuple[int, int], list[str]] = {}
    for rank, acts in order.items():
        for action in (x for x in acts if x is not None):
            for a in action.sub_actions or (action,):
                key = (a.stage_index, a.microbatch_index or 0)
                if rank_of(a.stage_index) != rank or not 0 <= key[1] < n_mb:
                    raise ConfigError(
                        f"schedule_order: torch's {name} lists {a} on rank {rank}, outside "
                        f"its {num_stages} stages x {n_mb} microbatches; use "
                        "ScheduleInterleaved1F1B with one stage per rank for 1F1B"
                    )
                seen.setdefault(key, []).append(str(a.computation_type))
    full = [str(kinds.forward), str(kinds.full_backward)]
    split = [str(kinds.forward), str(kinds.backward_input), str(kinds.backward_weight)]
    for stage in range(num_stages):
        for mb in range(n_mb):
            got = sorted(seen.get((stage, mb), []))
            if got not in (sorted(full), sorted(split)):
                raise ConfigError(
                    f"schedule_order: torch's {name} gives stage {stage} microbatch {mb} the "
                    f"actions {got}, expected one forward and one backward"
                )


def _no_loss(output: object, target: object) -> object:
    return output
