"""The schedule as data: ordered, typed steps that plans walk.

A node step (a :class:`~moe_overlap.steps.Step` at the node level) names one thing a run
does: which microbatch role (``f`` for the microbatch running forward, ``b`` for the one
running backward), which layer, which slot, which direction, on which stream. The same lists drive the plans' ``run``, the step
listing printed on failure, the timeline and the critical-path bound, and they are tested
without running a tensor.

A node step prints as ``b.L3.combine.B@comm`` and :meth:`Step.parse` reads that back.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

from moe_overlap.args import NON_NEGATIVE, Int, check_arg, refuse
from moe_overlap.errors import ConfigError

from ._kinds import Direction, Role, Slot, StreamKind
from ._order import PairKind, PairOrder, ScheduleOrder
from ._step import Step

__all__ = [
    "ChunkShape",
    "Direction",
    "LayerShape",
    "Role",
    "Slot",
    "Step",
    "StreamKind",
    "backward_pair_steps",
    "chunk_steps",
    "format_steps",
    "forward_pair_steps",
    "layer_pair_steps",
    "macro_node_steps",
    "stream_of",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerShape:
    """What the step list of one layer depends on."""

    index: int
    is_moe: bool
    delay_wgrad: bool = False
    has_mtp_post: bool = False
    early_attn_release: bool = False
    order: ScheduleOrder | None = None
    """The paired runs' step orders (``None``: Megatron-Core's): ``ScheduleOptions.order``."""
    recompute: tuple[Slot, ...] = ()
    """The slots the schedule recomputes (``ScheduleOptions.recompute``): an order's ``R``
    steps of the others are left out."""

    def __post_init__(self) -> None:
        for slot in self.recompute:
            if slot is not Slot.PRE_DISPATCH and slot is not Slot.MLP:
                raise ConfigError(
                    f"LayerShape(index={self.index}): expected recompute to hold "
                    f"Slot.PRE_DISPATCH and/or Slot.MLP, received {self.recompute!r}"
                )
        if self.order is not None and self.early_attn_release:
            mixed = self.order.mixed
            if mixed is not None and not mixed.releases_attention_early():
                raise ConfigError(
                    f"LayerShape(index={self.index}): expected with early_attn_release a mixed "
                    "order running b.pre_dispatch.B before f.mlp.F, received one running it "
                    "after; move it, or leave early release off"
                )


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkShape:
    """What the step list of one chunk depends on."""

    layers: tuple[LayerShape, ...]
    has_post_process: bool = True


def stream_of(slot: Slot | None, is_moe: bool) -> StreamKind:
    """The stream a slot's node runs on: a MoE layer's dispatch and combine on comm."""
    if is_moe and slot in (Slot.DISPATCH, Slot.COMBINE):
        return StreamKind.COMM
    return StreamKind.COMP


def _node(role: Role | None, layer: LayerShape, slot: Slot | None, direction: Direction) -> Step:
    # Positional: the step lists are built per run, and keywords cost more.
    return Step(direction, None, role, layer.index, slot, stream_of(slot, layer.is_moe))


def _adder(out: list[Step]) -> Callable[[Step, LayerShape | None], None]:
    """``add(template, layer)``: append the template step (role, slot, direction) at the
    layer if the layer has it (an absent layer, a dense layer's dispatch/combine, a missing
    MTP post-process, a wgrad step without delayed wgrad, a recompute step of a slot the
    layer does not recompute have none)."""

    def add(t: Step, layer: LayerShape | None) -> None:
        if layer is None:
            return
        slot = t.slot
        if slot in (Slot.DISPATCH, Slot.COMBINE) and not layer.is_moe:
            return
        if slot is Slot.MTP_POST and not layer.has_mtp_post:
            return
        direction = t.direction
        if direction is Direction.WGRAD and not layer.delay_wgrad:
            return
        if direction is Direction.RECOMPUTE and slot not in layer.recompute:
            return
        out.append(_node(t.role, layer, slot, t.direction))

    return add


_LAST_WGRAD = Step(Direction.WGRAD, role=Role.B, slot=Slot.PRE_DISPATCH)
"""The last backward layer's pre-dispatch wgrad, left to the chunk."""


