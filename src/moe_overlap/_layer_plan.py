"""One layer of one microbatch, cut into slot nodes, and the overlapped run of two layers."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from torch import Tensor

from ._conformance import as_mtp_layer, check_layer
from ._errors import PlanReleasedError
from ._executor import execute
from ._layer_node import LayerArgs, TransformerLayerNode
from ._node import NoopScheduleNode, ScheduleNode
from ._options import ScheduleOptions
from ._protocols import SchedulableLayer, SlotFn, StepObserver, StreamProvider, WgradLayer
from ._state import ChunkState, LayerState
from ._steps import LayerShape, Slot, Step, layer_pair_steps
from ._streams import AnyEvent
from ._wgrad import BackwardDWWrapper

__all__ = ["TransformerLayerSchedulePlan"]

_DEFAULT_OPTIONS = ScheduleOptions()


class TransformerLayerSchedulePlan:
    """The slot nodes of one layer for one microbatch.

    Nodes: ``pre_dispatch`` and ``mlp`` on the compute stream; ``dispatch`` and ``combine``
    on the communication stream for MoE layers, no-ops for dense ones; ``mtp_post`` for
    MTP layers, a no-op otherwise. All share the microbatch's ``event`` and a fresh
    :class:`~moe_overlap.LayerState`.
    """

    def __init__(
        self,
        layer: SchedulableLayer,
        event: AnyEvent,
        chunk_state: ChunkState,
        comp_stream: StreamProvider,
        comm_stream: StreamProvider,
        extra_args: LayerArgs | Mapping[str, object] | None = None,
        *,
        options: ScheduleOptions = _DEFAULT_OPTIONS,
        index: int = 0,
    ) -> None:
        layer = check_layer(layer, f"TransformerLayerSchedulePlan(layer {index})")
        # A Megatron-style mapping is validated as LayerArgs; only its layer position is
        # used, the rest comes from the layer itself (as Megatron-Core overwrites it).
        given = (
            LayerArgs.from_mapping({"config": layer.config, **extra_args})
            if extra_args is not None and not isinstance(extra_args, LayerArgs)
            else extra_args
        )
        first = given is not None and given.is_first_layer
        last = given is not None and given.is_last_layer
        mtp = as_mtp_layer(layer)
        is_mtp = mtp is not None
        args = LayerArgs(
            config=layer.config,
            is_moe=layer.is_moe,
            num_local_experts=layer.num_local_experts,
            delay_wgrad_compute=options.delay_wgrad_compute,
            is_mtp=is_mtp,
            is_first_layer=first,
            is_last_layer=last,
        )
        self.index = index
        self.layer: SchedulableLayer | None = layer
        self.event = event
        self.chunk_state = chunk_state
        self.layer_state = LayerState()
        self.shape = LayerShape(
            index=index,
            is_moe=layer.is_moe,
            delay_wgrad=options.delay_wgrad_compute,
            has_mtp_post=is_mtp,
            early_attn_release=options.ep_overlap_early_attn_memory_release,
        )
        delay = options.delay_wgrad_compute

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
            )
            if not options.free_input:
                made.free_input = False
            return made

        self.nodes: dict[Slot, ScheduleNode] = {
            Slot.PRE_DISPATCH: node(
                Slot.PRE_DISPATCH,
                comp_stream,
                layer.slot_pre_dispatch,
                [BackwardDWWrapper(layer)] if delay else None,
            ),
            Slot.MLP: node(Slot.MLP, comp_stream, layer.slot_mlp, list(layer.mlp_wgrad())),
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
        self.microbatch: int | None = None

    def node_for(self, step: Step) -> ScheduleNode:
        """The node that runs ``step`` (its slot)."""
        if self.layer is None:
            raise PlanReleasedError(
                f"layer {self.index} plan: used after release_state (step {step}); "
                "build a new plan for every microbatch"
            )
        return self.nodes[step.slot]

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

        Order (see :func:`~moe_overlap.layer_pair_steps`)::

            b.combine.B | f.pre_dispatch.F | b.mlp.B | f.dispatch.F | b.mlp.W, b.dispatch.B |
            f.mlp.F | f.combine.F | b.pre_dispatch.B | f.mtp_post.F | b.pre_dispatch.W

        Returns the forward output and the grads of ``b_layer``'s input. ``observer`` (a
        :class:`~moe_overlap.StepObserver`) is asked for a timer for every step, in order.
        """
        steps = layer_pair_steps(
            f_layer.shape if f_layer is not None else None,
            b_layer.shape if b_layer is not None else None,
            is_last_layer_in_bwd=is_last_layer_in_bwd,
        )
        return execute(steps, f_layer, b_layer, f_input, b_grad, observer=observer)
