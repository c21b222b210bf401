# pyright: reportPrivateUsage=false
# The one module of moe_overlap.engine.core that touches torch's private names.
"""torch's private names, as the schedule core uses them; the releases they were checked on.

The core's other modules reach torch's internals only through the names bound here
(``tests/engine/test_private_torch.py`` parses them and fails on a private torch name
elsewhere), so a torch release that moves one breaks this module alone. Each is torch's
callable itself, bound once at import: the per-node path calls it as it called torch's
name, through a module global, with no wrapper frame of ours.

Each name's comment says what it is, the public API that does the same more slowly (or
that there is none) and the torch releases it was checked on: 2.13 is the CPU test suite;
2.11 is the GPU machine's ``gpu``-marked tests (run before the names moved here); "not on
2.11" marks a name no GPU test run has used yet.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import cast

import torch

__all__ = [
    "cuda_current_device",
    "cuda_current_stream",
    "cuda_set_stream",
    "multithreading_enabled",
    "run_backward",
    "set_grad_enabled",
    "set_multithreading_enabled",
    "tensor_version",
]

# autograd's engine entry point (tensors, grad_tensors, keep_graph, create_graph, inputs, allow_unreachable, accumulate_grad); public: torch.autograd.backward, whose Python checks cost ~5 us a node; checked on 2.13 and 2.11.
run_backward = cast(
    "Callable[..., object]",
    torch.autograd.Variable._execution_engine.run_backward,
)

# whether autograd hands CUDA work to its per-device worker threads (thread-local); public: torch.autograd.is_multithreading_enabled (the same function on 2.13); checked on 2.13 and 2.11 (an H100, 2026-12-07).
multithreading_enabled: Callable[[], bool] = torch._C._is_multithreading_enabled

# turns those worker threads off or on for this thread; public: torch.autograd.set_multithreading_enabled, a context-manager object per call; checked on 2.13 and 2.11 (an H100, 2026-12-07).
set_multithreading_enabled: Callable[[bool], None] = torch._C._set_multithreading_enabled

# turns gradient recording off or on (what torch.no_grad calls); public: torch.no_grad() / torch.set_grad_enabled, a context-manager object (~1 us) per call; checked on 2.13 and 2.11.
set_grad_enabled = cast("Callable[[bool], None]", torch._C._set_grad_enabled)

# a tensor's version counter, shared with its views and detached copies and bumped by every in-place write (what autograd compares for saved tensors); public: none (Tensor._version is this attribute); checked on 2.13 and 2.11 (the GPU tests on an H100, 2026-12-07).
tensor_version = cast("Callable[[torch.Tensor], int]", operator.attrgetter("_version"))

_C: object = torch._C
"""torch's extension module; the three CUDA calls below are absent from CPU-only builds
(``None`` there, where no CUDA stream can exist)."""

# the current CUDA device's index; public: torch.cuda.current_device (a Python wrapper that also initialises CUDA); checked on 2.13 (absent: CPU build) and 2.11 (the GPU tests on an H100, 2026-12-07).
cuda_current_device = cast("Callable[[], int] | None", getattr(_C, "_cuda_getDevice", None))

# (stream_id, device_index, device_type) of a device's current stream; public: torch.cuda.current_stream, which builds a Stream object; checked on 2.13 (absent: CPU build) and 2.11 (the GPU tests on an H100, 2026-12-07).
cuda_current_stream = cast(
    "Callable[[int], tuple[int, int, int]] | None", getattr(_C, "_cuda_getCurrentStream", None)
)

# makes (stream_id, device_index, device_type) the current stream (what torch.cuda.stream's exit calls); public: torch.cuda.set_stream, which takes a Stream object; checked on 2.13 (absent: CPU build) and 2.11 (the GPU tests on an H100, 2026-12-07).
cuda_set_stream = cast("Callable[[int, int, int], None]", getattr(_C, "_cuda_setStream", None))
