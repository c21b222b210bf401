"""The list scheduler of the schedule search, its fast replay and its local search.

:func:`list_schedule` issues a :class:`~moe_overlap.plan.ScheduleGraph`'s steps one at a
time: among the steps whose predecessors (their microbatch's, and the exactness rules'
cross-microbatch order) are issued, those that could start earliest (within
``slack_ms``) compete and a priority rule (:data:`RULES`) picks one; a microbatch starts
only while fewer than ``in_flight`` are in flight, ``stagger`` steps after the one before
it, and while the activations alive stay under a cap. :func:`improve` moves single steps
of an order to shorten it. Both time an order as :func:`~moe_overlap.plan.replay_order`
does, on integers (with :attr:`~moe_overlap.plan.ScheduleGraph.one_event`, each
microbatch's steps but ``W`` also after its forward and backward steps issued before them).
With :attr:`~moe_overlap.plan.StepTimes.contention_by_kind` the scheduler estimates a
communication step's end from the compute it has placed so far (compute issued later may
slow it more: the replay, which every order found is timed by, counts it), and with
:attr:`~moe_overlap.plan.StepTimes.compute_contention_by_kind` a compute step's from the
communication placed so far.
"""

import bisect
import itertools
import random
from collections.abc import Sequence

from moe_overlap.engine import ConfigError
from moe_overlap.plan._contention import place_streams
from moe_overlap.plan._search_steps import (
    ActivationModel,
    ScheduleGraph,
    SearchStep,
    StepTimes,
    issued_flags,
    peak,
    settle,
)
from moe_overlap.steps import Direction, Slot, StreamKind

__all__ = ["RULES", "ScheduleIds", "improve", "list_schedule", "replay_ids", "schedule_ids"]

RULES = ("oldest", "backward", "forward", "critical", "newest")
"""The priority rules: the oldest microbatch first; backward (and recompute) steps first,
then the oldest; forward steps first; the longest remaining path of its microbatch first;
the newest microbatch first. Delayed weight gradients go last in every rule."""


class ScheduleIds:
    """A graph's steps as integers (``steps[i]``), their data and issue-order edges,
    milliseconds and activation events: what the scheduler's inner loop reads."""

    def __init__(self, graph: ScheduleGraph, times: StepTimes, memory: ActivationModel) -> None:
        self.graph, self.times = graph, times
        pairs = [p for mb in range(graph.microbatches) for p in graph.microbatch_steps(mb)]
        self.steps = [s for s, _ in pairs]
        index = {s: i for i, s in enumerate(self.steps)}
        n = len(self.steps)
        self.data = [[index[p] for p in preds] for _, preds in pairs]
        issue = [list(d) for d in self.data]
        # The exactness rules as issue-order edges from the previous microbatch's steps.
        last_f: dict[tuple[object, ...], int] = {}
        slot_steps: dict[tuple[int | None, Slot], dict[int, list[int]]] = {}
        for i, s in enumerate(self.steps):
            if s.direction is Direction.FORWARD:
                key = (s.layer, s.slot, s.chunk, s.recompute)
                if key in last_f:
                    issue[i].append(last_f[key])
                last_f[key] = i
            else:
                slot_steps.setdefault((s.layer, s.slot), {}).setdefault(s.microbatch, []).append(i)
        for per_mb in slot_steps.values():
            mbs = sorted(per_mb)
            for a, b in itertools.pairwise(mbs):
                first_b = next(
                    i for i in per_mb[b] if self.steps[i].direction is Direction.BACKWARD
                )
                issue[first_b] += per_mb[a]
        self.issue_succ: list[list[int]] = [[] for _ in range(n)]
        for i, preds in enumerate(issue):
            for p in set(preds):
                self.issue_succ[p].append(i)
        self.n_issue = [len(set(p)) for p in issue]
        self.mb = [s.microbatch for s in self.steps]
        self.comm = [s.stream is StreamKind.COMM for s in self.steps]
        self.wgrad = [s.direction is Direction.WGRAD for s in self.steps]
        # one_event: the steps that record their microbatch's event (forward and backward)
        self.records = [not (w or s.recompute) for w, s in zip(self.wgrad, self.steps, strict=True)]
        self.one_event = graph.one_event
        self.ms = [times.base_ms(s) for s in self.steps]
        self.by_kind = times.by_kind
        self.lost = [times.lost_share(s) for s in self.steps]
        events = [memory.events(s, graph) for s in self.steps]
        self.alloc = [a for a, _ in events]
        self.freed = [f for _, f in events]
        self.count = [0] * graph.microbatches
        for m in self.mb:
            self.count[m] += 1
        self.seq = [0] * n
        pos = [0] * graph.microbatches
        for i, m in enumerate(self.mb):
            self.seq[i] = pos[m]
            pos[m] += 1
        # the longest path (ms) from a step to its microbatch's end, through data edges
        self.tail = [0.0] * n
        succ: list[list[int]] = [[] for _ in range(n)]
        for i, preds in enumerate(self.data):
            for p in preds:
                succ[p].append(i)
        for i in reversed(range(n)):
            self.tail[i] = self.ms[i] + max((self.tail[j] for j in succ[i]), default=0.0)


