"""The order of a paired run's steps, as data that can be chosen.

Inside one overlapped run of a layer, two microbatches walk their own slots in their own
order; only how the two walks interleave is free. Megatron-Core fixes one interleaving;
here it is a :class:`PairOrder` — a template of :class:`~moe_overlap.steps.Step` s of a role,
slot and direction (``b.mlp.W``), one per slot step of a layer, that
:func:`~moe_overlap.steps.layer_pair_steps`,
:func:`~moe_overlap.steps.forward_pair_steps` and
:func:`~moe_overlap.steps.backward_pair_steps` filter by what each layer has (a dense layer
has no dispatch or combine, a layer without delayed wgrad no ``W`` steps, a slot the
schedule does not recompute no ``R`` step). A
:class:`ScheduleOrder` holds one for each kind of run (:class:`PairKind`) and goes into
:class:`~moe_overlap.ScheduleOptions`; every field defaults to Megatron-Core's order.

Every order a :class:`PairOrder` accepts gives the same losses and gradients, bit for bit
(the rules are checked when one is built, :class:`~moe_overlap.ConfigError` otherwise):

- each microbatch runs its own steps in its own order (the order of plain ``backward()``),
  a delayed weight-gradient step (``W``) anywhere after the backward of its slot;
- a backward microbatch may also list the recompute steps (``R``) of its pre-dispatch and
  mlp slots (``b.mlp.R``; ``c.`` too in a run of two backwards), each anywhere before the
  backward of its slot: a recompute reads only the slot's kept inputs, the parameters and
  the random state its forward saw;
- in a run of two forwards, the first microbatch's step of a slot comes before the
  second's (forward side effects, a router's counts, add up in microbatch order);
- in a run of two backwards, the first microbatch's backward and weight-gradient step of
  a slot come before the second's backward of that slot: every parameter accumulates the
  two microbatches' gradients in their order, and no layer owes two microbatches' weight
  gradients at once.

The orders only change when each step is issued, i.e. which waits on which; a
:class:`PairOrder` prints as its steps, space-separated (``b.combine.B f.pre_dispatch.F
...``), each read back by :meth:`Step.parse <moe_overlap.steps.Step.parse>`;
:meth:`PairOrder.parse` / :meth:`ScheduleOrder.parse` read the whole back.
"""

import enum
import functools
import itertools
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast

from moe_overlap.args import refuse
from moe_overlap.errors import ConfigError

from ._arguments import on_arguments
from ._kinds import Direction, Role, Slot
from ._step import Step

__all__ = ["PairKind", "PairOrder", "ScheduleOrder"]


class PairKind(str, enum.Enum):
    """Which two microbatches a paired run holds."""

    MIXED = "f+b"
    """One forward and one backward (combined 1F1B's steady state)."""
    FORWARDS = "f+g"
    """Two forwards (the fill)."""
    BACKWARDS = "b+c"
    """Two backwards (the drain)."""


_LAYER_SLOTS = (Slot.PRE_DISPATCH, Slot.DISPATCH, Slot.MLP, Slot.COMBINE, Slot.MTP_POST)
F, B, W, R = Direction.FORWARD, Direction.BACKWARD, Direction.WGRAD, Direction.RECOMPUTE


def _forward_chain(role: Role) -> tuple[Step, ...]:
    return tuple(
        Step(F, role=role, slot=s)
        for s in (Slot.PRE_DISPATCH, Slot.DISPATCH, Slot.MLP, Slot.COMBINE, Slot.MTP_POST)
    )


def _backward_chain(role: Role, *, mtp: bool) -> tuple[Step, ...]:
    slots = (Slot.COMBINE, Slot.MLP, Slot.DISPATCH, Slot.PRE_DISPATCH)
    return tuple(Step(B, role=role, slot=s) for s in ((Slot.MTP_POST,) if mtp else ()) + slots)


def _wgrads(role: Role) -> tuple[Step, ...]:
    return (Step(W, role=role, slot=Slot.MLP), Step(W, role=role, slot=Slot.PRE_DISPATCH))


