"""How a transformers decoder layer computes, read off one traced run of its own forward.

A run of the layer's ``forward`` on a probe, with hooks on its children, shows which
children it calls, in which order, with which arguments. From that the adapter derives
the candidate splits of a MoE layer into slots (:class:`MoESplit`): the norms before and
after attention and the MLP, the MoE block (the child holding ``experts``), children that
add to it (a shared MLP), a parallel attention/MLP residual, a residual multiplier. The
self-check (:mod:`._hf_probe`) keeps the candidate that reproduces the layer.

How the block calls its experts decides the routed-expert convention
(:class:`ExpertsCall`): ``routed`` — ``experts(hidden [T, D], index [T, K], weights
[T, K])`` in some argument order, what transformers 5's families do; ``prescaled`` — one
argument, every token repeated per expert and scaled by its router score (Llama 4).
"""

from __future__ import annotations

import contextlib
import copy
from collections import deque
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from moe_overlap import ConfigError
from moe_overlap.adapters._hf_calls import CallSpec, LayerCall, swap_child
from moe_overlap.adapters._hf_experts import DelayedLinear

__all__ = [
    "ArgSlot",
    "ChildCall",
    "ExpertsCall",
    "ExpertsKind",
    "ExpertsStandIn",
    "LayerTrace",
    "MoESplit",
    "block_norm_identity",
    "candidate_splits",
    "measure_block",
    "trace_layer",
]


@dataclass(slots=True)
class ChildCall:
    """One call of a child module during the traced forward."""

    name: str
    module: nn.Module
    args: tuple[object, ...]
    kwargs: dict[str, object]
    output: object


@dataclass(slots=True)
class LayerTrace:
    """The traced run: the layer's input, its children's calls, the MoE block's inside."""

    hidden: Tensor
    call: LayerCall
    children: list[ChildCall] = field(default_factory=list[ChildCall])
    block_name: str | None = None
    block_children: list[ChildCall] = field(default_factory=list[ChildCall])
    experts_calls: list[ChildCall] = field(default_factory=list[ChildCall])
    linear_calls: dict[str, int] = field(default_factory=dict[str, int])
    """Calls of each exact ``nn.Linear`` under the layer (by name relative to it)."""

    def delayable(self) -> frozenset[str]:
        """The linears whose weight gradient may wait: called exactly once per forward."""
        return frozenset(n for n, k in self.linear_calls.items() if k == 1)


class ExpertsKind(Enum):
    """The routed-expert convention of a MoE block (see the module docstring)."""

    ROUTED = "routed"
    PRESCALED = "prescaled"


ArgSlot = int | str
"""Where a recorded call passed an argument: its position (``int``) or its keyword (``str``)."""


def argument(slot: ArgSlot, args: Sequence[object], kwargs: Mapping[str, object]) -> object:
    """The argument a call passed at ``slot``."""
    return args[slot] if isinstance(slot, int) else kwargs[slot]


@dataclass(frozen=True, slots=True)
class ExpertsCall:
    """How the MoE block calls ``experts`` (see the module docstring)."""

    kind: ExpertsKind
    hidden: ArgSlot
    index: ArgSlot | None = None
    """``routed``: the ``[T, K]`` expert indices..."""
    weights: ArgSlot | None = None
    """... and their ``[T, K]`` weights."""
    router: str = ""
    """``prescaled``: the block child whose output holds the ``[T, E]`` router scores..."""
    router_output: int = 0
    """... at this position of its output tuple."""
    top_k: int = 0

    def routed_slots(self) -> tuple[ArgSlot, ArgSlot, ArgSlot]:
        """Where a ``routed`` call passes the hidden rows, the indices and the weights."""
        assert self.index is not None, "a routed call passes indices"
        assert self.weights is not None, "a routed call passes weights"
        return self.hidden, self.index, self.weights


