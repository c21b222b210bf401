"""Torch's process-wide settings, read and put back: what a test that changes one must
restore (``tests/conftest.py`` fails a test that leaves one changed), and the context
managers that change one for a block."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

import torch


@dataclasses.dataclass(frozen=True)
class TorchState:
    """The settings a test could change in the pytest process and leave changed for the
    tests after it (the RNG is not one: every test is seeded). Each field's name is what it
    is read by; ``read`` and ``restore`` cost microseconds."""

    num_threads: int
    """``torch.get_num_threads()``: intra-op threads."""
    num_interop_threads: int
    """``torch.get_num_interop_threads()``: settable once per process, before any inter-op
    work; a test cannot change it after that, and it cannot be put back."""
    default_dtype: torch.dtype
    """``torch.get_default_dtype()``."""
    deterministic_algorithms: bool
    """``torch.are_deterministic_algorithms_enabled()``."""
    deterministic_warn_only: bool
    """``torch.is_deterministic_algorithms_warn_only_enabled()``."""
    fill_uninitialized_memory: bool
    """``torch.utils.deterministic.fill_uninitialized_memory``."""
    grad_enabled: bool
    """``torch.is_grad_enabled()``."""
    inference_mode: bool
    """``torch.is_inference_mode_enabled()``: only a context's guard can turn it off; not put
    back."""
    anomaly_enabled: bool
    """``torch.is_anomaly_enabled()``."""
    anomaly_check_nan: bool
    """``torch.is_anomaly_check_nan_enabled()``."""
    float32_matmul_precision: str
    """``torch.get_float32_matmul_precision()``."""

    @classmethod
    def read(cls) -> TorchState:
        return cls(
            num_threads=torch.get_num_threads(),
            num_interop_threads=torch.get_num_interop_threads(),
            default_dtype=torch.get_default_dtype(),
            deterministic_algorithms=torch.are_deterministic_algorithms_enabled(),
            deterministic_warn_only=torch.is_deterministic_algorithms_warn_only_enabled(),
            fill_uninitialized_memory=torch._C._get_deterministic_fill_uninitialized_memory(),
            grad_enabled=torch.is_grad_enabled(),
            inference_mode=torch.is_inference_mode_enabled(),
            anomaly_enabled=torch.is_anomaly_enabled(),
            anomaly_check_nan=torch.is_anomaly_check_nan_enabled(),
            float32_matmul_precision=torch.get_float32_matmul_precision(),
        )

    def changes(self, now: TorchState) -> list[str]:
        """``"name: was -> now"`` for each setting ``now`` has otherwise."""
        return [
            f"{f.name}: {getattr(self, f.name)!r} -> {getattr(now, f.name)!r}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(now, f.name)
        ]

    def restore(self) -> list[str]:
        """Put every setting back to this state; the names of those that cannot be."""
        now = TorchState.read()
        stuck: list[str] = []
        if now.num_threads != self.num_threads:
            torch.set_num_threads(self.num_threads)
        if now.num_interop_threads != self.num_interop_threads:
            try:
                torch.set_num_interop_threads(self.num_interop_threads)
            except RuntimeError:
                stuck.append("num_interop_threads")
        if now.default_dtype != self.default_dtype:
            torch.set_default_dtype(self.default_dtype)
        if (now.deterministic_algorithms, now.deterministic_warn_only) != (
            self.deterministic_algorithms,
            self.deterministic_warn_only,
        ):
            torch.use_deterministic_algorithms(
                self.deterministic_algorithms, warn_only=self.deterministic_warn_only
            )
        if now.fill_uninitialized_memory != self.fill_uninitialized_memory:
            torch._C._set_deterministic_fill_uninitialized_memory(self.fill_uninitialized_memory)
        if now.grad_enabled != self.grad_enabled:
            torch.set_grad_enabled(self.grad_enabled)
        if now.inference_mode != self.inference_mode:
            stuck.append("inference_mode")
        if (now.anomaly_enabled, now.anomaly_check_nan) != (
            self.anomaly_enabled,
            self.anomaly_check_nan,
        ):
            torch._C.set_anomaly_enabled(self.anomaly_enabled, self.anomaly_check_nan)
        if now.float32_matmul_precision != self.float32_matmul_precision:
            torch.set_float32_matmul_precision(self.float32_matmul_precision)
        return stuck


@contextmanager
def seeded(seed: int = 0) -> Iterator[None]:
    """``torch.manual_seed(seed)`` for the block, the CPU generator's state it found put
    back after."""
    found = torch.get_rng_state()
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.set_rng_state(found)


@contextmanager
def num_threads(n: int) -> Iterator[None]:
    """``torch.set_num_threads(n)`` for the block, the count it found put back after."""
    found = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(found)


@contextmanager
def deterministic_algorithms(mode: bool = True) -> Iterator[None]:
    """``torch.use_deterministic_algorithms(mode)`` for the block, the mode it found (and its
    ``warn_only``) put back after."""
    found = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(mode)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(found[0], warn_only=found[1])
