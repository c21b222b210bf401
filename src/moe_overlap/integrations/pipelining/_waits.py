"""What each action of a schedule waits for, to check a pairing without torch's placement.

torch's send/recv placement (``_add_send_recv``) takes each rank's compute actions in
order, each once the actions it receives from (or runs after, on its own rank) have been
placed; it fails when every rank waits. That is a graph: an edge from each action to the
next one on its rank, and from each action to those that wait for it. The placement
succeeds exactly when the graph has no cycle. Pairing two neighbours ``u``, ``v`` of a rank
merges them into one node, which closes a cycle exactly when another path leads from ``u``
to ``v``. :class:`WaitGraph` keeps the nodes in a topological order, so that such a path
can only pass through the nodes placed between ``u`` and ``v`` (a path never goes back in
the order): a pairing is checked, and the order mended, in time linear in that stretch,
which a pipeline keeps short, rather than in the whole schedule.

Where something an action waits for is made by several actions (one listed twice), the
graph waits for all of them: it may refuse a pairing torch makes, never the reverse. It is
built from torch's rule as this module reads it, so ``pair_overlap_f_b`` does not rely on
it alone: torch confirms every pairing the graph refuses, and the whole result.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterable

from moe_overlap.integrations.pipelining import _torch
from moe_overlap.integrations.pipelining._torch import Action

__all__ = ["WaitGraph"]


class WaitGraph:
    """The wait graph of a compute-only schedule, one node per action (bubbles have none).

    ``ids[rank][i]`` is the node of ``order[rank][i]`` (-1 for a bubble); a merge
    keeps the first node of the two, so the caller edits ``ids`` as it edits its actions.
    """

    def __init__(
        self,
        order: dict[int, list[Action | None]],
        num_stages: int,
        stage_to_rank: Callable[[int], int],
    ) -> None:
        self.ids: dict[int, list[int]] = {}
        self._next: list[int] = []  # the next node on the same rank, -1 after the last
        self._waiters: list[list[int]] = []  # nodes waiting for this one
        self._waits: list[list[int]] = []  # nodes this one waits for (other than _next's)
        self._alias: list[int] = []  # the node a merged node became (itself if none)
        self._pos: list[int] = []
        self._topo: list[int] = []
        self._acyclic = False
        made: dict[Hashable, list[int]] = {}
        needs: list[list[tuple[Hashable, ...]]] = []
        rules = _Rules(num_stages, stage_to_rank)
        for rank in sorted(order):
            row: list[int] = []
            last = -1
            for action in order[rank]:
                if action is None:
                    row.append(-1)
                    continue
                node = len(self._next)
                row.append(node)
                self._next.append(-1)
                self._waiters.append([])
                self._alias.append(node)
                if last >= 0:
                    self._next[last] = node
                last = node
                wanted: list[tuple[Hashable, ...]] = []
                for part in action.sub_actions if action.sub_actions is not None else (action,):
                    for token in rules.made(rank, part):
                        made.setdefault(token, []).append(node)
                    wanted.extend(rules.needed(rank, part))
                needs.append(wanted)
            self.ids[rank] = row
        for node, wanted in enumerate(needs):
            if any(not any(t in made for t in either) for either in wanted):
                return  # waits for what nothing makes: the graph cannot vouch for this order
            producers = sorted({p for either in wanted for t in either for p in made.get(t, ())})
            self._waits.append(producers)
            for p in producers:
                self._waiters[p].append(node)
        self._acyclic = self._sort()

    @property
    def acyclic(self) -> bool:
        """The graph has no cycle, so torch's placement of the order succeeds."""
        return self._acyclic

    def try_merge(self, u: int, v: int) -> bool:
        """Merge ``v`` into ``u`` (the next node on ``u``'s rank, never merged before) unless
        that closes a cycle; ``True`` when merged."""
        waits = {self._find(p) for p in self._waits[v]}
        if u in waits:
            return False
        limit = self._pos[v]
        reached: set[int] = {u}
        stack = [u]
        while stack:
            x = stack.pop()
            for y in self._successors(x):
                if self._pos[y] < limit and y not in reached:
                    if y in waits:
                        return False
                    reached.add(y)
                    stack.append(y)
        self._alias[v] = u
        self._waiters[u].extend(self._waiters[v])
        self._next[u] = self._next[v]
        # Mend the order: what u reaches goes after the merged node, the rest before it;
        # v's slot stays (last), so nothing after it moves.
        start = self._pos[u]
        between = self._topo[start + 1 : limit]
        mended = [x for x in between if x not in reached]
        mended.append(u)
        mended.extend(x for x in between if x in reached)
        mended.append(v)
        self._topo[start : limit + 1] = mended
        for offset, x in enumerate(mended):
            self._pos[x] = start + offset
        return True

    def _find(self, node: int) -> int:
        while self._alias[node] != node:
            node = self._alias[node]
        return node

    def _successors(self, node: int) -> Iterable[int]:
        find = self._find
        if self._next[node] >= 0:
            yield find(self._next[node])
        for w in self._waiters[node]:
            yield find(w)

    def _sort(self) -> bool:
        """A topological order, breadth first (close to the order the ranks run in)."""
        n = len(self._next)
        indegree = [len(w) for w in self._waits]
        for x in range(n):
            if self._next[x] >= 0:
                indegree[self._next[x]] += 1
        ready = deque(x for x in range(n) if indegree[x] == 0)
        self._pos = [-1] * n
        while ready:
            x = ready.popleft()
            self._pos[x] = len(self._topo)
            self._topo.append(x)
            for y in self._successors(x):
                indegree[y] -= 1
                if indegree[y] == 0:
                    ready.append(y)
        return len(self._topo) == n


class _Rules:
    """torch's placement rule, as tokens: what placing an action (one part of a pair) on a
    rank makes, and what an action on a rank waits for (one of each group)."""

    def __init__(self, num_stages: int, stage_to_rank: Callable[[int], int]) -> None:
        kinds = _torch.kinds()
        self._forward = kinds.forward
        self._backward = (kinds.backward_input, kinds.full_backward)
        self._last = num_stages - 1
        self._stage_to_rank = stage_to_rank
        self._ranks: dict[int, int] = {}

    def _rank(self, stage: int) -> int:
        if stage not in self._ranks:
            self._ranks[stage] = self._stage_to_rank(stage)
        return self._ranks[stage]

    def made(self, rank: int, a: Action) -> list[Hashable]:
        """The action itself on its rank and, when it sends, the receive on the other."""
        s, kind, mb = a.stage_index, a.computation_type, a.microbatch_index
        out: list[Hashable] = []
        if a.sub_actions is None:
            out.append(("done", rank, s, kind, mb))
        if kind == self._forward:
            if s != self._last and self._rank(s + 1) != self._rank(s):
                out.append(("recv_f", self._rank(s + 1), s + 1, mb))
        elif kind in self._backward and s != 0 and self._rank(s - 1) != self._rank(s):
            out.append(("recv_b", self._rank(s - 1), s - 1, mb))
        return out

    def needed(self, rank: int, a: Action) -> list[tuple[Hashable, ...]]:
        """Groups of tokens ``a`` waits for on ``rank``, any one of a group enough."""
        s, kind, mb = a.stage_index, a.computation_type, a.microbatch_index
        if kind == self._forward and s != 0:
            return [(("recv_f", rank, s, mb), ("done", rank, s - 1, self._forward, mb))]
        if kind in self._backward and s != self._last:
            after = tuple(("done", rank, s + 1, k, mb) for k in self._backward)
            return [(("recv_b", rank, s, mb), *after)]
        return []