def layer_pair_steps(
    f: LayerShape | None, b: LayerShape | None, *, is_last_layer_in_bwd: bool = False
) -> list[Step]:
    """The steps of one ``TransformerLayerSchedulePlan.run(f, b)``, in order.

    ``b.combine.B | f.pre_dispatch.F | b.mlp.B | f.dispatch.F | b.mlp.W, b.dispatch.B |
    f.mlp.F | f.combine.F | b.pre_dispatch.B | f.mtp_post.F | b.pre_dispatch.W``; with
    early attention-memory release ``b.pre_dispatch.B`` moves before ``f.mlp.F``; that is
    Megatron-Core's order, the default: the shapes' ``order`` (``ScheduleOptions.order``,
    its ``mixed`` field) can give another for a forward with a backward (a layer alone keeps
    Megatron-Core's). Dense
    layers have no dispatch/combine steps (their nodes are no-ops); wgrad steps appear only
    when wgrad is delayed, recompute steps (``b.mlp.R``) only for the slots the layer
    recomputes; the last backward layer's pre-dispatch wgrad is left to the chunk.
    """
    early = b is not None and b.early_attn_release
    if f is None or b is None:  # one microbatch alone: Megatron-Core's order, whatever given
        order = PairOrder.megatron(PairKind.MIXED, early_attn_release=early)
    else:
        order = _order_of(PairKind.MIXED, (f, b), early_attn_release=early)
    skip = _LAST_WGRAD if is_last_layer_in_bwd else None
    out: list[Step] = []
    add = _adder(out)
    layers: dict[Role | None, LayerShape | None] = {Role.F: f, Role.B: b}
    for t in order.steps:
        if skip is None or t != skip:
            add(t, layers[t.role])
    return out


def _order_of(
    kind: PairKind, shapes: Sequence[LayerShape | None], *, early_attn_release: bool = False
) -> PairOrder:
    """The order of ``kind`` the shapes were built with (they must agree)."""
    given = [s for s in shapes if s is not None]
    orders = {s.order for s in given}
    if len(orders) > 1:
        raise ConfigError(
            f"{kind.name.lower()} run of layers {[s.index for s in given]}: expected plans built "
            "with one ScheduleOptions.order, received different orders; build every plan of "
            "a schedule with the same options"
        )
    order = next(iter(orders), None) or _MEGATRON_ORDER
    return order.of(kind, early_attn_release=early_attn_release)


_MEGATRON_ORDER = ScheduleOrder()


def _chunk_step(role: Role, slot: Slot, direction: Direction) -> Step:
    stream = StreamKind.HOST if direction is Direction.HOOK else StreamKind.COMP
    return Step(direction, None, role, None, slot, stream)  # positional: built per run


def chunk_steps(
    f: ChunkShape | None,
    b: ChunkShape | None,
    *,
    pre_forward: bool = False,
    pre_backward: bool = False,
    post_forward: bool = False,
    post_backward: bool = False,
) -> list[Step]:
    """The steps of one ``ModelChunkSchedulePlan.run(f, b, ...)``, in order.

    1. ``pre_forward`` hook, f pre-process forward;
    2. ``pre_backward`` hook, b post-process backward;
    3. forward layer ``i`` of f paired with backward layer ``n-1-i`` of b;
    4. leftover backward layers alone, then leftover forward layers alone;
    5. ``post_forward`` / ``post_backward`` hooks;
    6. the delayed pre-dispatch wgrad of b's first layer;
    7. f post-process forward, b pre-process backward.
    """
    F, B = Role.F, Role.B
    out: list[Step] = []
    if f is not None:
        if pre_forward:
            out.append(_chunk_step(F, Slot.PRE_FORWARD, Direction.HOOK))
        out.append(_chunk_step(F, Slot.PRE_PROCESS, Direction.FORWARD))
    if b is not None:
        if pre_backward:
            out.append(_chunk_step(B, Slot.PRE_BACKWARD, Direction.HOOK))
        if b.has_post_process:
            out.append(_chunk_step(B, Slot.POST_PROCESS, Direction.BACKWARD))
    f_layers = list(f.layers) if f is not None else list[LayerShape]()
    b_layers = list(reversed(b.layers)) if b is not None else list[LayerShape]()
    n_b = len(b_layers)
    paired = min(len(f_layers), n_b)
    for i in range(paired):
        out += layer_pair_steps(f_layers[i], b_layers[i], is_last_layer_in_bwd=i == n_b - 1)
    for i in range(paired, n_b):
        out += layer_pair_steps(None, b_layers[i], is_last_layer_in_bwd=i == n_b - 1)
    for i in range(paired, len(f_layers)):
        out += layer_pair_steps(f_layers[i], None)
    if f is not None and post_forward:
        out.append(_chunk_step(F, Slot.POST_FORWARD, Direction.HOOK))
    if b is not None and post_backward:
        out.append(_chunk_step(B, Slot.POST_BACKWARD, Direction.HOOK))
    if n_b and b_layers[-1].delay_wgrad:
        last = b_layers[-1]
        out.append(_node(B, last, Slot.PRE_DISPATCH, Direction.WGRAD))
    if f is not None and f.has_post_process:
        out.append(_chunk_step(F, Slot.POST_PROCESS, Direction.FORWARD))
    if b is not None:
        out.append(_chunk_step(B, Slot.PRE_PROCESS, Direction.BACKWARD))
    return out