def _priority(g: ScheduleIds, rule: str, rng: random.Random | None) -> list[tuple[float, ...]]:
    keys: list[tuple[float, ...]] = []
    for i, s in enumerate(g.steps):
        w = 1.0 if g.wgrad[i] else 0.0
        back = 0.0 if s.direction is Direction.BACKWARD or s.recompute else 1.0
        if rng is not None:
            keys.append((w, rng.random()))
        elif rule == "oldest":
            keys.append((w, g.mb[i], g.seq[i]))
        elif rule == "backward":
            keys.append((w, back, g.mb[i], g.seq[i]))
        elif rule == "forward":
            keys.append((w, 1.0 - back, g.mb[i], g.seq[i]))
        elif rule == "critical":
            keys.append((w, -g.tail[i], g.mb[i]))
        else:
            keys.append((w, -g.mb[i], g.seq[i]))
    return keys


def list_schedule(
    graph: ScheduleGraph,
    times: StepTimes,
    memory: ActivationModel,
    *,
    rule: str = "oldest",
    in_flight: int = 2,
    slack_ms: float = 0.0,
    cap_units: float | None = None,
    seed: int | None = None,
    stagger: int = 0,
) -> tuple[list[SearchStep], float, float]:
    """One issue order of ``graph`` by the list scheduler, its step time and peak units
    (:func:`replay_order`'s). ``seed``: random priorities instead of ``rule``;
    ``stagger``: a microbatch starts after the one before it issued that many steps."""
    g = ScheduleIds(graph, times, memory)
    ids, _, _ = schedule_ids(g, times, rule, in_flight, slack_ms, cap_units, seed, stagger)
    ms, units = replay_ids(g, ids, 1.0 + times.comm_contention)
    return [g.steps[i] for i in ids], ms, units


