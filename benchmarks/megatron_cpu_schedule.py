"""CPU only, for ``bench_megatron_1gpu.py``'s smoke run: Megatron-Core's combined-1F1B
schedule on one CPU process.

The schedule's modules call CUDA-only functions: they make a CUDA event per plan, enter
streams, ``record_stream`` tensors and make a token counter on ``"cuda"``.
:func:`schedule_on_cpu` hands those modules a ``torch`` whose CUDA events and streams are
no-ops and whose ``zeros(device="cuda")`` is on the CPU, and makes ``Tensor.record_stream``
a no-op for CPU tensors; one process, one thread: every step has run when the next starts.
Everything is put back on exit. The model's own CUDA-only calls are the test shim's
(``tests/adapters/_megatron_cpu.py``). Never used on a GPU.
"""

from __future__ import annotations

import contextlib
import importlib
import types
from collections.abc import Callable, Generator
from typing import Any

import torch
from torch import Tensor

__all__ = ["schedule_on_cpu"]


class _CpuEvent:
    """A CUDA event on one CPU process: the work is already done when it is recorded."""

    def record(self, stream: object = None) -> None:
        del stream

    def wait(self, stream: object = None) -> None:
        del stream


_CPU_STREAM = object()


def _cpu_stream(*args: object, **kwargs: object) -> object:
    del args, kwargs
    return _CPU_STREAM


def _cpu_stream_context(stream: object = None) -> contextlib.AbstractContextManager[None]:
    del stream
    return contextlib.nullcontext()


class _CudaOnCpu(types.SimpleNamespace):
    """``torch.cuda`` as Megatron's schedule sees it on one CPU process."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _TorchOnCpu(types.ModuleType):
    """``torch`` as Megatron's schedule modules see it on one CPU process: ``torch.cuda``
    above; ``torch.zeros(..., device="cuda")`` on the CPU; everything else torch's own."""

    cuda: _CudaOnCpu
    zeros: Callable[..., Tensor]

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _zeros_on_cpu(*size: int, device: torch.device | str | None = None, **kwargs: Any) -> Tensor:
    where = "cpu" if device == "cuda" else device
    return torch.zeros(*size, device=where, **kwargs)


def _cpu_event(*args: object, **kwargs: object) -> _CpuEvent:
    del args, kwargs
    return _CpuEvent()


#: The Megatron-Core modules of the combined-1F1B schedule that call CUDA-only functions.
_SCHEDULE_MODULES = (
    "megatron.core.pipeline_parallel.utils",
    "megatron.core.pipeline_parallel.combined_1f1b",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.models.common.model_chunk_schedule_plan",
    "megatron.core.models.common.utils",
    "megatron.core.models.gpt.fine_grained_callables",
)


@contextlib.contextmanager
def schedule_on_cpu() -> Generator[None, None, None]:
    """CPU only: Megatron's schedule modules see a ``torch`` whose CUDA events, streams and
    ``"cuda"`` counter are no-ops on the CPU, and ``Tensor.record_stream`` does nothing for a
    CPU tensor (one process, one thread: every step has run when the next starts)."""
    fake = _TorchOnCpu("torch")
    fake.cuda = _CudaOnCpu(
        Event=_cpu_event,
        Stream=_cpu_stream,
        current_stream=_cpu_stream,
        stream=_cpu_stream_context,
    )
    fake.zeros = _zeros_on_cpu
    record_stream = torch.Tensor.record_stream

    def record_on_cpu(self: Tensor, stream: Any) -> None:
        if self.is_cuda:
            record_stream(self, stream)

    modules: list[Any] = [importlib.import_module(name) for name in _SCHEDULE_MODULES]
    saved = [m.torch for m in modules]
    try:
        for m in modules:
            m.torch = fake
        setattr(torch.Tensor, "record_stream", record_on_cpu)  # noqa: B010 - put back below
        yield
    finally:
        setattr(torch.Tensor, "record_stream", record_stream)  # noqa: B010
        for m, t in zip(modules, saved, strict=True):
            m.torch = t
