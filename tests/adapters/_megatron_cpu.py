"""Test-only: Megatron-Core on one CPU process.

Megatron-Core 0.19 hard-wires a few CUDA calls on paths a CPU run takes: the all-to-all
token dispatcher's constructor makes a ``torch.cuda.Stream`` and its device-to-host step
enters it; the router moves its weight, and the attention allocates its score buffer, on
``torch.cuda.current_device()``; the attention dropout forks the CUDA RNG tracker. :func:`megatron_on_cpu` replaces exactly
those (with what they amount to on one CPU process: no side stream,
``torch.cuda.current_device()`` is the CPU, no RNG fork; the tests run without dropout), initialises Megatron's model-parallel
state on a one-rank gloo group (TP = PP = EP = 1), and restores everything on exit.

The library never imports this module; on a GPU the tests run Megatron unpatched.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["megatron_on_cpu"]


class _NoStream:
    """Stands in for the dispatcher's class-level device-to-host stream (never entered)."""


def _dtoh_on_cpu(self: Any, point: str, tokens_per_expert: torch.Tensor | None = None) -> Any:
    """The all-to-all dispatcher's ``_maybe_dtoh_and_synchronize`` on one CPU process: at
    its device-to-host point the same attributes become CPU values (numpy splits), with no
    stream and no event."""
    from megatron.core.transformer.moe.moe_utils import maybe_move_tensor_to_cpu

    if self.drop_and_pad or point != self.cuda_dtoh_point:
        return tokens_per_expert
    for name in ("input_splits", "output_splits", "output_splits_tp"):
        value = getattr(self, name)
        if isinstance(value, torch.Tensor):
            setattr(self, name, value.numpy())
    self.num_out_tokens = maybe_move_tensor_to_cpu(self.num_out_tokens)
    return tokens_per_expert


@contextlib.contextmanager
def _no_fork() -> Iterator[None]:
    yield


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """Megatron-Core ready to build and run a model on this CPU process, restored after."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mc_random
    from megatron.core.transformer.moe import token_dispatcher as td

    a2a = td.MoEAlltoAllTokenDispatcher
    saved: list[tuple[object, str, object]] = [
        (a2a, "cuda_dtoh_stream", a2a.__dict__.get("cuda_dtoh_stream")),
        (a2a, "_maybe_dtoh_and_synchronize", a2a.__dict__["_maybe_dtoh_and_synchronize"]),
        (torch.cuda, "current_device", torch.cuda.current_device),
        (mc_random.CudaRNGStatesTracker, "fork", mc_random.CudaRNGStatesTracker.__dict__["fork"]),
    ]
    env = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
    started = not dist.is_initialized()
    try:
        a2a.cuda_dtoh_stream = _NoStream()
        a2a._maybe_dtoh_and_synchronize = _dtoh_on_cpu  # type: ignore[method-assign]
        torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
        mc_random.CudaRNGStatesTracker.fork = lambda self, name="": _no_fork()  # type: ignore[method-assign]
        if started:
            with socket.socket() as s:  # a free port for the one-rank group
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
            dist.init_process_group("gloo", rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1, 1)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if started and dist.is_initialized():
            dist.destroy_process_group()
        for owner, name, value in saved:
            setattr(owner, name, value)
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
