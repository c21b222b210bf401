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
import importlib
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
    utils: Any = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if self.drop_and_pad or point != self.cuda_dtoh_point:
        return tokens_per_expert
    for name in ("input_splits", "output_splits", "output_splits_tp"):
        value = getattr(self, name)
        if isinstance(value, torch.Tensor):
            setattr(self, name, value.numpy())
    self.num_out_tokens = utils.maybe_move_tensor_to_cpu(self.num_out_tokens)
    return tokens_per_expert


@contextlib.contextmanager
def _no_fork() -> Iterator[None]:
    yield


def _fork(self: object, name: str = "") -> contextlib.AbstractContextManager[None]:
    """The RNG tracker's ``fork``: no CUDA generator to fork (the tests run no dropout)."""
    del self, name
    return _no_fork()


def _cpu() -> torch.device:
    """``torch.cuda.current_device()`` on one CPU process."""
    return torch.device("cpu")


@contextlib.contextmanager
def megatron_on_cpu(expert_parallel: int = 1) -> Iterator[None]:
    """Megatron-Core ready to build and run a model on this CPU process, restored after
    (its model-parallel state over the world: ``expert_parallel`` ranks per expert group,
    no tensor or pipeline parallelism; its global MoE metrics tracker fresh before and after,
    since it sizes its per-layer sums by the first model that records)."""
    parallel_state: Any = importlib.import_module("megatron.core.parallel_state")
    moe_logging: Any = importlib.import_module("megatron.core.transformer.moe.moe_logging")
    mc_random: Any = importlib.import_module("megatron.core.tensor_parallel.random")
    td: Any = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")

    a2a = td.MoEAlltoAllTokenDispatcher
    saved: list[tuple[object, str, object]] = [
        (a2a, "cuda_dtoh_stream", a2a.__dict__.get("cuda_dtoh_stream")),
        (a2a, "_maybe_dtoh_and_synchronize", a2a.__dict__["_maybe_dtoh_and_synchronize"]),
        (torch.cuda, "current_device", torch.cuda.current_device),
        (mc_random.CudaRNGStatesTracker, "fork", mc_random.CudaRNGStatesTracker.__dict__["fork"]),
    ]
    env = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
    started = not dist.is_initialized()
    moe_logging.destroy_moe_metrics_tracker()
    try:
        a2a.cuda_dtoh_stream = _NoStream()
        a2a._maybe_dtoh_and_synchronize = _dtoh_on_cpu
        setattr(torch.cuda, "current_device", _cpu)  # noqa: B010 (patched, put back)
        mc_random.CudaRNGStatesTracker.fork = _fork
        if started:
            with socket.socket() as s:  # a free port for the one-rank group
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
            dist.init_process_group("gloo", rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=expert_parallel)
        yield
    finally:
        moe_logging.destroy_moe_metrics_tracker()
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
