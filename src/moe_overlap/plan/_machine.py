"""What a machine does with a node: roofline compute times and alpha-beta link times.

A compute node takes ``max(flops / (peak * mfu), bytes / hbm)``; a message over a link
``alpha + bytes / beta``. The presets take public datasheet figures (SXM parts, dense bf16,
no sparsity); achieved rates are lower, which ``mfu`` and measured links (a
:class:`Link` of your own) account for.
"""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from moe_overlap.args import (
    BOOL,
    NON_NEGATIVE,
    POSITIVE,
    Instance,
    Int,
    Items,
    OneOf,
    Opt,
    Real,
    Spec,
    check_arg,
    check_fields,
    refuse,
)
from moe_overlap.engine import Direction, Slot, SlotKey

from ._model import LayerKind, ModelSpec
from ._presets import MACHINE_PRESETS

__all__ = ["MACHINES", "Link", "Machine", "a2a_ms", "p2p_ms", "roofline_durations"]

_NAME: Spec[str] = Instance(str, "a string")
_BYTES = Real(min=0)


@dataclass(frozen=True, kw_only=True)
class Link:
    """A link as one GPU sees it: ``alpha_us`` microseconds of latency per message and
    ``beta_GBps`` gigabytes (1e9 bytes) per second of bandwidth, one direction."""

    name: str
    alpha_us: float
    beta_GBps: float

    def __post_init__(self) -> None:
        check_fields(self, _LINK_FIELDS)

    def time_ms(self, nbytes: float, messages: int = 1) -> float:
        """Milliseconds to send ``nbytes`` in ``messages`` messages:
        ``messages * alpha + nbytes / beta``."""
        where = f"Link({self.name!r}).time_ms"
        nbytes = check_arg(where, "nbytes", nbytes, _BYTES)
        messages = check_arg(where, "messages", messages, NON_NEGATIVE)
        return messages * self.alpha_us * 1e-3 + nbytes / (self.beta_GBps * 1e6)


_LINK_FIELDS: dict[str, Spec[object]] = {
    "name": _NAME,
    "alpha_us": Real(min=0),
    "beta_GBps": Real(above=0),
}


@dataclass(frozen=True, kw_only=True)
class Machine:
    """A GPU model and how its GPUs are wired.

    ``peak_tflops``: dense bf16 tensor-core peak; ``mfu``: the fraction of it a GEMM
    reaches; ``hbm_GBps`` and ``hbm_GB``: memory bandwidth (1e9 bytes a second) and
    capacity (1e9 bytes); ``gpus_per_node`` GPUs share a node, joined by ``nvlink``; nodes
    are joined by ``network`` (per GPU: one NIC each).
    """

    name: str
    peak_tflops: float
    mfu: float = 0.6
    hbm_GBps: float
    hbm_GB: float
    gpus_per_node: int = 8
    nvlink: Link
    network: Link

    def __post_init__(self) -> None:
        check_fields(self, _MACHINE_FIELDS)
        if self.mfu > 1:
            raise refuse("Machine.mfu", "a fraction in (0, 1]", self.mfu, field=True)

    def compute_ms(self, flops: float, nbytes: float) -> float:
        """Roofline milliseconds of a kernel doing ``flops`` and moving ``nbytes`` of HBM:
        ``max(flops / (peak * mfu), nbytes / hbm)``."""
        where = "Machine.compute_ms"
        flops = check_arg(where, "flops", flops, _BYTES)
        nbytes = check_arg(where, "nbytes", nbytes, _BYTES)
        math_ms = flops / (self.peak_tflops * self.mfu * 1e9)
        memory_ms = nbytes / (self.hbm_GBps * 1e6)
        return max(math_ms, memory_ms)

    @classmethod
    def preset(cls, name: str) -> "Machine":
        """A machine of :data:`MACHINES`, from public datasheets.

        - ``h100``: H100 SXM, 989 dense bf16 TFLOPs, 3.35 TB/s HBM3, 80 GB;
        - ``h200``: H200 SXM, 989 TFLOPs, 4.8 TB/s HBM3e, 141 GB;
        - ``h800``: H800 SXM, H100's compute and memory with NVLink cut to 200 GB/s a
          direction.

        All three: 8 GPUs a node; NVLink 4 at 450 GB/s a direction (900 GB/s both ways),
        the H800's at 200 GB/s; one 400 Gb/s InfiniBand NIC per GPU (50 GB/s a direction);
        ``mfu`` 0.6. Latencies are assumptions, not datasheet figures: 3 us a message over
        NVLink, 8 us over the network. Links are taken at their datasheet bandwidth (NCCL
        reaches less): give measured :class:`Link` figures for closer estimates.
        """
        name = check_arg("Machine.preset", "name", name, OneOf(MACHINES, hint="or build a Machine"))
        fields = MACHINE_PRESETS[name]
        return Machine(
            name=name,
            peak_tflops=fields["peak_tflops"],
            hbm_GBps=fields["hbm_GBps"],
            hbm_GB=fields["hbm_GB"],
            nvlink=Link(**fields["nvlink"]),
            network=Link(**fields["network"]),
        )


