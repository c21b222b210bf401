"""The base schedule node: one piece of a microbatch's forward and its backward.

A node runs its forward function on its stream, between a wait on and a record of the
microbatch's event, on *detached* copies of its inputs. Its backward runs autograd from the
stored outputs with the given output gradients and returns the gradients that reached the
detached inputs. Chaining nodes therefore splits one autograd graph into pieces that a
schedule can interleave with another microbatch's pieces.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

from torch import Tensor

from moe_overlap.errors import IntegrationError, NodeStateError
from moe_overlap.protocols import NodeTimer, StreamProvider

from ._hooks import on_before_release, on_node_entered, on_node_forwarded, on_node_left
from ._node_errors import check_marked
from ._streams import (
    AnyEvent,
    CpuEvent,
    CpuStream,
    abandon_stream,
    enter_stream,
    leave_stream,
    record_tensor_on,
    release_storage,
)
from ._torch_private import multithreading_enabled as _multithreading_enabled

# The autograd engine's entry point, called directly as Megatron-Core does:
# ``torch.autograd.backward``'s Python wrapper re-validates what ``default_backward`` has
# already filtered and costs ~5 us per node (benchmarks/bench_host_megatron.py). The engine
# still checks each grad's shape against its output. Positional arguments: tensors,
# grad_tensors, keep_graph, create_graph, inputs, allow_unreachable, accumulate_grad.
from ._torch_private import run_backward as _run_backward
from ._torch_private import set_multithreading_enabled as _set_multithreading_enabled

__all__ = [
    "BackwardFunc",
    "ForwardFunc",
    "NodePhase",
    "NoopScheduleNode",
    "ScheduleNode",
]

ForwardFunc = Callable[..., "Tensor | tuple[Tensor, ...]"]
"""A node's forward: tensors in, a tensor or a tuple of tensors out."""

BackwardFunc = Callable[[tuple[Tensor, ...], tuple["Tensor | None", ...]], None]
"""A node's backward: run autograd from ``outputs`` with ``output_grads``."""


class NodePhase(enum.Enum):
    """Where a node is in its one-shot life."""

    NEW = "new"
    FORWARDED = "forwarded"
    DONE = "done"


def _as_tuple(name: str, value: object) -> tuple[Tensor, ...]:
    if isinstance(value, Tensor):
        return (value,)
    if isinstance(value, tuple):
        out: list[Tensor] = []
        for item in value:  # pyright: ignore[reportUnknownVariableType]
            if not isinstance(item, Tensor):
                break
            out.append(item)
        else:
            return tuple(out)
    raise IntegrationError(
        f"node {name!r}: forward must return a Tensor or a tuple of Tensors, "
        f"received {_describe(value)}"  # pyright: ignore[reportUnknownArgumentType]
    )


def _describe(value: object) -> str:
    if isinstance(value, tuple):
        kinds = ", ".join(type(v).__name__ for v in value)  # pyright: ignore[reportUnknownVariableType, reportUnknownArgumentType]
        return f"tuple({kinds})"
    return type(value).__name__


def default_backward(outputs: tuple[Tensor, ...], output_grads: tuple[Tensor | None, ...]) -> None:
    """Run autograd from ``outputs``, skipping outputs without grad or given a ``None`` grad.

    Gradients accumulate into the leaves (parameters and the nodes' detached inputs)
    exactly as ``torch.autograd.backward(outputs, output_grads)`` would. From CUDA tensors
    the engine runs on the calling thread (:func:`_backward_on_this_thread`).
    """
    if (
        len(outputs) == 1
        and len(output_grads) == 1
        and outputs.__class__ is tuple
        and output_grads.__class__ is tuple
    ):
        # One output (most nodes): no lists to filter through.
        out = outputs[0]
        if output_grads[0] is not None and out.requires_grad:
            if out.is_cuda:
                _backward_on_this_thread(outputs, output_grads)
            else:
                _run_backward(outputs, output_grads, False, False, (), True, True)
        return
    tensors: list[Tensor] = []
    grads: list[Tensor] = []
    for out, grad in zip(outputs, output_grads, strict=True):
        if grad is not None and out.requires_grad:
            tensors.append(out)
            grads.append(grad)
    if tensors and tensors[0].is_cuda:
        _backward_on_this_thread(tuple(tensors), tuple(grads))
    elif tensors:
        _run_backward(tuple(tensors), tuple(grads), False, False, (), True, True)