@functools.cache
def _recomputes(kind: PairKind) -> tuple[Step, ...]:
    """The recompute steps a kind's order may list (each backward's pre-dispatch and mlp)."""
    roles = {PairKind.MIXED: (Role.B,), PairKind.FORWARDS: (), PairKind.BACKWARDS: _BACKWARDS}
    return tuple(
        Step(R, role=role, slot=slot) for role in roles[kind] for slot in _RECOMPUTED_SLOTS
    )


_BACKWARDS = (Role.B, Role.B2)
_RECOMPUTED_SLOTS = (Slot.PRE_DISPATCH, Slot.MLP)


@functools.cache
def _chains(kind: PairKind) -> tuple[tuple[Step, ...], ...]:
    """The ordered chains of a kind's template (each microbatch's steps, no ``W``)."""
    if kind is PairKind.MIXED:
        return (_forward_chain(Role.F), _backward_chain(Role.B, mtp=True))
    if kind is PairKind.FORWARDS:
        return (_forward_chain(Role.F), _forward_chain(Role.F2))
    # Two backwards: an MTP layer runs its two microbatches one after the other, outside
    # the template (backward_pair_steps), so the template has no mtp_post step.
    return (_backward_chain(Role.B, mtp=False), _backward_chain(Role.B2, mtp=False))


@functools.cache
def _wgrad_steps(kind: PairKind) -> tuple[Step, ...]:
    if kind is PairKind.MIXED:
        return _wgrads(Role.B)
    if kind is PairKind.FORWARDS:
        return ()
    return (*_wgrads(Role.B), *_wgrads(Role.B2))


def before(kind: PairKind, steps: Iterable[Step]) -> list[tuple[Step, Step]]:
    """Every ``(a, b)`` with ``a`` required before ``b``, among ``steps``."""
    have = set(steps)
    rules: list[tuple[Step, Step]] = []
    for chain in _chains(kind):
        present = [s for s in chain if s in have]
        rules += list(itertools.pairwise(present))
    rules += _fixed_rules(kind)
    return [(a, b) for a, b in rules if a in have and b in have]


@functools.cache
def _fixed_rules(kind: PairKind) -> tuple[tuple[Step, Step], ...]:
    """The rules of :func:`before` that do not depend on which steps are present (before
    keeping those among them), in its order: each search step checks one order."""
    rules: list[tuple[Step, Step]] = []
    for w in _wgrad_steps(kind):
        rules.append((w._replace(direction=B), w))
    for r in _recomputes(kind):
        rules.append((r, r._replace(direction=B)))
    if kind is PairKind.FORWARDS:
        rules += [(a, c) for a, c in zip(*_chains(kind), strict=True)]
    elif kind is PairKind.BACKWARDS:
        for s in _chains(kind)[0]:
            later = s._replace(role=Role.B2)
            rules.append((s, later))
            w = s._replace(direction=W)
            if w in _wgrad_steps(kind):
                rules.append((w, later))
    return tuple(rules)


@functools.cache
def template(kind: PairKind) -> frozenset[Step]:
    """Every step a kind's order lists (the recompute steps it may list besides:
    :func:`optional`)."""
    return frozenset(itertools.chain(*_chains(kind), _wgrad_steps(kind)))


@functools.cache
def optional(kind: PairKind) -> frozenset[Step]:
    """The steps a kind's order may list or leave out: recomputes (``b.mlp.R``). Left out, a
    recomputed slot runs its recompute at the start of its backward."""
    return frozenset(_recomputes(kind))


_MEGATRON: dict[PairKind, str] = {
    # combined 1F1B's layer pair (Megatron-Core's TransformerLayerSchedulePlan.run).
    PairKind.MIXED: "b.mtp_post.B b.combine.B f.pre_dispatch.F b.mlp.B f.dispatch.F b.mlp.W "
    "b.dispatch.B f.mlp.F f.combine.F b.pre_dispatch.B f.mtp_post.F b.pre_dispatch.W",
    PairKind.FORWARDS: "f.pre_dispatch.F f.dispatch.F g.pre_dispatch.F f.mlp.F g.dispatch.F "
    "f.combine.F g.mlp.F g.combine.F f.mtp_post.F g.mtp_post.F",
    PairKind.BACKWARDS: "b.combine.B b.mlp.B c.combine.B b.mlp.W b.dispatch.B c.mlp.B c.mlp.W "
    "b.pre_dispatch.B c.dispatch.B b.pre_dispatch.W c.pre_dispatch.B c.pre_dispatch.W",
}
_EARLY_RELEASE = (
    "b.mtp_post.B b.combine.B f.pre_dispatch.F b.mlp.B f.dispatch.F b.mlp.W "
    "b.dispatch.B b.pre_dispatch.B f.mlp.F f.combine.F f.mtp_post.F b.pre_dispatch.W"
)


