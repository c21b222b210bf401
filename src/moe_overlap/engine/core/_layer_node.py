"""Layer-slot nodes: :class:`~moe_overlap.TransformerLayerNode` and its arguments."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
from torch import Tensor

from moe_overlap.errors import IntegrationError, NodeStateError, WgradError
from moe_overlap.protocols import FreeInputConfig, SlotFn, StreamProvider, WgradLayer

from ._free_input import should_free_input
from ._hooks import (
    on_arguments,
    on_backward_failed,
    on_copies_backwarded,
    on_node_detached,
    on_node_entered,
    on_node_left,
    on_slot_returned,
)
from ._layer_args import LayerArgs
from ._node import _OWN_FORWARD, NodePhase, ScheduleNode, _as_tuple, default_backward  # pyright: ignore[reportPrivateUsage]
from ._options import Hook
from ._slot_recompute import ForwardState, check_same, restore, snapshot
from ._state import ChunkState, LayerState
from ._streams import (
    AnyEvent,
    abandon_stream,
    enter_stream,
    leave_stream_unrecorded,
    record_tensor_on,
    stream_context,
)
from ._torch_private import set_grad_enabled as _set_grad_enabled

__all__ = ["TransformerLayerNode", "refresh_collectives"]


class TransformerLayerNode(ScheduleNode):
    """Schedule node for one slot of a fine-grained layer.

    ``extra_args`` is a :class:`~moe_overlap.LayerArgs`, or Megatron-Core's dict with the
    same keys (checked by the guards as :func:`moe_overlap.megatron.layer_args` checks it).

    Owns the slot's stream and event, its free-input policy (``_resolve_free_input``)
    and its delayed weight-gradient work (:meth:`~moe_overlap.TransformerLayerNode.backward_dw`). The slot function receives
    this node, so it can read ``layer_state`` / ``chunk_state`` and cut the graph
    with :meth:`~moe_overlap.TransformerLayerNode.detach` for tensors handed to later slots of the same layer.

    With ``recompute`` (``ScheduleOptions.recompute`` lists the slot) the node keeps its
    inputs (never freed) and drops its autograd graph after forward, handing on detached
    copies of its outputs, and :meth:`recompute` runs the slot again before its backward
    (see :meth:`forward`).
    """

    # Class-level defaults (see ScheduleNode): set per node only when they change.
    detached: tuple[Tensor, ...] = ()
    before_detached: tuple[Tensor, ...] = ()
    is_layer_first_node: bool = False
    is_layer_last_node: bool = False
    _post_forward_hook: Hook | None = None
    _post_backward_hook: Hook | None = None
    post_wgrad_grad_acc_hooks: list[Callable[[], object]] | None = None
    recomputes: bool = False
    """Whether the schedule recomputes this slot (``ScheduleOptions.recompute``)."""
    recomputed: bool = False
    """Whether the slot ran again since its forward (:meth:`recompute`)."""
    _forward_state: ForwardState | None = None
    _replaying: bool = False

    def __init__(
        self,
        stream: StreamProvider,
        event: AnyEvent,
        layer_state: LayerState,
        chunk_state: ChunkState,
        submodule: SlotFn,
        name: str = "default",
        bwd_dw_callables: WgradLayer | Sequence[WgradLayer] | None = None,
        extra_args: LayerArgs | Mapping[str, object] | None = None,
        *,
        recompute: bool = False,
    ) -> None:
        if isinstance(extra_args, LayerArgs):
            args = extra_args
        else:  # Megatron-Core's dict: its keys checked by the guards (layer_args)
            for guard in on_arguments:
                guard.arguments("TransformerLayerNode", extra_args)
            args = LayerArgs(**cast("Mapping[str, Any]", extra_args))
        self.args = args
        # A recomputed slot reruns on its inputs: it never frees them.
        free_input = not recompute and self._resolve_free_input(
            name, args.is_moe, args.config, args.num_local_experts
        )
        if recompute:
            self.recomputes = True
        # forward_func is this class's method: the node holds no reference to itself.
        super().__init__(_OWN_FORWARD, stream, event, free_input=free_input, name=name)
        self.layer_state = layer_state
        self.kept_as_is = layer_state.kept_as_is  # the layer's list, shared by its slots
        # Where collectives may run, the all-to-all's pending work may hold what dispatch
        # and combine send and what mlp receives: those reference counts say nothing then
        # (reading them would only send the release check down its slow path).
        if _COLLECTIVES[0]:
            if name in _SENDS_INPUTS:
                self.count_copy_refs = False
            elif name in _RECEIVES_INPUTS:
                self.count_input_refs = False
        self.chunk_state = chunk_state
        self.submodule = submodule
        self.delay_wgrad_compute = args.delay_wgrad_compute
        self.is_mtp = args.is_mtp
        self.is_first_layer = args.is_first_layer
        self.is_last_layer = args.is_last_layer
        # Sequences first: a runtime Protocol isinstance costs microseconds per node.
        if bwd_dw_callables is None:
            callables: list[WgradLayer] = []
        elif isinstance(bwd_dw_callables, (list, tuple)):
            callables = list(bwd_dw_callables)
        elif isinstance(bwd_dw_callables, WgradLayer):
            callables = [bwd_dw_callables]
        else:
            callables = list(bwd_dw_callables)
        self.bwd_dw_callables: list[WgradLayer] | None = callables

    @staticmethod
    def _resolve_free_input(
        name: str, is_moe: bool, config: FreeInputConfig, num_local_experts: int | None
    ) -> bool:
        """The free-input policy; override in a subclass to specialise it."""
        return should_free_input(name, is_moe, config, num_local_experts)

    def detach(self, t: Tensor) -> Tensor:
        """Detach ``t`` for a later slot, remembering both so backward flows through them.

        While the slot is recomputed, returns the copy the forward made at the same call
        (an :class:`~moe_overlap.IntegrationError` unless ``t`` matches it in shape, dtype,
        device and ``requires_grad``) and remembers ``t`` as the tensor behind it.
        """
        if self._replaying:
            return self._detach_again(t)
        d = t.detach()
        d.requires_grad_(t.requires_grad)
        self.before_detached = (*self.before_detached, t)
        self.detached = (*self.detached, d)
        for guard in on_node_detached:
            guard.node_detached(self, d)
        return d

    def _detach_again(self, t: Tensor) -> Tensor:
        i = len(self.before_detached)
        copies = self.detached
        if i >= len(copies):
            raise IntegrationError(
                f"node {self.name!r}: recompute: the slot called node.detach {i + 1} times, "
                f"its forward {len(copies)}; expected a recomputed slot to hand on the same "
                "tensors the second time (leave it out of ScheduleOptions.recompute otherwise)"
            )
        d = copies[i]
        check_same(self.name, f"node.detach call {i}", t, d)
        self.before_detached = (*self.before_detached, t)
        return d

    def handed_on(self) -> list[tuple[str, Tensor | None]]:
        """What this slot keeps for later slots, named: its ``node.detach`` copies and every
        tensor in the layer state (kept there by this or an earlier slot)."""
        state = self.layer_state
        kept = super().handed_on()
        kept += [("a tensor kept as it is", t) for t in state.kept_as_is]
        kept += [
            ("layer_state.residual", state.residual),
            ("layer_state.probs", state.probs),
            ("layer_state.dispatched_probs", state.dispatched_probs),
            ("layer_state.shared_expert_output", state.shared_expert_output),
            ("layer_state.tokens_per_expert", state.tokens_per_expert),
        ]
        kept += [
            (f"layer_state.stash({k!r})", v)
            for k, v in state.extras.items()
            if isinstance(v, Tensor)
        ]
        return kept

    def graph_tails(self) -> tuple[Tensor, ...]:
        """The pre-detach tensors: backward also runs from them."""
        return self.before_detached

    def forward_func(self, *args: Tensor | None) -> Tensor | tuple[Tensor, ...]:
        """The node's forward work (:meth:`forward_impl`), as :class:`ScheduleNode` calls it
        (a recomputed slot saves the random and autocast state first)."""
        if self.recomputes:
            self._forward_state = ForwardState(args)
        return self.forward_impl(*args)

    def forward_impl(self, *args: Tensor | None) -> Tensor | tuple[Tensor, ...]:
        """Call the slot function with this node and the (detached) inputs."""
        for a in args:
            if a is None:
                i = next(i for i, a in enumerate(args) if a is None)
                raise IntegrationError(
                    f"layer node {self.name!r}: input {i} is None; slots take Tensors"
                )
        inputs: tuple[Tensor, ...] = args  # type: ignore[assignment]  # pyright: ignore[reportAssignmentType]  # None refused above
        out = self.submodule(self, inputs)
        fresh = self.layer_state.fresh
        try:
            for guard in on_slot_returned:  # what the slot hands on (moe_overlap.engine._guards)
                guard.slot_returned(self, inputs, out)
        finally:
            if fresh:
                fresh.clear()
        return out

    def backward_impl(
        self, outputs: tuple[Tensor, ...], output_grad: tuple[Tensor | None, ...]
    ) -> None:
        """Backpropagate from the outputs and from every tensor this node detached.

        The copies' gradients (from later slots) go back through the tensors they were
        detached from; the copies' ``.grad`` is cleared first, so a gradient the slot's own
        backward gives a copy (the slot used it itself) is found and refused after.
        """
        if self.recomputes and not self.recomputed:  # no R step: recompute here, timed as B
            self._run_again()
            outputs = self.outputs
        copies = self.detached
        if not copies:
            default_backward(outputs, output_grad)
            return
        detached_grad: list[Tensor | None] = []
        for d in copies:
            detached_grad.append(d.grad)
            d.grad = None
        default_backward(outputs + self.before_detached, output_grad + tuple(detached_grad))
        # The copies' grads were made by later slots, maybe on the other stream, in that
        # stream's memory: keep it from reuse until this node's kernels have read them
        # (ScheduleNode.backward does the same for output_grad).
        stream = self.stream()
        for grad in detached_grad:
            if grad is not None:
                record_tensor_on(grad, stream)
        for guard in on_copies_backwarded:
            guard.copies_backwarded(self, copies)

    def forward(self, *inputs: Tensor | None) -> tuple[Tensor, ...]:
        """Run forward; on the layer's last forward slot, fire the post-forward hook.

        A recomputed slot runs exactly as any (autograd recording), then drops its graph:
        it keeps its detached inputs (for the recompute) and its ``node.detach`` copies (later
        slots hold them), and hands on detached copies of its outputs, each requiring grad
        as the output did; ``outputs`` holds those copies until :meth:`recompute`.
        """
        out = super().forward(*inputs)
        if self.recomputes:
            handed: list[Tensor] = []
            for o in out:
                c = o.detach()
                c.requires_grad_(o.requires_grad)
                handed.append(c)
            out = tuple(handed)
            self.outputs = out
            self.before_detached = ()  # the graph behind the copies goes
        if self.is_layer_last_node and self._post_forward_hook is not None:
            self._post_forward_hook()
        return out

    def recompute(self) -> None:
        """Run a recomputed slot again, with autograd, before its backward (an ``R`` step).

        Once, after forward and before backward (:class:`~moe_overlap.NodeStateError`
        otherwise; a node whose slot is not recomputed refuses every call). Runs on the
        node's stream after the microbatch's event, as backward does, but records no event
        (the slot's own backward, later on that stream, is its only reader); on the random
        and autocast state of the forward (the caller's random state is put back after), on
        the kept inputs; what the slot writes into the layer state is undone. The recomputed
        outputs replace the handed-on copies in ``outputs``, for backward. A backward that
        finds the slot not yet recomputed recomputes it first.
        """
        if not self.recomputes:
            super().recompute()
        if self.phase is not NodePhase.FORWARDED or self.recomputed:
            now = self.phase.value if self.phase is not NodePhase.FORWARDED else "recomputed"
            raise NodeStateError(
                f"node {self.name!r}: a recompute step (R) expected a forwarded node not yet "
                f"recomputed (R runs once, after forward and before backward), but it is {now}"
            )
        stream = self.stream()
        for guard in on_node_entered:
            guard.node_entered(self, "recompute")
        event = self.event
        try:
            switch = enter_stream(stream, event)
            try:
                timer = self.timer
                if timer is not None:
                    timer.start(stream)
                self._run_again()
                if timer is not None:
                    timer.stop(stream)
            except BaseException as exc:
                abandon_stream(switch, exc)
                raise
            # Waited for the microbatch's event, not recorded: only the slot's own
            # backward, later on this stream, reads what the recompute made, so the
            # microbatch's next steps on the other stream (its combine backward) need not
            # wait for it.
            leave_stream_unrecorded(switch)
        finally:
            for guard in on_node_left:
                guard.node_left(self)

    def _run_again(self) -> None:
        """The recompute's body: the slot on its kept inputs, its outputs checked against
        the copies it handed on."""
        forward_state = self._forward_state
        assert forward_state is not None, "a recomputed node saves its state in forward"
        handed = self.outputs
        inputs = self.inputs
        forward_state.check_inputs(self.name, inputs)
        state = self.layer_state
        saved = snapshot(state)
        self.before_detached = ()
        self.non_differentiable = ()  # the slot marks its tensors again
        self._replaying = True
        try:
            with forward_state.replaying():
                result = self.forward_impl(*inputs)
        finally:
            self._replaying = False
            restore(state, saved)
        outputs = (result,) if isinstance(result, Tensor) else _as_tuple(self.name, result)
        copies = self.detached
        if len(self.before_detached) != len(copies) or len(outputs) != len(handed):
            raise IntegrationError(
                f"node {self.name!r}: recompute: the slot called node.detach "
                f"{len(self.before_detached)} times and returned {len(outputs)} tensors, its "
                f"forward {len(copies)} and {len(handed)}; expected a recomputed slot to hand "
                "on the same tensors the second time (leave it out of "
                "ScheduleOptions.recompute otherwise)"
            )
        for i, (o, c) in enumerate(zip(outputs, handed, strict=True)):
            check_same(self.name, f"output {i}", o, c)
        self.outputs = outputs
        self._forward_state = None
        self.recomputed = True

    def backward(self, *output_grad: Tensor | None) -> tuple[Tensor | None, ...]:
        """Run backward; on the layer's first slot, fire the post-backward hook.

        With delayed wgrad the hook fires at the end of :meth:`~moe_overlap.TransformerLayerNode.backward_dw` instead, when
        the weight gradients exist. torch's "backward through the graph a second time"
        (a tensor handed between slots without :meth:`detach`) is raised as an
        :class:`~moe_overlap.IntegrationError` naming this node (by the guards).
        """
        try:
            grads = super().backward(*output_grad)
        except RuntimeError as e:
            for guard in on_backward_failed:  # torch's error reworded (moe_overlap.engine._guards)
                guard.backward_failed(self, e)
            raise
        if (
            not self.delay_wgrad_compute
            and self.is_layer_first_node
            and self._post_backward_hook is not None
        ):
            self._post_backward_hook()
        return grads

    def backward_dw(self) -> None:
        """Run the slot's delayed weight-gradient work on the slot's stream, then the hooks.

        A no-op unless wgrad is delayed. Runs under ``torch.no_grad()``, so the weight
        gradients carry no autograd graph. Runs once: a second call raises
        :class:`~moe_overlap.WgradError`.
        """
        if not self.delay_wgrad_compute:
            return
        callables = self.bwd_dw_callables
        if callables is None:
            raise WgradError(f"layer node {self.name!r}: backward_dw called twice")
        stream = self.stream()
        # No graph: weight-gradient work never needs one, and recording it would keep
        # autograd graphs alive through the parameters' .grad. The raw switch, not
        # torch.no_grad(): this runs per node and the context manager costs ~1 us.
        grad_was = torch.is_grad_enabled()
        _set_grad_enabled(False)
        try:
            with stream_context(stream):
                timer = self.timer
                if timer is not None:
                    timer.start(stream)
                for module in callables:
                    module.backward_dw()
                if timer is not None:
                    timer.stop(stream)
                if self.post_wgrad_grad_acc_hooks is None:
                    self.post_wgrad_grad_acc_hooks = _collect_wgrad_hooks(callables)
                for hook in self.post_wgrad_grad_acc_hooks:
                    hook()
        finally:
            _set_grad_enabled(grad_was)
        self.bwd_dw_callables = None
        if self.is_layer_first_node and self._post_backward_hook is not None:
            self._post_backward_hook()

    def set_post_forward_hook(self, hook: Hook) -> None:
        """Mark this slot as the layer's last forward node and register ``hook``."""
        self.is_layer_last_node = True
        self._post_forward_hook = hook

    def set_post_backward_hook(self, hook: Hook) -> None:
        """Mark this slot as the layer's first backward node and register ``hook``."""
        self.is_layer_first_node = True
        self._post_backward_hook = hook

    def release_state(self) -> None:
        """Drop inputs, outputs and detached tensors."""
        ScheduleNode.release_state(self)
        self.detached = ()
        self.before_detached = ()
        if self.recomputes:
            self._forward_state = None


_SENDS_INPUTS = frozenset({"moe_dispatch", "moe_combine"})
"""Layer slots whose inputs go to the all-to-all (Megatron-Core's node names)."""
_RECEIVES_INPUTS = frozenset({"mlp"})
"""Layer slots whose inputs are the dispatch all-to-all's receive buffer."""


def refresh_collectives() -> None:
    """Note whether this process has a ``torch.distributed`` process group (an EP all-to-all
    may run; single-process runs count every reference). Chunk plans call it when built;
    a stale answer costs only time, never a result."""
    _COLLECTIVES[0] = torch.distributed.is_available() and torch.distributed.is_initialized()


_COLLECTIVES = [False]
refresh_collectives()


def _collect_wgrad_hooks(callables: Sequence[WgradLayer]) -> list[Callable[[], object]]:
    hooks: list[Callable[[], object]] = []
    for module in callables:
        for p in module.parameters():
            hook: object = getattr(p, "post_wgrad_grad_acc_hook", None)
            if callable(hook) and p.requires_grad and p.grad is not None:
                hooks.append(hook)
    return hooks