_MACHINE_FIELDS: dict[str, Spec[object]] = {
    "name": _NAME,
    "peak_tflops": Real(above=0),
    "mfu": Real(above=0),
    "hbm_GBps": Real(above=0),
    "hbm_GB": Real(above=0),
    "gpus_per_node": POSITIVE,
    "nvlink": Instance(Link, "a Link"),
    "network": Instance(Link, "a Link"),
}

MACHINES: tuple[str, ...] = tuple(MACHINE_PRESETS)
"""The names :meth:`Machine.preset` knows."""


def _peer_classes(machine: Machine, ep: int, first_rank_in_node: int) -> set[tuple[int, int]]:
    """The distinct ``(peers in the node, peers outside)`` of the group's ranks."""
    per_node: dict[int, int] = {}
    for i in range(ep):
        node = (first_rank_in_node + i) // machine.gpus_per_node
        per_node[node] = per_node.get(node, 0) + 1
    return {(count - 1, ep - count) for count in per_node.values()}


def a2a_ms(machine: Machine, nbytes: float, *, ep: int, first_rank_in_node: int = 0) -> float:
    """Milliseconds of one all-to-all in which each rank of an ``ep``-wide group sends
    ``nbytes``, spread evenly over its ``ep - 1`` peers (and receives as much).

    The group sits on consecutive ranks, its first ``first_rank_in_node`` GPUs into a
    node (0: it starts a node). A rank's peers in its node are reached over NVLink, the
    others over the network; the two run at once, so a rank takes the longer of
    ``peers * alpha + bytes / beta`` of each class, and the all-to-all the slowest rank's
    time. 0 at ``ep=1``.
    """
    where = "a2a_ms"
    machine = check_arg(where, "machine", machine, Instance(Machine, "a Machine"))
    nbytes = check_arg(where, "nbytes", nbytes, _BYTES)
    ep = check_arg(where, "ep", ep, POSITIVE)
    first = check_arg(
        where,
        "first_rank_in_node",
        first_rank_in_node,
        Int(0, machine.gpus_per_node - 1, max_name="gpus_per_node-1"),
    )
    if ep == 1:
        return 0.0
    per_peer = nbytes / (ep - 1)
    worst = 0.0
    for inside, outside in _peer_classes(machine, ep, first):
        near = machine.nvlink.time_ms(per_peer * inside, inside) if inside else 0.0
        far = machine.network.time_ms(per_peer * outside, outside) if outside else 0.0
        worst = max(worst, near, far)
    return worst


def p2p_ms(machine: Machine, nbytes: float, *, same_node: bool) -> float:
    """Milliseconds of one point-to-point send of ``nbytes`` (one message): over NVLink
    within a node, over the network across nodes."""
    where = "p2p_ms"
    machine = check_arg(where, "machine", machine, Instance(Machine, "a Machine"))
    same_node = check_arg(where, "same_node", same_node, BOOL)
    link = machine.nvlink if same_node else machine.network
    return link.time_ms(check_arg(where, "nbytes", nbytes, _BYTES))