def _same_layers(a: ChunkShape, c: ChunkShape, where: str) -> None:
    if len(a.layers) != len(c.layers):
        raise ConfigError(
            f"{where}: expected two chunks of one model (the same layers), received "
            f"{len(a.layers)} and {len(c.layers)} layers"
        )


def forward_pair_steps(a: ChunkShape, c: ChunkShape) -> list[Step]:
    """Two forwards of one model overlapped (the fill of combined 1F1B), in order.

    ``a`` (role ``f``) runs one slot ahead of ``c`` (role ``g``) through each layer::

        f.pre_dispatch | f.dispatch@comm | g.pre_dispatch | f.mlp | g.dispatch@comm |
        f.combine@comm | g.mlp | g.combine@comm

    so each one's all-to-all runs under the other's compute (the default order; the shapes'
    ``order.forwards`` can give another). Pre-process of both first, post-process of both
    last (``a`` then ``c``).
    """
    _same_layers(a, c, "forward_pair_steps")
    A, C = Role.F, Role.F2
    out = [_chunk_step(A, Slot.PRE_PROCESS, Direction.FORWARD)]
    out.append(_chunk_step(C, Slot.PRE_PROCESS, Direction.FORWARD))
    add = _adder(out)
    for la, lc in zip(a.layers, c.layers, strict=True):
        order = _order_of(PairKind.FORWARDS, (la, lc))
        layers: dict[Role | None, LayerShape] = {A: la, C: lc}
        for t in order.steps:
            add(t, layers[t.role])
    fwd = Direction.FORWARD
    for role, shape in ((A, a), (C, c)):
        if shape.has_post_process:
            out.append(_chunk_step(role, Slot.POST_PROCESS, fwd))
    return out


_ALONE_BACKWARD = tuple(
    Step(direction, role=role, slot=slot)
    for role in (Role.B, Role.B2)
    for slot, direction in (
        (Slot.MTP_POST, Direction.BACKWARD),
        (Slot.COMBINE, Direction.BACKWARD),
        (Slot.MLP, Direction.BACKWARD),
        (Slot.MLP, Direction.WGRAD),
        (Slot.DISPATCH, Direction.BACKWARD),
        (Slot.PRE_DISPATCH, Direction.BACKWARD),
        (Slot.PRE_DISPATCH, Direction.WGRAD),
    )
)
"""An MTP layer's two backwards, one microbatch after the other (``b`` then ``c``)."""