@dataclass(frozen=True, slots=True)
class MoESplit:
    """A MoE decoder layer as the slots compute it (names are the layer's children)::

    a = attn(in_norm(x));  a = attn_out_norm(a);  h = x + a * multiplier
    u = pre_mlp_norm(h)                      (parallel: u = in_norm(x))
    m = block(u) [+ extra(u) ...];  m = mlp_out_norm(m);  out = h + m * multiplier
    """

    in_norm: str | None
    attn: str
    attn_call: CallSpec
    attn_out_norm: str | None
    pre_mlp_norm: str | None
    block: str
    block_call: CallSpec
    extras: tuple[tuple[str, CallSpec], ...]
    mlp_out_norm: str | None
    parallel: bool
    multiplier: float | None
    experts: ExpertsCall
    experts_scale: float | None = None
    """The block returns ``experts_scale * experts(...) + rest`` (``None``: 1)..."""
    block_out_norm: str | None = None
    """... then this child of the block normalizes it (stood in for by the identity in
    pre-dispatch, applied in combine)."""
    block_adds: bool = True
    """The block's output is computed from more than its experts' output (its input, its
    parameters: shared experts): ``rest`` is handed to combine, whatever its value and
    whether or not it carries a gradient. Read off the autograd graph, never the values."""

    def describe(self) -> str:
        parts = [
            f"in_norm={self.in_norm}",
            f"attn={self.attn}",
            f"attn_out_norm={self.attn_out_norm}",
            f"pre_mlp_norm={self.pre_mlp_norm}",
            f"block={self.block}",
            f"extras={[n for n, _ in self.extras]}",
            f"mlp_out_norm={self.mlp_out_norm}",
            f"parallel={self.parallel}",
            f"multiplier={self.multiplier}",
            f"experts={self.experts.kind.value}",
            f"experts_scale={self.experts_scale}",
            f"block_out_norm={self.block_out_norm}",
            f"block_adds={self.block_adds}",
        ]
        return ", ".join(parts)