def _backward_on_this_thread(tensors: tuple[Tensor, ...], grads: tuple[Tensor | None, ...]) -> None:
    """The engine call from CUDA tensors, with autograd's worker threads off (this thread).

    Ordinarily the engine hands CUDA work to its per-device worker thread and the calling
    thread sleeps until it is done: two thread wake-ups per call, about half the host time
    of a small node's backward (an H100 box: 56.3 to 27.6 µs per node,
    ``benchmarks/bench_host_megatron.py``). With them off
    (``torch.autograd.set_multithreading_enabled(False)``, thread-local, restored after)
    the calling thread runs the same functions, in the same order, each on its forward's
    stream: the same kernels on the same streams, so the same gradients (GPU tests and
    ``benchmarks/stress_exact.py`` with injected stream delays: 0 of 220 runs differed).
    """
    if not _multithreading_enabled():  # already off (the caller's choice)
        _run_backward(tensors, grads, False, False, (), True, True)
        return
    _set_multithreading_enabled(False)
    try:
        _run_backward(tensors, grads, False, False, (), True, True)
    finally:
        _set_multithreading_enabled(True)


class ScheduleNode:
    """One schedulable piece of a microbatch: forward on a stream, backward from its outputs.

    Args:
        forward_func: the work; called with detached copies of the inputs.
        stream: returns the stream the node runs on (compute or communication).
        event: the microbatch's event; every node of a microbatch shares it, so nodes on
            different streams still run in order.
        backward_func: replaces the default backward (autograd from the outputs).
        free_input: release the inputs' storage after forward (the caller's policy says the
            backward does not need them).
        name: used in error messages and timelines.

    A node runs forward once and backward once; anything else raises
    :class:`~moe_overlap.NodeStateError`.

    ``timer``, when set (the runner sets it for one step from a
    :class:`~moe_overlap.steps.StepObserver` and clears it after), is started after the event
    wait and stopped after the body, on the node's stream.
    """

    # Class-level defaults: the per-node state that starts out the same for every node
    # (a node's constructor then sets only what differs).
    forward_func: ForwardFunc
    backward_func: BackwardFunc = staticmethod(default_backward)
    phase: NodePhase = NodePhase.NEW
    inputs: tuple[Tensor | None, ...] = ()
    outputs: tuple[Tensor, ...] = ()
    non_differentiable: tuple[Tensor, ...] = ()
    timer: NodeTimer | None = None
    where: str = ""
    """Where the node sits (``microbatch 3, layer 1``), set for the stream-order checker's
    messages (its guard names the nodes of a plan when it is built)."""
    detached: tuple[Tensor, ...] = ()
    """Tensors the node handed to later nodes itself (layer slots, through ``detach``)."""
    kept_as_is: Sequence[Tensor] = ()
    """Tensors kept for later nodes as they are, being some node's input or output (layer
    slots: their layer's ``LayerState.kept_as_is``); a freeing node checks them by storage."""
    count_input_refs: bool = True
    """Whether a freeing node's inputs hold no references but the schedule's when it is about
    to release them (off where they are a collective's receive buffer, which its pending
    work may still hold: ``mlp``, after the dispatch all-to-all)."""
    count_copy_refs: bool = True
    """The same for the node's detached copies of its inputs, what its slot received (off
    where the slot hands them to a collective: ``moe_dispatch``, ``moe_combine``)."""

    def __init__(
        self,
        forward_func: ForwardFunc,
        stream: StreamProvider,
        event: AnyEvent,
        backward_func: BackwardFunc | None = None,
        free_input: bool = False,
        name: str = "schedule_node",
    ) -> None:
        self.name = name
        if forward_func is not _OWN_FORWARD:
            self.forward_func = forward_func
        if backward_func is not None:
            self.backward_func = backward_func
        self.stream = stream
        self.event = event
        self.free_input = free_input

    def forward(self, *inputs: Tensor | None) -> tuple[Tensor, ...]:
        """Run the forward on detached inputs; return the outputs as a tuple.

        Raises :class:`~moe_overlap.IntegrationError` when a floating-point output does not
        require grad although an input does (cut from the graph; see
        :meth:`mark_non_differentiable`), or, when this node frees its inputs, before it
        releases any: when an output or a tensor handed to a later node shares storage with
        one of them, or when anything else still holds one (an autograd save, a recompute,
        a layer-state tensor over it; found through reference counts, named by
        ``check_release``).
        """
        if self.phase is not NodePhase.NEW:
            raise NodeStateError(
                f"node {self.name!r}: forward expected a new node, but it is {self.phase.value}; "
                "nodes are one-shot: build a new plan per microbatch"
            )
        stream = self.stream()
        for guard in on_node_entered:
            guard.node_entered(self, "forward")
        event = self.event
        try:
            switch = enter_stream(stream, event)
            try:
                copies: list[Tensor | None] = []
                for t in inputs:
                    if isinstance(t, Tensor):
                        d = t.detach()
                        d.requires_grad_(t.requires_grad)
                        copies.append(d)
                    elif t is None:
                        copies.append(None)
                    else:
                        raise _not_a_tensor(t)
                detached = tuple(copies)
                self.inputs = detached
                timer = self.timer
                if timer is not None:
                    timer.start(stream)
                result = self.forward_func(*detached)
                if timer is not None:
                    timer.stop(stream)
                outputs = (result,) if isinstance(result, Tensor) else _as_tuple(self.name, result)
                self.outputs = outputs
            except BaseException as exc:
                abandon_stream(switch, exc)
                raise
            leave_stream(stream, event, switch)
        finally:
            for guard in on_node_left:
                guard.node_left(self)
        for guard in on_node_forwarded:
            guard.node_forwarded(self, detached, outputs)
        self.phase = NodePhase.FORWARDED
        if not self.free_input:
            return outputs
        for guard in on_before_release:  # nothing still in use lives in an input's storage
            guard.before_release(self, inputs, detached, outputs)
        for tensor in inputs:
            if tensor is not None:
                record_tensor_on(tensor, stream)
                release_storage(tensor)
        return outputs

    def mark_non_differentiable(self, *tensors: Tensor) -> None:
        """Declare tensors that carry no gradient on purpose (masks, counts as floats).

        A floating-point output (or, for a layer slot, a tensor kept in ``layer_state``)
        that does not require grad while an input does is otherwise an error: it usually
        means the graph was cut by mistake (``detach()``, ``torch.no_grad()``, ``.data``)
        and backward would silently skip it. Integer tensors (routing indices) never need
        marking. Each tensor is its own argument: a tuple or list of them is an
        :class:`~moe_overlap.IntegrationError` (``mark_non_differentiable(*tensors)``).
        """
        check_marked(tensors, node=self.name)
        self.non_differentiable = (*self.non_differentiable, *tensors)

    def handed_on(self) -> list[tuple[str, Tensor | None]]:
        """Every tensor this node or its layer keeps for later nodes, with its name
        (checked when the reference counts of an input about to be freed say something
        else holds it)."""
        return [(f"node.detach copy {i}", d) for i, d in enumerate(self.detached)]

    def graph_tails(self) -> tuple[Tensor, ...]:
        """Tensors besides the outputs whose graph this node's backward runs (none here)."""
        return ()

    def recompute(self) -> None:
        """Run the forward again, recording autograd, for the backward (an ``R`` step).

        Only a node built to be recomputed can; this one raises
        :class:`~moe_overlap.NodeStateError`.
        """
        raise NodeStateError(
            f"node {self.name!r}: a recompute step (R) expected a node whose slot is "
            "recomputed, received one that keeps its activations; list R steps only for "
            "the slots the schedule recomputes"
        )

    def backward(self, *output_grad: Tensor | None) -> tuple[Tensor | None, ...]:
        """Backpropagate ``output_grad`` (one per output); return the inputs' grads."""
        if self.phase is not NodePhase.FORWARDED:
            expected = "after forward" if self.phase is NodePhase.NEW else "once"
            raise NodeStateError(
                f"node {self.name!r}: backward must run {expected}; the node is {self.phase.value}"
            )
        outputs = self.outputs
        if len(output_grad) != len(outputs):
            raise NodeStateError(
                f"node {self.name!r}: backward expected {len(outputs)} output grads "
                f"(one per forward output), received {len(output_grad)}"
            )
        stream = self.stream()
        for guard in on_node_entered:
            guard.node_entered(self, "backward")
        event = self.event
        try:
            switch = enter_stream(stream, event)
            try:
                timer = self.timer
                if timer is not None:
                    timer.start(stream)
                self.backward_impl(outputs, output_grad)
                if timer is not None:
                    timer.stop(stream)
            except BaseException as exc:
                abandon_stream(switch, exc)
                raise
            leave_stream(stream, event, switch)
        finally:
            for guard in on_node_left:
                guard.node_left(self)
        if not isinstance(stream, CpuStream) or on_node_entered:  # a watcher sees CPU streams
            for grad in output_grad:
                # The grads may come from the other stream: keep their memory until this
                # node's backward kernels are done with it.
                if grad is not None:
                    record_tensor_on(grad, stream)
        detached = self.inputs
        if len(detached) == 1:  # most nodes: no comprehension (a function call on 3.11)
            only = detached[0]
            grads: tuple[Tensor | None, ...] = (only.grad if only is not None else None,)
        else:
            grads = tuple([t.grad if t is not None else None for t in detached])
        self.release_state()
        return grads

    def backward_impl(
        self, outputs: tuple[Tensor, ...], output_grad: tuple[Tensor | None, ...]
    ) -> None:
        """Run the backward function; subclasses add tensors to backpropagate through."""
        self.backward_func(outputs, output_grad)

    def release_state(self) -> None:
        """Drop inputs and outputs so their memory can go; the node is done."""
        self.inputs = ()
        self.outputs = ()
        self.non_differentiable = ()
        self.phase = NodePhase.DONE

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.phase.value})"