@dataclass(frozen=True, slots=True)
class PairOrder:
    """The order of one kind of paired run's steps in a layer (a checked template).

    ``PairOrder(kind, steps)``: ``steps`` lists every step of the kind's template once
    (:class:`~moe_overlap.steps.Step` s of a role, slot and direction, or their string
    forms ``role.slot.D``, or one space-separated string), and any of the backward
    microbatches' recompute steps (``b.pre_dispatch.R``, ``b.mlp.R``; ``c.`` too for two
    backwards) once, in an order the module's rules allow;
    :class:`~moe_overlap.ConfigError` names the broken rule.
    """

    kind: PairKind
    steps: tuple[Step, ...]

    def __init__(self, kind: PairKind, steps: str | Iterable[Step | str]) -> None:
        if not isinstance(cast(object, kind), PairKind):
            raise refuse("PairOrder: kind", "a PairKind (PairKind.MIXED, ...)", kind)
        items = steps.split() if isinstance(steps, str) else list(steps)
        parsed = tuple(s if isinstance(s, Step) else _template_step(kind, s) for s in items)
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "steps", parsed)
        _check(kind, parsed)

    def __str__(self) -> str:
        return " ".join(str(s) for s in self.steps)

    @classmethod
    def parse(cls, kind: PairKind, text: str) -> "PairOrder":
        """Read an order back from its string form (:meth:`__str__`)."""
        if not isinstance(cast(object, text), str):
            raise refuse("PairOrder.parse: text", "the steps, space-separated", text)
        return cls(kind, text)

    @classmethod
    def megatron(cls, kind: PairKind, *, early_attn_release: bool = False) -> "PairOrder":
        """Megatron-Core's order (with early attention-memory release, for a mixed run:
        ``b.pre_dispatch.B`` before ``f.mlp.F``)."""
        if early_attn_release and kind is PairKind.MIXED:
            return _MEGATRON_EARLY
        return _MEGATRONS[kind]

    @property
    def is_megatron(self) -> bool:
        return self == _MEGATRONS[self.kind]

    def releases_attention_early(self) -> bool:
        """Whether the backward's pre-dispatch runs before the forward's mlp (a mixed run)."""
        if self.kind is not PairKind.MIXED:
            return False
        where = {s: i for i, s in enumerate(self.steps)}
        return where[_B_PRE_DISPATCH] < where[_F_MLP]


def _template_step(kind: PairKind, text: str) -> Step:
    """A template step (``role.slot.D``) read by :meth:`Step.parse`, or a ConfigError."""
    if not isinstance(cast(object, text), str):
        raise refuse(
            f"PairOrder({kind.name}): step", "a Step or its string form 'role.slot.D'", text
        )
    try:
        step = Step.parse(text.strip())
    except ConfigError:
        step = None
    if (
        step is None
        or step.role is None
        or step.slot is None
        or (step.microbatch, step.layer, step.stream) != (None, None, None)
    ):
        raise ConfigError(
            f"PairOrder({kind.name}): expected 'role.slot.D' (role one of f, b, g, c; slot one "
            f"of {', '.join(s.value for s in _LAYER_SLOTS)}; D one of F, B, W, R), received "
            f"{text!r}"
        )
    return step