def schedule_ids(
    g: ScheduleIds,
    times: StepTimes,
    rule: str,
    in_flight: int,
    slack_ms: float,
    cap_units: float | None,
    seed: int | None,
    stagger: int = 0,
) -> tuple[list[int], float, float]:
    prio = _priority(g, rule, random.Random(seed) if seed is not None else None)
    waiting = list(g.n_issue)
    ready = [i for i, c in enumerate(waiting) if c == 0]
    end = [0.0] * len(g.steps)
    free = [0.0, 0.0]
    event = [0.0] * len(g.count)  # per microbatch: when its last F/B step ends (one_event)
    placed: tuple[list[tuple[float, float]], list[tuple[float, float]]] = ([], [])
    # by kind: the compute and the communication placed so far
    left = list(g.count)
    issued = [0] * len(g.count)
    started: set[int] = set()
    flying: set[int] = set()
    first_start: dict[int, float] = {}
    last_end: dict[int, float] = {}
    live = 0.0
    factor = 1.0 + times.comm_contention
    order: list[int] = []
    events: list[tuple[float, int, float]] = []
    while ready:
        oldest = min(flying) if flying else None
        cands: list[tuple[float, int]] = []
        for i in ready:
            m = g.mb[i]
            if m not in started and (
                len(flying) >= in_flight or (m and issued[m - 1] < min(stagger, g.count[m - 1]))
            ):
                continue
            if (
                cap_units is not None
                and g.alloc[i]
                and m != oldest
                and live + g.alloc[i] > cap_units
            ):
                continue
            est = free[g.comm[i]]
            if not g.wgrad[i]:
                for p in g.data[i]:
                    est = max(est, end[p])
                if g.one_event:
                    est = max(est, event[m])
            cands.append((est, i))
        if not cands:  # the cap blocks everything: let the oldest waiting step go
            i = min(ready, key=lambda j: (g.mb[j], g.seq[j]))
            est = max([free[g.comm[i]], *(end[p] for p in g.data[i])])
            if g.one_event and not g.wgrad[i]:
                est = max(est, event[g.mb[i]])
            cands = [(est, i)]
        first = min(e for e, _ in cands)
        _, est, i = min((prio[i], e, i) for e, i in cands if e <= first + slack_ms)
        m = g.mb[i]
        started.add(m)
        flying.add(m)
        first_start.setdefault(m, est)
        ms = g.ms[i]
        if g.by_kind:
            if g.comm[i] or g.lost[i]:  # (a compute step no contention slows: its ms)
                ms = _beside_end(est, ms, g.lost[i], placed[not g.comm[i]]) - est
            placed[g.comm[i]].append((est, est + ms))
        elif g.comm[i] and any(
            o != m and first_start[o] <= est and (o in flying or last_end[o] > est)
            for o in first_start
        ):
            ms *= factor
        end[i] = est + ms
        if g.records[i]:
            event[m] = end[i]
        last_end[m] = max(last_end.get(m, 0.0), end[i])
        free[g.comm[i]] = end[i]
        live += g.alloc[i] - g.freed[i]
        if g.alloc[i]:
            events.append((est, 1, g.alloc[i]))
        if g.freed[i]:
            events.append((end[i], 0, -g.freed[i]))
        left[m] -= 1
        issued[m] += 1
        if not left[m]:
            flying.discard(m)
        order.append(i)
        ready.remove(i)
        for j in g.issue_succ[i]:
            waiting[j] -= 1
            if not waiting[j]:
                ready.append(j)
    if len(order) != len(g.steps):
        raise ConfigError("list_schedule: the graph's order constraints form a cycle")
    return order, max(end, default=0.0), peak(events)


def _beside_end(start: float, ms: float, lost: float, comp: list[tuple[float, float]]) -> float:
    """When a step of ``ms`` from ``start`` ends beside the other stream's spans ``comp``
    (in order, disjoint), losing ``lost`` of its time beside them."""
    t, left = start, ms  # ms still to run at rate 1
    first = max(0, bisect.bisect_left(comp, (start, start)) - 1)  # may reach past start
    for j in range(first, len(comp)):
        lo, hi = comp[j]
        if hi <= t:
            continue
        if lo >= t + left:
            break
        left -= max(0.0, lo - t)  # alone until the compute starts
        t = max(t, lo)
        beside = min(hi - t, left / (1.0 - lost))
        t += beside
        left -= beside * (1.0 - lost)
    return t + max(0.0, left)