def backward_pair_steps(b1: ChunkShape, b2: ChunkShape) -> list[Step]:
    """Two backwards of one model overlapped (the drain of combined 1F1B), in order.

    ``b1`` (role ``b``, the earlier microbatch) runs one slot ahead of ``b2`` (role
    ``c``) through each layer, from the last::

        b.combine@comm | b.mlp | c.combine@comm | b.mlp.W | b.dispatch@comm | c.mlp |
        c.mlp.W | b.pre_dispatch | c.dispatch@comm | b.pre_dispatch.W | c.pre_dispatch |
        c.pre_dispatch.W

    (the default order; the shapes' ``order.backwards`` can give another). Every slot's backward and weight gradient of ``b1`` runs before ``b2``'s of the same
    slot, so each parameter accumulates the two microbatches' contributions in their
    order, as plain ``backward()`` per microbatch does; and a slot's delayed weight
    gradient of ``b1`` is computed before ``b2``'s backward of that slot, so no layer owes
    two microbatches' weight gradients at once (what a layer keeps one of at a time).
    An MTP layer runs its two microbatches one after the other. Post-process backward of
    both first, pre-process backward of both last.
    """
    _same_layers(b1, b2, "backward_pair_steps")
    P, Q = Role.B, Role.B2
    bwd = Direction.BACKWARD
    out: list[Step] = []
    for role, shape in ((P, b1), (Q, b2)):
        if shape.has_post_process:
            out.append(_chunk_step(role, Slot.POST_PROCESS, bwd))
    add = _adder(out)
    for l1, l2 in zip(reversed(b1.layers), reversed(b2.layers), strict=True):
        layers: dict[Role | None, LayerShape] = {P: l1, Q: l2}
        if l1.has_mtp_post or l2.has_mtp_post:
            # An MTP layer's post-process backward feeds weight gradients its pre-dispatch
            # wgrad computes: its two microbatches run one after the other.
            for t in _ALONE_BACKWARD:
                add(t, layers[t.role])
            continue
        order = _order_of(PairKind.BACKWARDS, (l1, l2))
        for t in order.steps:
            add(t, layers[t.role])
    out.append(_chunk_step(P, Slot.PRE_PROCESS, bwd))
    out.append(_chunk_step(Q, Slot.PRE_PROCESS, bwd))
    return out


def macro_node_steps(
    forward: Sequence[ChunkShape],
    backward: Sequence[ChunkShape],
    *,
    pre_forward: bool = False,
    pre_backward: bool = False,
    post_forward: bool = False,
    post_backward: bool = False,
) -> list[Step]:
    """The node steps of one macro step: ``forward`` chunks' forwards with ``backward``'s.

    One forward and/or one backward: :func:`chunk_steps` (roles ``f``, ``b``; the p2p
    hooks' steps where asked for); two forwards: :func:`forward_pair_steps` (``f``, ``g``);
    two backwards: :func:`backward_pair_steps` (``b``, ``c``). Anything else is a
    :class:`~moe_overlap.ConfigError`.
    """
    hooks = pre_forward or pre_backward or post_forward or post_backward
    kind = (len(forward), len(backward))
    if kind[0] <= 1 and kind[1] <= 1:
        return chunk_steps(
            forward[0] if forward else None,
            backward[0] if backward else None,
            pre_forward=pre_forward,
            pre_backward=pre_backward,
            post_forward=post_forward,
            post_backward=post_backward,
        )
    if kind in ((2, 0), (0, 2)) and not hooks:
        if kind == (2, 0):
            return forward_pair_steps(forward[0], forward[1])
        return backward_pair_steps(backward[0], backward[1])
    raise ConfigError(
        f"macro_node_steps: expected at most one forward and one backward, or two forwards, "
        f"or two backwards (p2p hooks only with the first), received {kind[0]} forwards and "
        f"{kind[1]} backwards{' with hooks' if hooks else ''}"
    )


def format_steps(
    steps: Sequence[Step], *, mark: int | None = None, context: int | None = None
) -> str:
    """One step per line, numbered; ``mark`` flags a step with ``<-- ERROR HERE``.

    With ``context`` (an int >= 0; needs ``mark``), only that many steps either side of
    ``mark`` are shown.
    """
    given = cast(object, steps)
    if isinstance(given, (str, bytes)) or not isinstance(given, Sequence):
        raise refuse("format_steps: steps", "a sequence of steps (a list or tuple)", steps)
    # A mark past the steps flagged none, a negative context showed none, a bool mark
    # flagged step 1, and a context without a mark was ignored: all without a word.
    if mark is not None:
        last = Int(0, len(steps) - 1, max_name="len(steps) - 1")
        mark = check_arg("format_steps", "mark", mark, last)
    if context is not None:
        context = check_arg("format_steps", "context", context, NON_NEGATIVE)
        if mark is None:
            raise refuse(
                "format_steps: context",
                "given with mark (the steps either side of it)",
                context,
                hint="pass mark=<the step's index>, or leave context out for every step",
            )
    lo, hi = 0, len(steps)
    if mark is not None and context is not None:
        lo, hi = max(0, mark - context), min(len(steps), mark + context + 1)
    lines: list[str] = []
    for i in range(lo, hi):
        flag = "  <-- ERROR HERE" if i == mark else ""
        lines.append(f"{i:4d}  {steps[i]}{flag}")
    return "\n".join(lines)