def _named_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``module.named_modules()``, typed (torch leaves the generator unannotated)."""
    return cast("list[tuple[str, nn.Module]]", list(module.named_modules()))  # pyright: ignore[reportUnknownArgumentType]


def is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or "norm" in type(module).__name__.lower()


def block_of(layer: nn.Module) -> tuple[str, nn.Module] | None:
    """The child holding a routed ``experts`` module (the MoE block), if the layer has one.

    With several (JetMoE's attention is a mixture of attention experts too), the last
    registered: the feed-forward part comes after the attention.
    """
    found: tuple[str, nn.Module] | None = None
    for name, child in layer.named_children():
        experts: object = getattr(child, "experts", None)
        if isinstance(experts, nn.Module) and any(p.dim() == 3 for p in experts.parameters()):
            found = (name, child)
    return found


@contextlib.contextmanager
def _hooks(
    modules: list[tuple[str, nn.Module]], out: list[ChildCall]
) -> Generator[None, None, None]:
    handles: list[RemovableHandle] = []
    for name, module in modules:

        def hook(
            m: nn.Module,
            args: tuple[object, ...],
            kwargs: dict[str, object],
            output: object,
            name: str = name,
        ) -> None:
            out.append(ChildCall(name, m, args, dict(kwargs), output))

        handles.append(module.register_forward_hook(hook, with_kwargs=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def first_tensor(value: object) -> Tensor:
    """``value`` or its first item, a tensor (a module's output), or ConfigError."""
    kind = type(value).__name__
    if isinstance(value, Tensor):
        return value
    if isinstance(value, (tuple, list)):
        items = cast("Sequence[object]", value)
        if items and isinstance(items[0], Tensor):
            return items[0]
    raise ConfigError(f"expected a tensor or a tuple starting with one, received {kind}")


class ExpertsStandIn(nn.Module):
    """Takes a block's routed experts' place inside the block's own forward.

    Keeps the call's arguments (:meth:`get`; and, as :class:`ChildCall`, in each list of
    ``records``) and returns ``value``, or zeros shaped like the first argument (so the
    block's output is what it adds beside its experts, and a trace never depends on which
    experts this rank holds). Other attributes are the experts module's, which the block
    may read.
    """

    def __init__(
        self, experts: nn.Module, *records: list[ChildCall], value: Tensor | None = None
    ) -> None:
        super().__init__()
        object.__setattr__(self, "_experts", experts)
        self.records = records
        self.value = value
        self.args: tuple[object, ...] = ()
        self.kwargs: dict[str, object] = {}

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(cast(nn.Module, object.__getattribute__(self, "_experts")), name)

    def forward(self, *args: object, **kwargs: object) -> Tensor:
        self.args, self.kwargs = args, kwargs
        if self.value is not None:
            out = self.value
        else:
            first = args[0] if args else next(iter(kwargs.values()))
            assert isinstance(first, Tensor)
            out = torch.zeros_like(first)
        experts = cast(nn.Module, object.__getattribute__(self, "_experts"))
        for calls in self.records:
            calls.append(ChildCall("experts", experts, args, dict(kwargs), out))
        return out

    def get(self, slot: ArgSlot) -> Tensor:
        """The argument of the last call at ``slot``."""
        value = argument(slot, self.args, self.kwargs)
        assert isinstance(value, Tensor)
        return value

    def forget(self) -> None:
        """Drop the kept arguments (they hold the block's tensors)."""
        self.args, self.kwargs = (), {}


def trace_layer(layer: nn.Module, hidden: Tensor, call: LayerCall) -> tuple[Tensor, LayerTrace]:
    """Run ``layer`` as the model does (its routed experts stood in for by zeros), recording
    its children's calls; and its output."""
    trace = LayerTrace(hidden, call)
    children = list(layer.named_children())
    found = block_of(layer)
    inner: list[tuple[str, nn.Module]] = []
    swap: AbstractContextManager[None] = nullcontext()
    if found is not None:
        trace.block_name = found[0]
        inner = [(n, m) for n, m in found[1].named_children() if n != "experts"]
        recorder = ExpertsStandIn(
            found[1].get_submodule("experts"), trace.experts_calls, trace.block_children
        )
        swap = swap_child(found[1], "experts", recorder)
    counts = trace.linear_calls
    handles: list[RemovableHandle] = []
    for name, m in _named_modules(layer):
        if type(m) is nn.Linear or isinstance(m, DelayedLinear):
            counts[name] = 0

            def count(mod: nn.Module, args: object, name: str = name) -> None:
                del mod, args
                counts[name] += 1

            handles.append(m.register_forward_pre_hook(count))
    try:
        with swap, _hooks(children, trace.children), _hooks(inner, trace.block_children):
            out = layer(hidden, *call.args, **dict(call.kwargs))
    finally:
        for h in handles:
            h.remove()
    return first_tensor(out), trace


def _out(call: ChildCall) -> object:
    """The first output (the hidden output) of a child call."""
    return _outputs(call)[0]


def _arg(call: ChildCall) -> object:
    """The first argument (the hidden input) of a child call."""
    if call.args:
        return call.args[0]
    return call.kwargs.get("hidden_states")


def _spec(where: str, c: ChildCall, trace: LayerTrace) -> CallSpec:
    return CallSpec.record(where, c.args, c.kwargs, hidden=_arg(c), call=trace.call)


def _outputs(call: ChildCall) -> tuple[object, ...]:
    raw: object = call.output
    return cast("tuple[object, ...]", raw) if isinstance(raw, tuple) else (raw,)


def _experts_call(trace: LayerTrace, where: str, top_k: int | None) -> ExpertsCall:
    """How the block calls its experts, from the traced call's arguments (their kinds and
    shapes) and, for prescaled rows, the autograd graph (which router output they are
    scaled by); never from the values. ``top_k``: the config's, for prescaled rows (a
    routed call says its own: the index's last dimension)."""
    if len(trace.experts_calls) != 1:
        raise ConfigError(
            f"{where}: expected the MoE block to call its experts once, received "
            f"{len(trace.experts_calls)} calls"
        )
    c = trace.experts_calls[0]
    slots: list[tuple[ArgSlot, Tensor]] = []
    slots += [(i, a) for i, a in enumerate(c.args) if isinstance(a, Tensor)]
    slots += [(k, v) for k, v in c.kwargs.items() if isinstance(v, Tensor)]
    ints = [s for s, t in slots if not t.is_floating_point()]
    floats = [s for s, t in slots if t.is_floating_point()]
    tensors = dict(slots)
    if len(slots) == 3 and len(ints) == 1 and len(floats) == 2:
        index = tensors[ints[0]]
        if index.dim() != 2:
            raise ConfigError(
                f"{where}: expected the experts' index argument as [tokens, top-k], received "
                f"shape {tuple(index.shape)}"
            )
        return ExpertsCall(
            ExpertsKind.ROUTED,
            hidden=floats[0],
            index=ints[0],
            weights=floats[1],
            top_k=index.shape[1],
        )
    if len(slots) == 1 and len(floats) == 1:
        rows_in = tensors[floats[0]]
        rows = rows_in.shape[0]
        tokens = trace.hidden.shape[0] * trace.hidden.shape[1]
        found: list[tuple[str, int, Tensor]] = []
        for bc in trace.block_children:
            for i, o in enumerate(_outputs(bc)):
                if (
                    isinstance(o, Tensor)
                    and o.dim() == 2
                    and o.shape[0] == tokens
                    and rows == tokens * o.shape[1]
                ):
                    found.append((bc.name, i, o))
        # The router output the rows are scaled by: the [T, E] one they are computed from
        # most directly (Llama 4's router returns its scores and the logits they came from).
        pick = nearest_source(rows_in, [o for _, _, o in found])
        if pick is not None:
            if top_k is None:
                raise ConfigError(
                    f"{where}: expected the router's top-k in the config "
                    "(num_experts_per_tok), received none"
                )
            name, i, _ = found[pick]
            return ExpertsCall(
                ExpertsKind.PRESCALED, hidden=floats[0], router=name, router_output=i, top_k=top_k
            )
    raise ConfigError(
        f"{where}: expected experts(hidden [T, D], index [T, K], weights [T, K]) or "
        "experts(hidden scaled by router scores [E*T, D]), received arguments "
        + ", ".join(f"{k!r}: {tuple(t.shape)} {t.dtype}" for k, t in slots)
    )


def candidate_splits(
    layer: nn.Module, trace: LayerTrace, *, top_k: int | None, multiplier: float | None
) -> list[MoESplit]:
    """Every split of a MoE layer the traced call order allows, the likeliest first (the
    one the traced tensors' identities point to: which child's output another takes).

    Raises :class:`~moe_overlap.ConfigError` when the order fits none (children the split
    cannot place, a block called more than once, ...).
    """
    where = type(layer).__name__
    calls = [
        c for c in trace.children if not (isinstance(c.module, nn.Dropout) and c.module.p == 0)
    ]
    for c in calls:
        if isinstance(c.module, nn.Dropout):
            raise ConfigError(f"{where}.{c.name}: dropout p={c.module.p} > 0 cannot be reproduced")
    names = [c.name for c in calls]
    block = trace.block_name
    assert block is not None
    if names.count(block) != 1:
        raise ConfigError(
            f"{where}: expected one call of the MoE block {block!r}, received calls {names}"
        )
    b = names.index(block)
    before, after = calls[:b], calls[b + 1 :]
    attn_i = next((i for i, c in enumerate(before) if not is_norm(c.module)), None)
    if attn_i is None:
        raise ConfigError(
            f"{where}: expected an attention child before {block!r}, received {names}"
        )
    pre = before[:attn_i]
    attn = before[attn_i]
    mid = before[attn_i + 1 :]
    if len(pre) > 1 or any(not is_norm(c.module) for c in mid) or len(mid) > 2:
        raise ConfigError(
            f"{where}: expected [norm] attention [norm] [norm] {block} ..., received calls {names}"
        )
    post_norms = [c for c in after if is_norm(c.module)]
    extras = [c for c in after if not is_norm(c.module)]
    if len(post_norms) > 1 or (post_norms and after.index(post_norms[0]) != len(after) - 1):
        raise ConfigError(
            f"{where}: expected at most one norm after the MLP part, received calls {names}"
        )
    block_call = calls[b]
    u = _arg(block_call)
    for e in extras:
        if _arg(e) is not u:
            raise ConfigError(
                f"{where}.{e.name}: expected it to take the MoE block's input, as a shared MLP "
                "does; received another tensor"
            )
    experts = _experts_call(trace, f"{where}.{block}", top_k)
    inner = [c.name for c in trace.block_children]
    last = trace.block_children[-1] if trace.block_children else None
    block_out_norm = (
        last.name
        if last is not None
        and is_norm(last.module)
        and "experts" in inner
        and inner.index("experts") < len(inner) - 1
        else None
    )
    base = MoESplit(
        in_norm=pre[0].name if pre else None,
        attn=attn.name,
        attn_call=_spec(f"{where}.{attn.name}", attn, trace),
        attn_out_norm=None,
        pre_mlp_norm=None,
        block=block,
        block_call=_spec(f"{where}.{block}", block_call, trace),
        extras=tuple((e.name, _spec(f"{where}.{e.name}", e, trace)) for e in extras),
        mlp_out_norm=post_norms[0].name if post_norms else None,
        parallel=False,
        multiplier=multiplier,
        experts=experts,
        block_out_norm=block_out_norm,
    )
    if len(mid) == 2:
        shapes = [replace(base, attn_out_norm=mid[0].name, pre_mlp_norm=mid[1].name)]
    elif len(mid) == 1:
        shapes = [replace(base, pre_mlp_norm=mid[0].name), replace(base, attn_out_norm=mid[0].name)]
        # The norm normalizes the attention output (then a sum feeds the block) rather than
        # the block's input: the block does not take the norm's output, the norm takes
        # the attention's.
        if u is not _out(mid[0]) and _arg(mid[0]) is _out(attn):
            shapes.reverse()
    else:
        shapes = [replace(base, parallel=True), base] if pre else [base]
        # Sequential: the block takes a new sum (x + attention), not the input norm's output.
        if pre and u is not _out(pre[0]):
            shapes.reverse()
    if multiplier is not None:
        shapes += [replace(s, multiplier=None) for s in shapes]
    return shapes


def experts_arguments(
    call: ExpertsCall, hidden: Tensor, index: Tensor, weights: Tensor
) -> tuple[list[object], dict[str, object]]:
    """Positional and keyword arguments for ``experts`` in the block's own (routed) convention."""
    hidden_at, index_at, weights_at = call.routed_slots()
    values: dict[ArgSlot, Tensor] = {hidden_at: hidden, index_at: index, weights_at: weights}
    n = 1 + max((s for s in values if isinstance(s, int)), default=-1)
    args: list[object] = [None] * n
    kwargs: dict[str, object] = {}
    for slot, v in values.items():
        if isinstance(slot, int):
            args[slot] = v
        else:
            kwargs[slot] = v
    return args, kwargs


def zeros_like_output(x: Tensor) -> Tensor:
    """What the stand-in experts return: zeros shaped like their input rows."""
    return torch.zeros_like(x)


@contextlib.contextmanager
def _requiring_grad(params: Sequence[nn.Parameter]) -> Generator[None, None, None]:
    """Every one of ``params`` (leaves of a probe copy) requires grad inside; restored after."""
    before = [p.requires_grad for p in params]
    try:
        for p in params:
            p.requires_grad_(True)
        yield
    finally:
        for p, flag in zip(params, before, strict=True):
            p.requires_grad_(flag)


def _graph_nodes(t: Tensor) -> Iterator[object]:
    """The autograd nodes ``t`` is computed from, nearest first (breadth first)."""
    root: object = t.grad_fn
    if root is None:
        return
    seen = {id(root)}
    queue: deque[object] = deque([root])
    while queue:
        node = queue.popleft()
        yield node
        nexts: object = getattr(node, "next_functions", ())
        for item in cast("tuple[tuple[object, int], ...]", nexts):
            child = item[0]
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                queue.append(child)


def _node_of(t: Tensor) -> object | None:
    """The autograd node a graph reaches ``t`` through: its ``grad_fn``, or, for a leaf
    requiring grad, its gradient accumulator (by identity: ``AccumulateGrad.variable``
    does not give back the same tensor object on every torch release)."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    return torch.autograd.graph.get_gradient_edge(t).node


def graph_reaches(t: Tensor, leaf: Tensor) -> tuple[bool, bool]:
    """Whether ``t``'s autograd graph reaches ``leaf`` (a leaf requiring grad), and whether
    it reaches any other leaf requiring grad (which tensors its value depends on, whatever
    their values)."""
    target = _node_of(leaf)
    if t.grad_fn is None:
        return (t is leaf, t.requires_grad and t is not leaf)
    found = other = False
    for node in _graph_nodes(t):
        if type(node).__name__ != "AccumulateGrad":
            continue
        if node is target:
            found = True
        else:
            other = True
    return found, other


def nearest_source(t: Tensor, candidates: Sequence[Tensor]) -> int | None:
    """The index of the candidate ``t`` is computed from most directly (fewest autograd
    steps), or ``None`` when it is computed from none of them."""
    nodes = [_node_of(c) for c in candidates]
    for node in _graph_nodes(t):
        for i, c in enumerate(nodes):
            if c is not None and node is c:
                return i
    return None


def measure_block(block: nn.Module, trace: LayerTrace, split: MoESplit, where: str) -> MoESplit:
    """The split with how the block's output depends on its experts' output: ``c`` in
    ``c * experts + rest`` (``experts_scale``; ``None`` for 1) and whether there is a
    ``rest`` at all (``block_adds``).

    Decided by structure, never by the weights' values: the block runs on its traced input
    with the experts' output a zero leaf ``z`` and every parameter of the block requiring
    grad; its output's autograd graph says what it is computed from. Anything besides
    ``z`` (the block's input, a parameter: shared experts, their gates) makes a ``rest``
    that combine adds, whatever its value (a zero-initialised shared expert still trains).
    The gradient with respect to ``z`` must depend on nothing (no norm or gate after the
    experts, no parameter scaling them); ``c`` is then measured with a random output of
    the probe's own. Raises :class:`~moe_overlap.ConfigError` when the dependence is not a
    constant multiple.
    """
    call = next(c for c in trace.children if c.name == split.block)
    u = _arg(call)
    assert isinstance(u, Tensor)
    ec = trace.experts_calls[0]
    x = argument(split.experts.hidden, ec.args, ec.kwargs)
    assert isinstance(x, Tensor)
    experts = block.get_submodule("experts")

    def run(value: Tensor, u_in: Tensor, on: nn.Module = block) -> Tensor:
        stand_in = ExpertsStandIn(experts, value=value)
        with swap_child(on, "experts", stand_in), block_norm_identity(on, split):
            return first_tensor(split.block_call.call(on, u_in, trace.call))

    params = list(block.parameters())
    with _requiring_grad(params), torch.enable_grad():
        z = torch.zeros_like(x, requires_grad=True)
        rest = run(z, u.detach().requires_grad_())
        reaches_z, reaches_other = graph_reaches(rest, z)
        if not reaches_z:
            raise ConfigError(
                f"{where}: expected the MoE block's output to be computed from its routed "
                "experts' output, received an output that is not (its autograd graph does "
                "not reach the experts' output)"
            )
        adds = reaches_other or bool(rest.detach().abs().max() > 0)
        try:
            (dz,) = torch.autograd.grad(rest, z, torch.ones_like(rest), create_graph=True)
            depends = dz.requires_grad
        except RuntimeError:  # an op without double backward: the measure below decides
            depends = False
    if not adds:
        adds = _adds_with_random_weights(
            block, experts, lambda on: run(torch.zeros_like(x), u.detach(), on)
        )
    if depends:
        raise ConfigError(
            f"{where}: the MoE block transforms its routed experts' output other than by a "
            "constant factor (a norm, a gate or a parameter applied after the experts: the "
            "output's gradient with respect to the experts' output depends on the input or "
            "on parameters), which the slots cannot split"
        )
    if split.experts.kind is ExpertsKind.PRESCALED:
        # A sum over every expert's rows, not one row per token: the self-check covers it.
        return replace(split, block_adds=adds)
    g = torch.Generator().manual_seed(7)
    r = torch.randn(x.shape, generator=g, dtype=x.dtype).to(x.device)
    with torch.no_grad():
        outs = [run(torch.zeros_like(r), u.detach()), run(r, u.detach())]
    diff = (outs[1] - outs[0]).reshape(-1).double()
    ref = r.reshape(-1).double()
    c = float((diff * ref).sum() / (ref * ref).sum())
    if float((diff - c * ref).abs().max()) > 1e-5 * float(ref.abs().max()) * max(1.0, abs(c)):
        raise ConfigError(
            f"{where}: the MoE block transforms its routed experts' output other than by a "
            "constant factor (a norm or gate after the experts), which the slots cannot split"
        )
    return replace(split, experts_scale=None if abs(c - 1.0) < 1e-6 else c, block_adds=adds)


def _adds_with_random_weights(
    block: nn.Module, experts: nn.Module, run: Callable[[nn.Module], Tensor]
) -> bool:
    """Whether the block adds anything to its experts' output when its other parameters
    are random: a copy of the block (its experts shared, not copied) with every parameter
    outside ``experts`` drawn from a generator of its own runs with the experts' output
    zero. A part whose weights happen to be zero (zero-initialised, upcycled) then shows,
    on every torch release, whatever the autograd graph tells (the graph check above
    misses it on torch 2.11)."""
    probe = copy.deepcopy(block, memo={id(experts): experts})
    g = torch.Generator().manual_seed(11)
    shared = {id(p) for p in experts.parameters()}
    with torch.no_grad():
        for p in probe.parameters():
            if id(p) not in shared and p.is_floating_point():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p))
        out = run(probe)
    return bool(out.abs().max() > 0)


@contextlib.contextmanager
def block_norm_identity(block: nn.Module, split: MoESplit) -> Generator[None, None, None]:
    """The block's output norm (if the split has one) is the identity inside the block."""
    if split.block_out_norm is None:
        yield
        return
    with swap_child(block, split.block_out_norm, nn.Identity()):
        yield
