"""The plain path's stand-in for a slot's node (:class:`~moe_overlap.SlotContext`, defined
with the Protocols and re-exported here), and the slot helpers."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from torch import Tensor

from moe_overlap import ChunkState, IntegrationError, LayerState, SlotContext
from moe_overlap.args import Instance, check_arg, refuse
from moe_overlap.engine import check_marked

__all__ = [
    "DenseSlots",
    "MoESlots",
    "PlainContext",
    "SlotContext",
    "add_residual",
    "pair_input",
    "single_input",
]


_STATE = Instance(ChunkState, "a ChunkState", error=IntegrationError)
_Slot = Callable[["SlotContext", tuple[Tensor, ...]], object]
"""A slot as the plain path calls it (a :class:`PlainContext` for the node)."""


class PlainContext:
    """The slot context of the plain (unscheduled) path: ``detach`` keeps the graph whole."""

    def __init__(self, chunk_state: ChunkState) -> None:
        self.layer_state = LayerState()
        self.chunk_state = check_arg("PlainContext", "chunk_state", chunk_state, _STATE)

    def detach(self, t: Tensor) -> Tensor:
        return t

    def mark_non_differentiable(self, *tensors: Tensor) -> None:
        # Nothing else is checked on the plain path: the arguments, as the node checks them.
        check_marked(tensors, where="PlainContext")


def single_input(inputs: tuple[Tensor, ...], where: str) -> Tensor:
    """The one tensor a slot takes, or an :class:`~moe_overlap.IntegrationError` naming it."""
    if not isinstance(cast(object, inputs), tuple):
        raise refuse(
            f"{where}: inputs", "the slot's tuple of input tensors", inputs, error=IntegrationError
        )
    if len(inputs) != 1:
        raise IntegrationError(f"{where}: expected 1 input tensor, received {len(inputs)}")
    return inputs[0]


def pair_input(inputs: tuple[Tensor, ...], where: str) -> tuple[Tensor, Tensor]:
    """The ``(tokens, probs)`` a dispatch slot takes, or an :class:`~moe_overlap.IntegrationError`."""
    if not isinstance(cast(object, inputs), tuple):
        raise refuse(
            f"{where}: inputs", "the slot's tuple of input tensors", inputs, error=IntegrationError
        )
    if len(inputs) != 2:
        raise IntegrationError(
            f"{where}: expected 2 inputs (tokens, probs), received {len(inputs)}"
        )
    return inputs[0], inputs[1]


def add_residual(ctx: SlotContext, moe_TD: Tensor, where: str, *, shared: bool) -> Tensor:
    """Combine's last step: ``residual + (moe + shared_expert_output)``, as ``[B, S, D]``.

    Reads ``layer_state.residual`` (and ``shared_expert_output`` when ``shared``), which
    pre-dispatch kept through ``ctx.detach``, then drops both references. Raises
    :class:`~moe_overlap.IntegrationError` naming ``where`` when one is missing.
    """
    state = ctx.layer_state
    residual = state.residual
    if residual is None:
        raise IntegrationError(f"{where}: expected the residual from pre_dispatch, received None")
    if shared:
        shared_TD = state.shared_expert_output
        if shared_TD is None:
            raise IntegrationError(
                f"{where}: expected the shared expert output from pre_dispatch, received None"
            )
        moe_TD = moe_TD + shared_TD.view(moe_TD.shape)
    state.residual = None
    state.shared_expert_output = None
    return residual + moe_TD.view(residual.shape)


class DenseSlots:
    """Mixin for a dense (non-MoE) layer: dispatch and combine pass their inputs through.

    The layer defines ``slot_pre_dispatch`` and ``slot_mlp``; the schedule runs them in
    that order, the pre-dispatch output going to ``slot_mlp``, whose output is the layer's.
    :meth:`run_plain` runs the same two slots without a schedule (a :class:`PlainContext`),
    so the plain path (:meth:`~moe_overlap.blocks.MegatronHooks.plain_forward`) and the
    schedule compute the same operations.
    """

    is_moe = False
    num_local_experts: int | None = None

    def run_plain(self, x: Tensor, chunk_state: ChunkState, /) -> Tensor:
        """The layer without a schedule: ``slot_mlp(ctx, slot_pre_dispatch(ctx, (x,)))``.

        Raises :class:`~moe_overlap.IntegrationError` naming the layer when it lacks one of
        the two slots or ``slot_mlp`` returns other than one tensor.
        """
        name = type(self).__name__
        names = ("slot_pre_dispatch", "slot_mlp")
        slots: list[object] = [getattr(self, s, None) for s in names]
        missing = [s for s, fn in zip(names, slots, strict=True) if not callable(fn)]
        if missing:
            raise IntegrationError(
                f"{name}.run_plain: DenseSlots runs the layer's slot_pre_dispatch then its "
                f"slot_mlp without a schedule; expected both defined, received a layer "
                f"without {missing}"
            )
        pre, mlp = cast("list[_Slot]", slots)
        ctx = PlainContext(chunk_state)
        out = pre(ctx, (x,))
        inputs = cast("tuple[Tensor, ...]", out) if isinstance(out, tuple) else (out,)
        y = mlp(ctx, cast("tuple[Tensor, ...]", inputs))
        if isinstance(y, tuple) and len(cast("tuple[object, ...]", y)) == 1:
            y = cast("tuple[object, ...]", y)[0]
        if not isinstance(y, Tensor):
            got = (
                f"a tuple of {len(cast('tuple[object, ...]', y))}"
                if isinstance(y, tuple)
                else type(y).__name__
            )
            raise IntegrationError(
                f"{name}.run_plain: expected slot_mlp to return the layer's output (one "
                f"tensor), received {got}"
            )
        return y

    def slot_dispatch(self, node: SlotContext, inputs: tuple[Tensor, ...], /) -> tuple[Tensor, ...]:
        del node
        return inputs

    def slot_combine(self, node: SlotContext, inputs: tuple[Tensor, ...], /) -> tuple[Tensor, ...]:
        del node
        return inputs


class MoESlots:
    """Mixin for a MoE layer written once as four steps on a :class:`SlotContext`.

    Define :meth:`pre_dispatch`, :meth:`dispatch`, :meth:`mlp_forward`, :meth:`combine` and
    :meth:`where`; the mixin gives the four ``slot_*`` methods of
    :class:`~moe_overlap.SchedulableLayer` (checking their inputs) and :meth:`run_plain`,
    the same steps without a schedule (a :class:`PlainContext`).
    """

    is_moe = True

    def where(self, slot: str) -> str:
        """The layer and slot, as error messages name them."""
        return f"{type(self).__name__} {slot}"

    def pre_dispatch(self, ctx: SlotContext, x: Tensor, /) -> tuple[Tensor, Tensor]:
        """Everything before the all-to-all; returns ``(tokens, probs)``."""
        raise NotImplementedError

    def dispatch(self, ctx: SlotContext, tokens: Tensor, probs: Tensor, /) -> Tensor:
        """The all-to-all; returns the received rows."""
        raise NotImplementedError

    def mlp_forward(self, ctx: SlotContext, received: Tensor, /) -> Tensor:
        """The experts on the received rows."""
        raise NotImplementedError

    def combine(self, ctx: SlotContext, out: Tensor, /) -> Tensor:
        """The all-to-all back and what follows it; the layer's output."""
        raise NotImplementedError

    def run_plain(self, x: Tensor, chunk_state: ChunkState) -> Tensor:
        """The layer without a schedule (the same operations as the slots)."""
        ctx = PlainContext(chunk_state)
        received = self.dispatch(ctx, *self.pre_dispatch(ctx, x))
        return self.combine(ctx, self.mlp_forward(ctx, received))

    def slot_pre_dispatch(
        self, node: SlotContext, inputs: tuple[Tensor, ...], /
    ) -> tuple[Tensor, ...]:
        return self.pre_dispatch(node, single_input(inputs, self.where("pre_dispatch")))

    def slot_dispatch(self, node: SlotContext, inputs: tuple[Tensor, ...], /) -> Tensor:
        return self.dispatch(node, *pair_input(inputs, self.where("dispatch")))

    def slot_mlp(self, node: SlotContext, inputs: tuple[Tensor, ...], /) -> Tensor:
        return self.mlp_forward(node, single_input(inputs, self.where("mlp")))

    def slot_combine(self, node: SlotContext, inputs: tuple[Tensor, ...], /) -> Tensor:
        return self.combine(node, single_input(inputs, self.where("combine")))
