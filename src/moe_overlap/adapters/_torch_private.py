# The one module of moe_overlap.adapters that touches torch's private names.
"""torch's private names, as the adapters use them; the releases they were checked on.

The adapters' other modules reach torch's internals only through the functions here
(``tests/adapters/test_private_torch.py`` parses them and fails on a private torch name
elsewhere), so a torch release that moves one breaks this module alone. The private
names of transformers and torchtitan the adapters read stay beside the code that reads
them. Checked on torch 2.13 (CI, CPU) and torch 2.11 (the GPU machine, CUDA: the
``gpu``-marked tests) by the tests of ``tests/adapters``; each name below says what breaks
if torch moves or renames it.

- ``nn.Module._modules`` (:func:`children`): a module's children by name, read and
  written in place: a layer's child swapped for a stand-in while the layer's own forward
  runs, a torchtitan model's children listed for its pipeline stage; a shallow copy of a
  module given children of its own (:func:`with_children`: the Megatron-Core adapter's
  probe of a ``HybridModel``). Renamed, building or running an adapter raises
  ``AttributeError``.
- ``nn.Module._parameters`` (:func:`parameters`): a module's own parameters by name,
  read and written in place: tied embedding and head weights stood in for by the
  microbatch's copies. Renamed, a model with tied weights raises ``AttributeError``.
- ``Tensor._version`` (:func:`version`): a tensor's in-place write counter, which the
  torchtitan adapter's self-check compares so that its probe leaves buffers as they were.
  Renamed, the self-check raises ``AttributeError``.
- ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``, its classes
  ``ActivationWrapper`` and ``CheckpointWrapper`` (:func:`checkpoint_wrapper_class`) and
  the wrapped module's name ``_checkpoint_wrapped_module`` (:func:`checkpoint_wrapped`):
  torchtitan's activation checkpointing, which the torchtitan adapter builds inside. The
  module moved, a wrapped block is no longer recognised as wrapped (the adapter does not
  look inside it); the child renamed, a wrapped block is refused with a
  :class:`~moe_overlap.ConfigError`.
"""

from __future__ import annotations

import copy
import sys

from torch import Tensor, nn

__all__ = [
    "checkpoint_wrapped",
    "checkpoint_wrapper_class",
    "children",
    "parameters",
    "version",
    "with_children",
]

_WRAPPER_MODULE = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"
_WRAPPED_CHILD = "_checkpoint_wrapped_module"


def children(module: nn.Module) -> dict[str, nn.Module | None]:
    """``module``'s children by name (the live dict: writes change the module)."""
    return module._modules  # pyright: ignore[reportPrivateUsage]


def with_children(module: nn.Module, replaced: dict[str, nn.Module]) -> nn.Module:
    """A shallow copy of ``module`` (the same parameters, buffers and settings) with a child
    dict of its own: ``module``'s children, those named in ``replaced`` replaced. ``module``
    is not changed."""
    dup = copy.copy(module)
    dup._modules = {**module._modules, **replaced}  # pyright: ignore[reportPrivateUsage]
    return dup


def parameters(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """``module``'s own parameters by name (the live dict: writes change the module)."""
    return module._parameters  # pyright: ignore[reportPrivateUsage]


def version(t: Tensor) -> int:
    """How many times ``t`` was written in place (torch's version counter)."""
    return t._version


def checkpoint_wrapper_class(name: str) -> type | None:
    """A class of torch's checkpoint wrapper module, when that module is imported (a
    wrapper cannot exist otherwise)."""
    module = sys.modules.get(_WRAPPER_MODULE)
    found: object = getattr(module, name, None) if module is not None else None
    return found if isinstance(found, type) else None


def checkpoint_wrapped(wrapper: nn.Module) -> nn.Module | None:
    """The module a torch ``CheckpointWrapper`` wraps (``None`` if it holds none)."""
    return children(wrapper).get(_WRAPPED_CHILD)
