"""Two forwards or two backwards of one model, overlapped, run by hand (:func:`run_pair`):
its arguments checked, then one macro step of the core's runner."""

from __future__ import annotations

from torch import Tensor

from moe_overlap.errors import ConfigError
from moe_overlap.protocols import StepObserver

from .core._chunk_plan import ModelChunkSchedulePlan
from .core._runner import run_step

__all__ = ["run_pair"]


def run_pair(
    first: ModelChunkSchedulePlan,
    second: ModelChunkSchedulePlan,
    *,
    b_grads: tuple[Tensor, Tensor] | None = None,
    observer: StepObserver | None = None,
) -> tuple[Tensor | None, Tensor | None]:
    """Two forwards (``b_grads`` ``None``) or two backwards of one model, overlapped.

    The fill and the drain of combined 1F1B (:func:`~moe_overlap.steps.forward_pair_steps`,
    :func:`~moe_overlap.steps.backward_pair_steps`): each microbatch's all-to-all runs under the
    other's compute, ``first`` one slot ahead. Returns both forwards' outputs (the losses),
    or ``(None, None)`` after the backwards, which release both plans; on failure both are
    released, after synchronizing streams. One :func:`run_step` of the runner.
    """
    if b_grads is None:
        out0, out1 = run_step([first, second], [], [], where="run_pair", observer=observer)
        return out0, out1
    grads = check_grads("run_pair", b_grads)
    run_step([], [first, second], grads, where="run_pair", observer=observer)
    return None, None


def check_grads(where: str, value: object) -> tuple[object, object]:
    """``run_pair``'s ``b_grads`` as two values, or a :class:`~moe_overlap.ConfigError`."""
    if isinstance(value, tuple):
        items: tuple[object, ...] = value  # pyright: ignore[reportUnknownVariableType]
        if len(items) == 2:
            return items[0], items[1]
        received = f"a tuple of length {len(items)}"
    else:
        received = type(value).__name__
    raise ConfigError(
        f"{where}: expected b_grads as a tuple of two tensors (the gradients of the two "
        f"plans' outputs) or None, received {received}"
    )
