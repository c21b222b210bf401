"""Finds uses of torch's private names in source, for the one-module-per-subpackage rule.

A subpackage that uses private torch names keeps them in one module (its
``_torch_private.py``); its tests parse every other module with
:func:`private_torch_uses`. Unlike the integrations' rule (which refuses every private
attribute), the adapters and blocks also read their own and transformers' or torchtitan's
private names, so this check looks for torch's: a private torch module or name imported,
an attribute chain from ``torch`` with a private part, and a private attribute (or its
name as a string) that torch's objects have: the ``torch`` namespace, a module, a tensor,
an aten op, torch's checkpoint wrapper. ``self.`` and ``cls.`` are a class's own.
"""

from __future__ import annotations

import ast
import functools

import torch
from torch import nn


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _torch_module(module: str) -> bool:
    return module == "torch" or module.startswith("torch.")


@functools.cache
def _torch_names() -> frozenset[str]:
    """Private attribute names of torch's objects the source could reach."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    objects: list[object] = [torch, nn.Module(), torch.empty(0), CheckpointWrapper(nn.Linear(1, 1))]
    return frozenset(n for o in objects for n in dir(o) if _private(n))


def torch_private(name: str) -> bool:
    """``name`` is private and names something of torch's (or an aten op)."""
    return _private(name) and (name in _torch_names() or hasattr(torch.ops.aten, name))


def _root(node: ast.expr) -> ast.expr:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node


def _private_path(text: str) -> bool:
    return _torch_module(text) and any(map(_private, text.split(".")))


def private_torch_uses(source: str) -> list[str]:
    """``line: what`` for each use of a private torch name in ``source``."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [
                f"{node.lineno}: import {a.name}" for a in node.names if _private_path(a.name)
            ]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if not _torch_module(node.module):
                continue
            if _private_path(node.module):
                found.append(f"{node.lineno}: from {node.module} import ...")
            found += [
                f"{node.lineno}: from {node.module} import {a.name}"
                for a in node.names
                if _private(a.name)
            ]
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            root = _root(node)
            own = isinstance(node.value, ast.Name) and node.value.id in {"self", "cls"}
            from_torch = isinstance(root, ast.Name) and root.id == "torch"
            if from_torch or (not own and torch_private(node.attr)):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
            if _private_path(text) or torch_private(text):
                found.append(f"{node.lineno}: {text!r}")
    return list(dict.fromkeys(found))