def _check(kind: PairKind, steps: tuple[Step, ...]) -> None:
    want = template(kind)
    where = f"PairOrder({kind.name})"
    seen: set[Step] = set()
    for s in steps:
        if s in seen:
            raise ConfigError(f"{where}: expected each step once, received {s} twice")
        seen.add(s)
    may = optional(kind)
    if not want <= seen <= want | may:
        missing = sorted(str(s) for s in want - seen)
        extra = sorted(str(s) for s in seen - want - may)
        also = f", and any of {sorted(str(s) for s in may)}" if may else ""
        raise ConfigError(
            f"{where}: expected exactly the steps {sorted(str(s) for s in want)}{also}, "
            f"received {len(steps)} steps (missing {missing}, not of this kind {extra}); start "
            f"from PairOrder.megatron(PairKind.{kind.name}) and move steps"
        )
    index = {s: i for i, s in enumerate(steps)}
    for a, b in before(kind, steps):
        if index[a] > index[b]:
            raise ConfigError(
                f"{where}: expected {a} before {b} ({_why(kind, a, b)}), received it after "
                f"(position {index[a]} > {index[b]}); such an order would change which values "
                "a step reads, or the order gradients add up"
            )


def _why(kind: PairKind, a: Step, b: Step) -> str:
    if a.direction is R:
        return "a slot is recomputed before its backward, which runs from what it rebuilt"
    if a.role is b.role:
        return "a microbatch runs its own steps in order"
    if kind is PairKind.FORWARDS:
        return "the first forward's step of a slot comes first"
    return "the first backward's gradients of a slot add up first"


_B_PRE_DISPATCH = Step(B, role=Role.B, slot=Slot.PRE_DISPATCH)
_F_MLP = Step(F, role=Role.F, slot=Slot.MLP)
_MEGATRONS = {kind: PairOrder(kind, text) for kind, text in _MEGATRON.items()}
_MEGATRON_EARLY = PairOrder(PairKind.MIXED, _EARLY_RELEASE)


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleOrder:
    """The order of each kind of paired run; ``None`` is Megatron-Core's.

    ``mixed``: a forward with a backward (the steady state; with
    ``ScheduleOptions.ep_overlap_early_attn_memory_release``, Megatron's order moved for it
    when ``None``); ``forwards``: the fill's two forwards; ``backwards``: the drain's two
    backwards. :func:`~moe_overlap.steps.search_order` finds one from measured durations;
    ``str()`` / :meth:`parse` (JSON) save and load it.
    """

    mixed: PairOrder | None = None
    forwards: PairOrder | None = None
    backwards: PairOrder | None = None

    def __post_init__(self) -> None:
        for guard in on_arguments:  # each None or a PairOrder of its kind
            guard.arguments("ScheduleOrder", self)

    def of(self, kind: PairKind, *, early_attn_release: bool = False) -> PairOrder:
        """The order a run of ``kind`` uses."""
        chosen: PairOrder | None = getattr(self, _NAMES[kind])
        if chosen is None:
            return PairOrder.megatron(kind, early_attn_release=early_attn_release)
        return chosen

    def __str__(self) -> str:
        orders: dict[str, PairOrder | None] = {name: getattr(self, name) for name in _FIELDS}
        return json.dumps({name: None if o is None else str(o) for name, o in orders.items()})

    @classmethod
    def parse(cls, text: str) -> "ScheduleOrder":
        """Read back what ``str()`` wrote (a JSON object of the three orders)."""
        if not isinstance(cast(object, text), str):
            raise refuse("ScheduleOrder.parse: text", "the JSON str(ScheduleOrder) writes", text)
        try:
            raw: object = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"ScheduleOrder.parse: expected JSON, received {text[:80]!r}: {exc}"
            ) from None
        if not isinstance(raw, dict) or set(cast(dict[object, object], raw)) - set(_FIELDS):
            raise ConfigError(
                f"ScheduleOrder.parse: expected an object with keys {sorted(_FIELDS)}, received "
                f"{text[:120]!r}"
            )
        fields = cast(dict[str, object], raw)
        orders: dict[str, PairOrder | None] = {}
        for name, kind in _FIELDS.items():
            value = fields.get(name)
            if value is not None and not isinstance(value, str):
                raise refuse(f"ScheduleOrder.parse: {name}", "null or the steps as a string", value)
            orders[name] = None if value is None else PairOrder(kind, value)
        return cls(**orders)


_FIELDS = {"mixed": PairKind.MIXED, "forwards": PairKind.FORWARDS, "backwards": PairKind.BACKWARDS}
_NAMES = {kind: name for name, kind in _FIELDS.items()}
