"""Import torchtitan 0.3.0 on an older torch (the H200 image's 2.11), for the benchmarks only.

torchtitan 0.3.0 is written against torch 2.13: some of its modules import names that
older torches lack (``torch.distributed.fsdp.DataParallelMeshDims`` first). Those names
belong to code paths a one-GPU model forward and backward never runs (FSDP, pipelining,
checkpointing, context parallelism), but the imports sit at module level, so the package
fails to import at all.

:func:`import_torchtitan` imports the torchtitan modules the benchmark uses. On a torch
that has every name it does nothing else. Otherwise, each time an import fails on a missing
``torch`` name (``cannot import name X from torch.Y``, ``No module named torch.Y``,
``module torch.Y has no attribute X``) it adds a **placeholder** for that one name and
tries again: a class whose construction or call raises ``NotImplementedError`` naming it,
so a placeholder that a code path does reach fails loudly instead of computing anything.
One argument is adapted too: torchtitan passes ``separate_full_blocks=True`` to flex
attention's ``create_block_mask``, which older torches do not take but always behave as
(see :func:`_create_block_mask_without_separate_full_blocks`). Every name added is returned (and the benchmarks write them to their results), so a run
says exactly what was patched. Nothing outside ``torch``'s own modules is touched, and
the library (``src/``) never imports this module.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
import sys
import types
from collections.abc import Sequence
from typing import Any, cast

import torch

__all__ = ["MODULES", "compile_flex", "import_torchtitan", "placeholder_names"]

MODULES: tuple[str, ...] = (
    "torchtitan.models.deepseek_v3",
    "torchtitan.components.loss",
    "torchtitan.models.common.attention",
    "torchtitan.models.common.moe",
    "torchtitan.models.common.token_dispatcher",
    "torchtitan.distributed.spmd_types",
)
"""What the benchmark and the adapter import from torchtitan."""

_ADDED: list[str] = []

_CANNOT = re.compile(r"cannot import name '([^']+)' from '([^']+)'")
_NO_MODULE = re.compile(r"No module named '([^']+)'")
_NO_ATTR = re.compile(r"module '([^']+)' has no attribute '([^']+)'")


_compile: Any = getattr(torch, "compile")  # noqa: B009 - partly unannotated: typed Any here


def placeholder_names() -> list[str]:
    """The ``torch`` names :func:`import_torchtitan` added, in the order added."""
    return list(_ADDED)


def _placeholder(qualname: str) -> type:
    def fail(*args: object, **kwargs: object) -> None:
        del args, kwargs
        raise NotImplementedError(
            f"{qualname} is a titan_compat placeholder (missing in torch {torch.__version__}); "
            "the code path that reached it needs a newer torch"
        )

    return type(
        qualname.rpartition(".")[2],
        (),
        {"__init__": fail, "__call__": fail, "__module__": qualname.rpartition(".")[0]},
    )


class _StubModule(types.ModuleType):
    """A missing ``torch`` submodule: every attribute is a placeholder."""

    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        value = _placeholder(f"{self.__name__}.{name}")
        setattr(self, name, value)
        _ADDED.append(f"{self.__name__}.{name}")
        return value


def _add_module(name: str) -> None:
    parent = name.rpartition(".")[0]
    if parent and parent not in sys.modules:
        try:
            importlib.import_module(parent)
        except ModuleNotFoundError:
            _add_module(parent)
    module = _StubModule(name)
    module.__path__ = []  # a package, so its own submodules can be stubbed too
    sys.modules[name] = module
    if parent:
        setattr(sys.modules[parent], name.rpartition(".")[2], module)
    _ADDED.append(f"{name} (module)")


def _add_name(module: str, name: str) -> None:
    target = importlib.import_module(module)
    setattr(target, name, _placeholder(f"{module}.{name}"))
    _ADDED.append(f"{module}.{name}")


def _patch(exc: BaseException) -> bool:
    """Add the placeholder ``exc`` asks for; False when it is not a missing torch name."""
    text = str(exc)
    if m := _CANNOT.search(text):
        name, module = m.group(1), m.group(2)
        if module.split(".")[0] == "torch":
            _add_name(module, name)
            return True
    if m := _NO_MODULE.search(text):
        module = m.group(1)
        if module.split(".")[0] == "torch":
            _add_module(module)
            return True
    if m := _NO_ATTR.search(text):
        module, name = m.group(1), m.group(2)
        if module.split(".")[0] == "torch" and module in sys.modules:
            _add_name(module, name)
            return True
    return False


def _create_block_mask_without_separate_full_blocks() -> None:
    """torchtitan 0.3.0 passes ``separate_full_blocks`` to flex attention's
    ``create_block_mask`` (new in torch 2.13, default ``True``: fully unmasked blocks are
    kept apart so the kernels skip ``mask_mod`` on them). Older torches always keep them
    apart, so on those the argument is dropped when ``True`` and refused when ``False``
    (torchtitan's batch-invariant mode, not used here)."""
    from torch.nn.attention import flex_attention as fa

    if "separate_full_blocks" in inspect.signature(fa.create_block_mask).parameters:
        return
    original: Any = fa.create_block_mask

    @functools.wraps(original)
    def create_block_mask(*args: Any, separate_full_blocks: bool = True, **kwargs: Any) -> Any:
        if not separate_full_blocks:
            raise NotImplementedError(
                f"create_block_mask(separate_full_blocks=False) needs torch >= 2.13 "
                f"(this is {torch.__version__})"
            )
        return original(*args, **kwargs)

    cast(Any, fa).create_block_mask = create_block_mask
    _ADDED.append(
        "torch.nn.attention.flex_attention.create_block_mask: separate_full_blocks=True "
        "dropped (this torch always separates full blocks)"
    )


def import_torchtitan(modules: Sequence[str] = MODULES, *, attempts: int = 60) -> list[str]:
    """Import ``modules``, adding placeholders for missing ``torch`` names as the module
    docstring says; return the names added (empty on a torch that has them all). A failure
    that is not a missing ``torch`` name is raised as it is."""
    if not any("create_block_mask" in x for x in _ADDED):
        _create_block_mask_without_separate_full_blocks()
    patched_masks = any("create_block_mask" in x for x in _ADDED)
    for _ in range(attempts):
        try:
            for module in modules:
                importlib.import_module(module)
        except (ImportError, AttributeError) as exc:
            if not _patch(exc):  # Python drops the modules whose import failed
                raise
            continue
        if patched_masks:  # torchtitan compiled the name it imported: compile the wrapper
            from torch.nn.attention.flex_attention import create_block_mask

            attention: Any = importlib.import_module("torchtitan.models.common.attention")
            attention._compiled_create_block_mask = _compile(create_block_mask)
        return placeholder_names()
    raise ImportError(f"torchtitan still fails to import after {attempts} placeholders")


def compile_flex(*, autotune: bool) -> dict[str, Any]:
    """torchtitan compiles flex attention with ``max_autotune`` and coordinate-descent
    tuning (minutes per shape). Without ``autotune`` the same flex kernels are compiled
    with inductor's default configs (torchtitan's other options kept), to fit a device
    budget; returns the options in force."""
    from torch.nn.attention.flex_attention import flex_attention

    flex: Any = importlib.import_module("torchtitan.models.common.attention").FlexAttention
    options: dict[str, Any] = dict(flex.inductor_configs)
    if not autotune:
        options |= {"max_autotune": False, "coordinate_descent_tuning": False}
        flex._compiled_flex_attn = _compile(flex_attention, options=options, dynamic=False)
    return options