class NoopScheduleNode(ScheduleNode):
    """A node that passes its inputs through: forward returns them, backward returns the grads.

    Used for the dispatch and combine slots of dense layers and wherever a plan has no work.
    """

    def __init__(self, name: str = "noop") -> None:
        super().__init__(_identity, _cpu_stream, CpuEvent(), name=name)

    def forward(self, *inputs: Tensor | None) -> tuple[Tensor, ...]:
        out: list[Tensor] = []
        for i, t in enumerate(inputs):
            if t is None:
                raise IntegrationError(
                    f"node {self.name!r}: input {i} is None; a pass-through node forwards Tensors"
                )
            out.append(t)
        return tuple(out)

    def backward(self, *output_grad: Tensor | None) -> tuple[Tensor | None, ...]:
        return output_grad


def _not_a_tensor(value: object) -> IntegrationError:
    """The error for a node input that is neither a Tensor nor ``None``."""
    return IntegrationError(
        f"schedule node input: expected a Tensor or None, received {type(value).__name__}"
    )


def _own_forward(*inputs: Tensor | None) -> Tensor | tuple[Tensor, ...]:
    raise AssertionError("never called: a node built with it defines forward_func itself")


_OWN_FORWARD: ForwardFunc = _own_forward
"""``forward_func`` for a node class that defines ``forward_func`` as a method (the node then
holds no reference to itself; see :func:`~moe_overlap.weak_method`)."""


def _identity(*inputs: Tensor) -> tuple[Tensor, ...]:
    return inputs


def _cpu_stream() -> CpuStream:
    return _NOOP_STREAM


_NOOP_STREAM = CpuStream("noop")
