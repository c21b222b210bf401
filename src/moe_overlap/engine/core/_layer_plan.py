"""One layer of one microbatch, cut into slot nodes, and the overlapped run of two layers."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import cast

from torch import Tensor

from moe_overlap.errors import PlanReleasedError
from moe_overlap.protocols import (
    MtpSchedulableLayer,
    SchedulableLayer,
    SlotFn,
    StepObserver,
    StreamProvider,
    WgradLayer,
)

from ._backward_dw import BackwardDWWrapper
from ._executor import Value, execute_roles
from ._hooks import on_layer_started, on_mlp_wgrad_listed
from ._layer_args import LayerArgs
from ._layer_node import TransformerLayerNode
from ._node import NoopScheduleNode, ScheduleNode
from ._options import ScheduleOptions
from ._state import ChunkState, LayerState
from ._steps import LayerShape, Role, Slot, Step, layer_pair_steps
from ._streams import AnyEvent, StreamPair
from ._wgrad_claims import WgradClaim

__all__ = ["TransformerLayerSchedulePlan"]

_DEFAULT_OPTIONS = ScheduleOptions()
_MTP_SLOT = "slot_mtp_post_process"
"""The one member an MTP layer adds (:class:`~moe_overlap.protocols.MtpSchedulableLayer`)."""


class TransformerLayerSchedulePlan:
    """The slot nodes of one layer for one microbatch.

    Nodes: ``pre_dispatch`` and ``mlp`` on the compute stream; ``dispatch`` and ``combine``
    on the communication stream for MoE layers, no-ops for dense ones; ``mtp_post`` for
    MTP layers, a no-op otherwise. All share the microbatch's ``event`` and a fresh
    :class:`~moe_overlap.LayerState`. The slots ``options.recompute`` lists (pre-dispatch,
    mlp) drop their activations after forward and are recomputed before their backward.

    ``streams``: compute and communication streams; ``is_first_layer`` / ``is_last_layer``:
    the layer's place in its chunk (Megatron-Core's positional form with an ``extra_args``
    dict: :func:`moe_overlap.megatron.layer_schedule_plan`).

    The layer is checked member by member here (``owner``, the model's class name, names
    it in errors as ``owner.decoder.layers[index]``). It delays
    its weight gradients exactly when ``pre_dispatch_wgrad()`` or ``mlp_wgrad()`` lists a
    module; ``options.delay_wgrad_compute``, when not ``None``, must agree
    (:class:`~moe_overlap.ConfigError` otherwise). From construction to
    :meth:`release_state` the plan claims the listed modules (:mod:`moe_overlap.wgrad`):
    their backward queues the weight gradients its wgrad steps compute.
    """

    def __init__(
        self,
        layer: SchedulableLayer,
        *,
        event: AnyEvent,
        chunk_state: ChunkState,
        streams: StreamPair,
        options: ScheduleOptions = _DEFAULT_OPTIONS,
        index: int = 0,
        is_first_layer: bool = False,
        is_last_layer: bool = False,
        owner: str | None = None,
        microbatch_index: int | None = None,
    ) -> None:
        def where() -> str:  # formatted only for an error message
            if owner is None:
                return f"TransformerLayerSchedulePlan(layer {index})"
            return f"{owner}.decoder.layers[{index}]"

        for guard in on_layer_started:  # the layer's members (moe_overlap.engine._guards)
            guard.layer_started(layer, where)
        comp_stream, comm_stream = streams.comp_provider, streams.comm_provider
        mtp = cast(MtpSchedulableLayer, layer) if hasattr(layer, _MTP_SLOT) else None
        is_mtp = mtp is not None
        # The layer is the one source of truth for delayed wgrad: it delays exactly the
        # modules it lists. ScheduleOptions.delay_wgrad_compute, when given, must agree
        # (the guards check it).
        pre_dw = BackwardDWWrapper(layer)
        listed = layer.mlp_wgrad()
        option = options.delay_wgrad_compute
        for guard in on_mlp_wgrad_listed:  # and the option agrees (moe_overlap.engine._guards)
            guard.mlp_wgrad_listed(layer, listed, pre_dw.parts, option, where)
        mlp_dw: list[WgradLayer] = list(listed)
        delay = bool(pre_dw.parts) or bool(mlp_dw)
        args = LayerArgs(
            config=layer.config,
            is_moe=layer.is_moe,
            num_local_experts=layer.num_local_experts,
            delay_wgrad_compute=delay,
            is_mtp=is_mtp,
            is_first_layer=is_first_layer,
            is_last_layer=is_last_layer,
        )
        self.index = index
        self.microbatch_index = microbatch_index
        """The microbatch number shown in errors and timelines (the chunk plan's)."""
        self.layer: SchedulableLayer | None = layer
        self.wgrad_parts: tuple[WgradLayer, ...] = (
            (*(part.module for part in pre_dw.parts), *mlp_dw) if delay else ()
        )
        """The modules the layer lists for delayed wgrad (pre-dispatch's, then mlp's)."""
        self.event = event
        self.chunk_state = chunk_state
        self.layer_state = LayerState()
        recompute = cast("tuple[Slot, ...]", options.recompute)  # ScheduleOptions made Slots
        self.shape = LayerShape(
            index=index,
            is_moe=layer.is_moe,
            delay_wgrad=delay,
            has_mtp_post=is_mtp,
            early_attn_release=options.ep_overlap_early_attn_memory_release,
            order=options.order,
            recompute=recompute,
        )

        def node(
            slot: Slot,
            stream: StreamProvider,
            fn: SlotFn,
            dw: Sequence[WgradLayer] | None = None,
        ) -> TransformerLayerNode:
            made = TransformerLayerNode(
                stream,
                event,
                self.layer_state,
                chunk_state,
                fn,
                name=slot.node_name,
                bwd_dw_callables=dw,
                extra_args=args,
                recompute=slot in recompute,
            )
            if not options.free_input:
                made.free_input = False
            return made

        self.nodes: dict[Slot, ScheduleNode] = {
            Slot.PRE_DISPATCH: node(
                Slot.PRE_DISPATCH,
                comp_stream,
                layer.slot_pre_dispatch,
                [pre_dw] if delay else None,
            ),
            Slot.MLP: node(Slot.MLP, comp_stream, layer.slot_mlp, mlp_dw),
        }
        if layer.is_moe:
            self.nodes[Slot.DISPATCH] = node(Slot.DISPATCH, comm_stream, layer.slot_dispatch)
            self.nodes[Slot.COMBINE] = node(Slot.COMBINE, comm_stream, layer.slot_combine)
        else:
            self.nodes[Slot.DISPATCH] = NoopScheduleNode("moe_dispatch")
            self.nodes[Slot.COMBINE] = NoopScheduleNode("moe_combine")
        if mtp is not None:
            self.nodes[Slot.MTP_POST] = node(Slot.MTP_POST, comp_stream, mtp.slot_mtp_post_process)
        else:
            self.nodes[Slot.MTP_POST] = NoopScheduleNode("mtp_post_process")
        # Last, after every check: the listed modules queue their weight gradients for this
        # plan's wgrad steps from here until release (or until the plan is collected).
        self._unclaim: Callable[[], object] | None = None
        if delay:
            claim = WgradClaim(self.wgrad_parts)
            self._unclaim = weakref.finalize(self, claim.release)

    def node_for(self, step: Step) -> ScheduleNode:
        """The node that runs ``step`` (its slot)."""
        if self.layer is None:
            raise PlanReleasedError(
                f"layer {self.index} plan: used after release_state (step {step}); "
                "build a new plan for every microbatch"
            )
        # A node step always names its slot: no check per node.
        return self.nodes[step.slot]  # type: ignore[index]  # pyright: ignore[reportArgumentType]

    def set_fsdp_reshard_hooks(
        self,
        post_forward: Callable[[SchedulableLayer], None],
        post_backward: Callable[[SchedulableLayer], None],
    ) -> None:
        """Call ``post_forward(layer)`` after the layer's last forward slot and
        ``post_backward(layer)`` after its first backward slot (after its wgrad when
        delayed): FSDP-style reshard points."""
        layer = self.layer
        if layer is None:
            raise PlanReleasedError(f"layer {self.index} plan: hooks set after release_state")
        first = self.nodes[Slot.PRE_DISPATCH]
        last = self.nodes[Slot.COMBINE if layer.is_moe else Slot.MLP]
        assert isinstance(first, TransformerLayerNode)
        assert isinstance(last, TransformerLayerNode)
        first.set_post_backward_hook(lambda: post_backward(layer))
        last.set_post_forward_hook(lambda: post_forward(layer))

    def release_state(self) -> None:
        """Drop the nodes and the layer state; the plan cannot run again."""
        for n in self.nodes.values():
            n.release_state()
        self.nodes = {}
        self.layer_state.clear()
        self.layer = None
        if self._unclaim is not None:
            self._unclaim()
            self._unclaim = None

    @staticmethod
    def run(
        f_layer: TransformerLayerSchedulePlan | None,
        b_layer: TransformerLayerSchedulePlan | None,
        f_input: tuple[Tensor, ...] = (),
        b_grad: tuple[Tensor | None, ...] = (),
        is_last_layer_in_bwd: bool = False,
        *,
        observer: StepObserver | None = None,
    ) -> tuple[tuple[Tensor, ...], tuple[Tensor | None, ...]]:
        """Forward ``f_layer`` and backward ``b_layer`` interleaved; either may be ``None``.

        Order (see :func:`~moe_overlap.steps.layer_pair_steps`)::

            b.combine.B | f.pre_dispatch.F | b.mlp.B | f.dispatch.F | b.mlp.W, b.dispatch.B |
            f.mlp.F | f.combine.F | b.pre_dispatch.B | f.mtp_post.F | b.pre_dispatch.W

        Returns the forward output and the grads of ``b_layer``'s input. ``observer`` (a
        :class:`~moe_overlap.steps.StepObserver`) is asked for a timer for every step, in order.
        """
        steps = layer_pair_steps(
            f_layer.shape if f_layer is not None else None,
            b_layer.shape if b_layer is not None else None,
            is_last_layer_in_bwd=is_last_layer_in_bwd,
        )
        values: dict[Role | int | None, Value] = {Role.F: f_input, Role.B: b_grad}
        execute_roles(steps, {Role.F: f_layer, Role.B: b_layer}, values, observer=observer)
        return cast("tuple[Tensor, ...]", values[Role.F]), values[Role.B]
