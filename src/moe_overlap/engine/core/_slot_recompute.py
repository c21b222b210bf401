"""What a recomputed layer slot keeps from its forward to run it again exactly.

A slot the schedule recomputes (``ScheduleOptions.recompute``) drops its autograd graph
after forward and runs again before its backward. The second run must compute the same
bits and leave no trace but its graph: it runs on the random state and under the autocast
state its forward saw (:class:`ForwardState`, what ``torch.utils.checkpoint`` preserves:
the CPU generator and the generators of the CUDA devices of the slot's inputs), with the
caller's random state put back after, on inputs nothing released or wrote in place since;
what it writes into the layer state is undone
(:func:`snapshot` / :func:`restore`: later slots may have changed it since); and each
``node.detach`` returns the copy the forward made, which must be of the same tensor
(:func:`check_same`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Sequence

import torch
from torch import Tensor

from moe_overlap.errors import IntegrationError

from ._state import STATE_FIELDS, LayerState
from ._torch_private import tensor_version

__all__ = ["ForwardState", "LayerStateSnapshot", "check_same", "restore", "snapshot"]


class ForwardState:
    """The random and autocast state a slot's forward ran under, and the version counters
    of its inputs then."""

    __slots__ = ("autocast", "cache", "cpu", "cuda", "versions")

    def __init__(self, inputs: Sequence[Tensor | None]) -> None:
        self.versions = tuple(-1 if t is None else tensor_version(t) for t in inputs)
        self.cpu = torch.get_rng_state()
        devices = sorted({t.device for t in inputs if t is not None and t.is_cuda}, key=str)
        self.cuda = tuple((d, torch.cuda.get_rng_state(d)) for d in devices)
        kinds = ("cpu", "cuda") if devices else ("cpu",)
        self.autocast = tuple(
            (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
            for kind in kinds
        )
        self.cache = torch.is_autocast_cache_enabled()

    def check_inputs(self, node: str, inputs: Sequence[Tensor | None]) -> None:
        """Raise unless ``inputs`` hold what the forward received: not released, not
        written in place since (which a recompute would read silently)."""
        for i, (t, version) in enumerate(zip(inputs, self.versions, strict=True)):
            if t is None:
                continue
            if t.numel() and not t.untyped_storage().nbytes():
                done = "released"
            elif tensor_version(t) != version:
                done = "written in place (by the slot itself or a later step)"
            else:
                continue
            raise IntegrationError(
                f"node {node!r}: recompute: input {i} ({_describe(t)}) was {done} after the "
                "forward began; a recomputed slot reruns on its inputs as the forward "
                "received them. Expected a slot that neither writes its inputs nor hands "
                "them to what does; leave it out of ScheduleOptions.recompute otherwise"
            )

    @contextlib.contextmanager
    def replaying(self) -> Generator[None]:
        """Run the block on this state, with autograd recording; the caller's random state
        is put back after (the autocast state leaves with the block; an autocast context is
        entered only where the caller's state differs)."""
        caller_cpu = torch.get_rng_state()
        caller_cuda = [(d, torch.cuda.get_rng_state(d)) for d, _ in self.cuda]
        try:
            torch.set_rng_state(self.cpu)
            for device, state in self.cuda:
                torch.cuda.set_rng_state(state, device)
            with contextlib.ExitStack() as stack:
                stack.enter_context(torch.enable_grad())
                for kind, enabled, dtype in self.autocast:
                    now = (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
                    if now != (enabled, dtype):  # else as it was: no autocast context to leave
                        stack.enter_context(
                            torch.autocast(
                                kind, dtype=dtype, enabled=enabled, cache_enabled=self.cache
                            )
                        )
                yield
        finally:
            torch.set_rng_state(caller_cpu)
            for device, state in caller_cuda:
                torch.cuda.set_rng_state(state, device)


class LayerStateSnapshot:
    """A layer state's fields, stash and check lists, as a recompute found them."""

    __slots__ = ("extras", "fields", "fresh", "kept_as_is", "undetached")

    def __init__(self, state: LayerState) -> None:
        self.fields: tuple[object, ...] = tuple(getattr(state, name) for name in STATE_FIELDS)
        self.extras = dict(state.extras)
        self.fresh = len(state.fresh)
        self.kept_as_is = len(state.kept_as_is)
        self.undetached = len(state.undetached)


def snapshot(state: LayerState) -> LayerStateSnapshot:
    """What :func:`restore` puts back."""
    return LayerStateSnapshot(state)


def restore(state: LayerState, saved: LayerStateSnapshot) -> None:
    """Undo what a recompute wrote into ``state`` (it only appends to the check lists)."""
    for name, value in zip(STATE_FIELDS, saved.fields, strict=True):
        object.__setattr__(state, name, value)  # not LayerState's own: nothing is fresh
    state.extras.clear()
    state.extras.update(saved.extras)
    del state.fresh[saved.fresh :]
    del state.kept_as_is[saved.kept_as_is :]
    del state.undetached[saved.undetached :]


def _describe(t: Tensor) -> str:
    grad = ", requires grad" if t.requires_grad else ""
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)} on {t.device}{grad}"


def check_same(node: str, what: str, made: Tensor, before: Tensor) -> None:
    """Raise unless the recompute's ``made`` matches the forward's ``before`` in shape,
    dtype, device and ``requires_grad`` (``what``: which of the slot's tensors)."""
    if (
        made.shape == before.shape
        and made.dtype == before.dtype
        and made.device == before.device
        and made.requires_grad == before.requires_grad
    ):
        return
    raise IntegrationError(
        f"node {node!r}: recompute: {what} is {_describe(made)}, but the forward's was "
        f"{_describe(before)}; the slot handed on something different the second time. "
        "Expected a recomputed slot to compute the same tensors from the same inputs (no "
        "branch on state a later slot changed); leave this slot out of "
        "ScheduleOptions.recompute otherwise"
    )