_COMPUTE_SLOTS: Mapping[LayerKind, tuple[Slot, ...]] = {
    "moe": (Slot.PRE_DISPATCH, Slot.MLP),
    "dense": (Slot.PRE_DISPATCH, Slot.MLP),
}
_F, _B, _W = Direction.FORWARD, Direction.BACKWARD, Direction.WGRAD


def roofline_durations(
    model: ModelSpec,
    machine: Machine,
    *,
    ep: int,
    layers: Iterable[int] | None = None,
) -> dict[SlotKey, float]:
    """Estimated milliseconds of each node of one microbatch on one rank, keyed as
    :meth:`moe_overlap.timeline.Timeline.slot_durations` keys them:
    ``(layer, slot, direction)``, ``layer`` the global index (``None`` for pre- and
    post-process).

    For each layer of ``layers`` (``None``: all): ``PRE_DISPATCH`` and ``MLP`` in ``F``,
    ``B`` and ``W`` (weight gradients apart from the input gradients: add ``W`` to ``B``
    for a runtime that does not delay them), each :meth:`Machine.compute_ms` of the
    model's :meth:`~ModelSpec.node_flops` and :meth:`~ModelSpec.node_bytes`; for MoE layers
    ``DISPATCH`` and ``COMBINE`` in ``F`` and ``B``, each one all-to-all (:func:`a2a_ms`) of
    :meth:`~ModelSpec.a2a_bytes` (dispatch forward and combine backward send tokens to
    the experts, combine forward and dispatch backward send them back; balanced routing
    makes both the same size). Always ``PRE_PROCESS`` ``F`` and ``B`` and
    ``POST_PROCESS`` ``F``, ``B`` and ``W``, whatever ``layers`` (a caller holding neither
    end of the model drops them). Raises :class:`~moe_overlap.ConfigError` when ``ep``
    does not divide the expert count.
    """
    where = "roofline_durations"
    model = check_arg(where, "model", model, Instance(ModelSpec, "a ModelSpec"))
    machine = check_arg(where, "machine", machine, Instance(Machine, "a Machine"))
    ep = check_arg(where, "ep", ep, POSITIVE)
    if model.num_experts % ep:
        raise refuse(
            f"{where}: ep",
            f"a divisor of the model's num_experts={model.num_experts} (each rank holds the "
            "same number of experts)",
            ep,
        )
    index = Int(0, model.num_layers - 1, max_name="num_layers-1")
    given = check_arg(
        where,
        "layers",
        layers,
        Opt(Items(index), expects=f"None or a collection of layer indices, each {index.expects}"),
    )
    chosen = tuple(range(model.num_layers)) if given is None else given
    cache: dict[tuple[LayerKind, Slot, Direction], float] = {}

    def compute(kind: LayerKind, slot: Slot, direction: Direction) -> float:
        key = (kind, slot, direction)
        if key not in cache:
            flops = model.node_flops(kind, slot, direction)
            nbytes = model.node_bytes(kind, slot, direction, ep=ep)
            cache[key] = machine.compute_ms(flops, nbytes)
        return cache[key]

    comm = a2a_ms(machine, model.a2a_bytes(ep), ep=ep)
    out: dict[SlotKey, float] = {}
    out[(None, Slot.PRE_PROCESS, _F)] = compute("pre", Slot.PRE_PROCESS, _F)
    out[(None, Slot.PRE_PROCESS, _B)] = compute("pre", Slot.PRE_PROCESS, _B)
    for layer in chosen:
        kind = model.layer_kind(layer)
        for slot in _COMPUTE_SLOTS[kind]:
            for direction in (_F, _B, _W):
                out[(layer, slot, direction)] = compute(kind, slot, direction)
        if kind == "moe":
            for slot in (Slot.DISPATCH, Slot.COMBINE):
                for direction in (_F, _B):
                    out[(layer, slot, direction)] = comm
    for direction in (_F, _B, _W):
        out[(None, Slot.POST_PROCESS, direction)] = compute("post", Slot.POST_PROCESS, direction)
    return out
