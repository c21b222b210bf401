# The one module of moe_overlap.blocks that touches torch's private names.
"""torch's private names, as the building blocks use them; the releases they were checked on.

The other modules of ``moe_overlap.blocks`` reach torch's internals only through the names
here (``tests/blocks/test_private_torch.py`` parses them and fails on a private torch name
elsewhere), so a torch release that moves one breaks this module alone. Checked on torch
2.13 (CI, CPU) and torch 2.11 (the GPU machine, CUDA: the ``gpu``-marked tests) by the
tests of ``tests/blocks`` and ``tests/models``; each name below says what breaks if torch
moves or renames it.

- ``torch._grouped_mm`` (:func:`grouped_mm`, :func:`has_grouped_mm`): the grouped GEMM of
  :class:`~moe_overlap.blocks.DelayedWgradGroupedLinear` on Hopper in bf16. Gone or
  renamed, the layer runs one GEMM per group there, as it does off Hopper; with other
  arguments, its calls raise.
- ``torch.utils._pytree.tree_leaves`` (:func:`tree_leaves`): the tensors of a
  :class:`~moe_overlap.blocks.GraphedBlock`'s output (eager and captured). Moved, importing
  ``moe_overlap.blocks`` fails.
- the aten ops ``_grouped_mm`` and ``_scaled_dot_product_{flash,efficient,cudnn}_attention``
  (:data:`PRIVATE_MATMUL_OPS`): what the ``"attention"`` recompute policy
  (:func:`~moe_overlap.blocks.save_matmuls`) saves besides the public matrix products. An
  op that is gone is skipped: the policy recomputes its output instead of saving it.
- ``nn.ModuleList._modules`` (:func:`list_entries`): a module list's modules by name
  (:class:`~moe_overlap.blocks.StageLayers` joins two lists by it). Renamed, ``+`` of two
  stage layer lists raises ``AttributeError``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves as _tree_leaves

__all__ = ["PRIVATE_MATMUL_OPS", "grouped_mm", "has_grouped_mm", "list_entries", "tree_leaves"]

PRIVATE_MATMUL_OPS: tuple[str, ...] = (
    "_grouped_mm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)
"""The private aten ops that are matrix products (looked up on ``torch.ops.aten``; one
that is missing is skipped)."""


def has_grouped_mm() -> bool:
    """Whether this torch has ``torch._grouped_mm``."""
    return hasattr(torch, "_grouped_mm")


def grouped_mm(mat_a: Tensor, mat_b: Tensor, *, offs: Tensor) -> Tensor:
    """``torch._grouped_mm(mat_a, mat_b, offs=offs)``: the groups of rows ``offs`` ends
    (``int32`` cumulative sizes on the device), each times its own matrix."""
    return torch._grouped_mm(mat_a, mat_b, offs=offs)  # pyright: ignore[reportPrivateUsage, reportPrivateImportUsage] - no public grouped GEMM yet


def tree_leaves(tree: object) -> list[Any]:
    """The leaves of a nested structure of tuples, lists and dicts, in order."""
    return _tree_leaves(tree)


def list_entries(layers: nn.ModuleList) -> dict[str, nn.Module]:
    """A module list's registry of its modules, by name (the live dict: writes change the
    list)."""
    return layers._modules  # pyright: ignore[reportPrivateUsage]