def replay_ids(g: ScheduleIds, ids: Sequence[int], factor: float) -> tuple[float, float]:
    """:func:`replay_order` on ``g``'s integers (no joins): step time and peak units
    (``factor``: ``1 + comm_contention``; unused with contention per kind)."""
    mbs = [g.mb[i] for i in ids]
    comm = [g.comm[i] for i in ids]

    def place(flags: list[bool]) -> list[tuple[float, float]]:
        end = [0.0] * len(g.steps)
        free = [0.0, 0.0]
        event = [0.0] * len(g.count)
        out: list[tuple[float, float]] = []
        for k, i in enumerate(ids):
            start = free[g.comm[i]]
            if not g.wgrad[i]:
                for q in g.data[i]:
                    start = max(start, end[q])
                if g.one_event:
                    start = max(start, event[g.mb[i]])
            end[i] = free[g.comm[i]] = start + (g.ms[i] * factor if flags[k] else g.ms[i])
            if g.records[i]:
                event[g.mb[i]] = end[i]
            out.append((start, end[i]))
        return out

    if g.by_kind:
        spans = place_streams(comm, [g.ms[i] for i in ids], [g.lost[i] for i in ids], _deps(g, ids))
    else:
        issued = [c and f for c, f in zip(comm, issued_flags(mbs), strict=True)]
        _, spans = settle(place, mbs, comm, issued)
    events: list[tuple[float, int, float]] = []
    for i, (lo, hi) in zip(ids, spans, strict=True):
        if g.alloc[i]:
            events.append((lo, 1, g.alloc[i]))
        if g.freed[i]:
            events.append((hi, 0, -g.freed[i]))
    return max((hi for _, hi in spans), default=0.0), peak(events)


def _deps(g: ScheduleIds, ids: Sequence[int]) -> list[list[int]]:
    """Per position of ``ids``, the positions it waits for besides its stream's previous
    step (:func:`~moe_overlap.plan._search_steps.order_deps` on integers)."""
    pos = [0] * len(g.steps)
    event: dict[int, int] = {}
    out: list[list[int]] = []
    for k, i in enumerate(ids):
        deps: list[int] = []
        if not g.wgrad[i]:
            deps = [pos[q] for q in g.data[i]]
            if g.one_event and g.mb[i] in event:
                deps.append(event[g.mb[i]])
        if g.records[i]:
            event[g.mb[i]] = k
        pos[i] = k
        out.append(deps)
    return out


def improve(
    g: ScheduleIds,
    ids: list[int],
    factor: float,
    *,
    max_units: float,
    window: int = 4,
    passes: int = 1,
) -> tuple[list[int], float, float]:
    """Local search: move one step past up to ``window`` steps of its stream, earlier or
    later (where the exactness rules allow); keep a move that shortens the step without
    passing ``max_units`` of activations; repeat for ``passes`` passes or until none
    helps. (Moving a step past the other stream's steps only changes no stream's order.)"""
    issue_preds: list[list[int]] = [[] for _ in g.steps]
    for p, succs in enumerate(g.issue_succ):
        for q in succs:
            issue_preds[q].append(p)
    best_ms, best_units = replay_ids(g, ids, factor)
    for _ in range(passes):
        better = False
        for step in list(ids):
            i = ids.index(step)
            pos = {x: k for k, x in enumerate(ids)}
            lo = max([-1, *(pos[q] for q in issue_preds[step])])
            hi = min([len(ids), *(pos[q] for q in g.issue_succ[step])])
            same = [k for k, x in enumerate(ids) if g.comm[x] == g.comm[step] and lo < k < hi]
            at = same.index(i)
            # before an earlier same-stream step, or after a later one
            targets = [k for k in same[max(0, at - window) : at]]
            targets += [k + 1 for k in same[at + 1 : at + 1 + window]]
            for j in targets:
                trial = (
                    [x for x in ids[:j] if x != step] + [step] + [x for x in ids[j:] if x != step]
                )
                ms, units = replay_ids(g, trial, factor)
                if ms < best_ms - 1e-9 and units <= max_units + 1e-9:
                    ids, best_ms, best_units, better = trial, ms, units, True
                    break
        if not better:
            break
    return ids, best_ms, best_units
