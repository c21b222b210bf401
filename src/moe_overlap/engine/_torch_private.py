# pyright: reportPrivateUsage=false
# The one module of moe_overlap.engine's checks that touches torch's private names.
"""torch's private names, as the engine's checks use them; the releases they were checked on.

The checks and tools (every module of ``moe_overlap.engine`` outside ``core``, which keeps
its own in ``core/_torch_private.py``) reach torch's internals only through the names here
(``tests/engine/test_private_torch.py`` parses them and fails on a private torch name
elsewhere), so a torch release that moves one breaks this module alone. A private module's
path or an attribute's name as a string counts as a use. The callables the per-node checks
call are torch's own (or a C ``attrgetter``), bound once at import: no wrapper frame of ours.

Each name's comment says what it is, the public API that does the same (or that there is
none) and the torch releases it was checked on: 2.13 is the CPU test suite; 2.11 is the GPU
machine's ``gpu``-marked tests (run before the names moved here). A wrapper
class is looked up only when its module is already imported: an instance cannot exist
otherwise, and nothing is imported here.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from operator import attrgetter
from typing import Any, cast

import torch
from torch import Tensor

# the base of the stream-order checker's mode, which sees every aten op; no public module has it; checked on 2.13 and 2.11 (imported with the engine).
from torch.utils._python_dispatch import TorchDispatchMode as TorchDispatchMode

__all__ = [
    "CHECKPOINT_WRAPPED",
    "COMPILED_CALL",
    "COMPILED_ORIGINAL",
    "COMPOSABLE_APIS",
    "FORWARD_PRE_HOOKS",
    "GRAD_HOOKS",
    "MODULE_CHILDREN",
    "MODULE_HOOK_DICTS",
    "TorchDispatchMode",
    "activation_wrapper_class",
    "composable_registry_key",
    "cuda_sleep",
    "op_schema",
    "optimized_module_class",
    "storage_cdata",
    "storage_use_count",
    "tensor_base",
    "tensor_use_count",
    "tensor_version",
]

# how many references the StorageImpl at a storage's ``_cdata`` has (tensors over it, Python storage objects); no public API (sys.getrefcount counts Python references only); checked on 2.13 and 2.11.
storage_use_count = cast("Callable[[int], int]", torch._C._storage_Use_Count)

# a storage's StorageImpl address (``storage._cdata``), the key of storage_use_count and of the stream-order checker's accesses; no public API (data_ptr names the memory, not the storage); checked on 2.13 and 2.11.
storage_cdata = cast("Callable[[torch.UntypedStorage], int]", attrgetter("_cdata"))

# spins the current CUDA stream for a number of GPU cycles (torch's test helper, unannotated), race shaking's delay; no public API; checked on 2.13 (bound; calling it needs CUDA) and 2.11.
cuda_sleep = cast("Callable[[int], None]", torch.cuda._sleep)  # pyright: ignore[reportUnknownMemberType]

# a view's base tensor (``t._base``; None for a tensor that is no view); no public API; checked on 2.13 and 2.11.
tensor_base = cast("Callable[[Tensor], Tensor | None]", attrgetter("_base"))


def _no_count(t: Tensor) -> int:
    del t
    return 0


# how many references a tensor's TensorImpl has (its Python object, views' bases, autograd's saves and grad accumulator), 0 where torch has no ``Tensor._use_count``; no public API; checked on 2.13 and 2.11 (bound there: the fallback would pass unnoticed).
tensor_use_count = cast("Callable[[Tensor], int]", getattr(Tensor, "_use_count", _no_count))

# a tensor's version counter, bumped by every in-place write (the shared-parameter count reads whether AccumulateGrad added to ``.grad``); no public API (``Tensor._version`` is this attribute); checked on 2.13, not on 2.11.
tensor_version = cast("Callable[[Tensor], int]", attrgetter("_version"))

# an aten op overload's schema (``op._schema``: its arguments, which it writes); no public API; checked on 2.13, not on 2.11 (the stream-order checker runs in CPU tests only).
op_schema = cast("Callable[[object], Any]", attrgetter("_schema"))

_CHECKPOINT_MODULE = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"
_DYNAMO_MODULE = "torch._dynamo.eval_frame"
_COMPOSABLE_MODULE = "torch.distributed._composable.contract"


def _class(module_name: str, name: str) -> type | None:
    module = sys.modules.get(module_name)
    found: object = getattr(module, name, None) if module is not None else None
    return found if isinstance(found, type) else None


# torch's ActivationWrapper, the base of CheckpointWrapper and OffloadWrapper (checkpoint_wrapper, offload_wrapper, apply_activation_checkpointing), or None; no public class; checked on 2.13 and 2.11.
def activation_wrapper_class() -> type | None:
    """``torch.distributed.algorithms._checkpoint.checkpoint_wrapper.ActivationWrapper``,
    when that module is imported."""
    return _class(_CHECKPOINT_MODULE, "ActivationWrapper")


# the module an ActivationWrapper wraps, by its child's name; no public API; checked on 2.13 and 2.11.
CHECKPOINT_WRAPPED = "_checkpoint_wrapped_module"


# the class torch.compile(module) returns, or None; no public class; checked on 2.13 and 2.11.
def optimized_module_class() -> type | None:
    """``torch._dynamo.eval_frame.OptimizedModule``, when that module is imported."""
    return _class(_DYNAMO_MODULE, "OptimizedModule")


# the module an OptimizedModule compiles, by its attribute's name; no public API; checked on 2.13 and 2.11.
COMPILED_ORIGINAL = "_orig_mod"


# the instance-dict key under which torch's composable APIs (checkpoint, replicate, fully_shard) record themselves on a module; no public API; checked on 2.13 and 2.11.
def composable_registry_key() -> str | None:
    """``torch.distributed._composable.contract.REGISTRY_KEY``, when that module is
    imported (``None`` otherwise: no composable API was applied)."""
    contract = sys.modules.get(_COMPOSABLE_MODULE)
    key: object = getattr(contract, "REGISTRY_KEY", None) if contract is not None else None
    return key if isinstance(key, str) else None


# the composable APIs the checks name, by registry name: their full names (for messages); no public path; checked on 2.13 and 2.11.
COMPOSABLE_APIS = {
    "checkpoint": "torch.distributed._composable.checkpoint",
    "replicate": "torch.distributed._composable.replicate",
}

# nn.Module's dict of its children, read from the instance dict; public: named_children (a generator over the same dict); checked on 2.13 and 2.11.
MODULE_CHILDREN = "_modules"

# set on a module by module.compile() (compiled in place); no public API; checked on 2.13 and 2.11.
COMPILED_CALL = "_compiled_call_impl"

# nn.Module's instance dicts of hooks (the with_kwargs, prepend and always_call variants are entries of the first two; full and non-full backward hooks of the last), each with what its hooks are called in messages; no public API lists a module's hooks; checked on 2.13 and 2.11.
MODULE_HOOK_DICTS = (
    ("_forward_pre_hooks", "forward pre-hook"),
    ("_forward_hooks", "forward hook"),
    ("_backward_pre_hooks", "backward pre-hook"),
    ("_backward_hooks", "backward hook"),
)

# the first of them: forward pre-hooks; checked on 2.13 and 2.11.
FORWARD_PRE_HOOKS = MODULE_HOOK_DICTS[0][0]

# a tensor's hooks on its gradient (register_hook, register_post_accumulate_grad_hook); no public API lists them; checked on 2.13 and 2.11.
GRAD_HOOKS = ("_backward_hooks", "_post_accumulate_grad_hooks")
