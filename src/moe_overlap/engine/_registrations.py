"""How many modules, parameters and buffers the process has registered so far.

Counted by torch's global registration hooks: an unchanged count means no submodule,
parameter or buffer was set or replaced anywhere, so a walk of a model's parameters made
since then still holds (CUDA-graphed blocks and the shared-parameter count rely on it;
debug mode walks again regardless).
"""

from __future__ import annotations

from torch import nn

__all__ = ["registrations"]


class _Count:
    value = 0

    @classmethod
    def bump(cls, *_: object) -> None:
        cls.value += 1


_HOOKS = (
    nn.modules.module.register_module_module_registration_hook(_Count.bump),
    nn.modules.module.register_module_parameter_registration_hook(_Count.bump),
    nn.modules.module.register_module_buffer_registration_hook(_Count.bump),
)


def registrations() -> int:
    """Modules, parameters and buffers registered in this process so far."""
    return _Count.value
