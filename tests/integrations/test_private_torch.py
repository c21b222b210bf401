"""Private torch names live in one module per integration (SPEC §12).

Every module of ``moe_overlap.integrations`` is parsed; outside the modules listed in
:data:`OWNERS` none may import a private torch module or name, read a private attribute
(``x._name``) of anything but ``self`` / ``cls``, or name one as a string
(``getattr(x, "_name")``). The integrations' own private helpers are module-level names
(``_helper``), never attributes, so the rule needs no list of torch's names.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import moe_overlap.integrations as integrations

PACKAGE = Path(integrations.__file__).resolve().parent

OWNERS = {"pipelining/_torch.py"}
"""The modules that hold an integration's private torch names (``fsdp``, ``checkpoint`` and
``_consensus`` use none)."""

_ATTRIBUTE_FUNCTIONS = {"getattr", "setattr", "hasattr", "delattr"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _torch_module(module: str) -> bool:
    return module == "torch" or module.startswith("torch.")


def private_torch_uses(source: str) -> list[str]:
    """``line: what`` for each use of a private torch name in ``source``."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _torch_module(alias.name) and any(map(_private, alias.name.split("."))):
                    found.append(f"{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if not _torch_module(node.module):
                continue
            if any(map(_private, node.module.split("."))):
                found.append(f"{node.lineno}: from {node.module} import ...")
            found += [
                f"{node.lineno}: from {node.module} import {a.name}"
                for a in node.names
                if _private(a.name)
            ]
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            owner = node.value
            if not (isinstance(owner, ast.Name) and owner.id in {"self", "cls"}):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _ATTRIBUTE_FUNCTIONS
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
        ):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


MODULES = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py"))


def test_the_owners_exist_and_every_integration_is_parsed() -> None:
    assert set(OWNERS) <= set(MODULES)
    assert {"fsdp.py", "checkpoint.py", "_consensus.py", "pipelining/_runtime.py"} <= set(MODULES)
    # The owner does use private torch names: the check below would see them elsewhere.
    assert private_torch_uses((PACKAGE / "pipelining/_torch.py").read_text())


@pytest.mark.parametrize("module", [m for m in MODULES if m not in OWNERS])
def test_no_private_torch_name_outside_its_module(module: str) -> None:
    uses = private_torch_uses((PACKAGE / module).read_text())
    assert not uses, f"integrations/{module} uses private torch names (move them to _torch): {uses}"


@pytest.mark.parametrize(
    "source",
    [
        "from torch.distributed.pipelining.schedules import _Action",
        "from torch.distributed.pipelining import _utils",
        "import torch._dynamo",
        "schedule._stages",
        "torch._C._set_grad_enabled(True)",
        "getattr(stage, '_runtime_validate', False)",
    ],
)
def test_the_check_sees_each_kind_of_use(source: str) -> None:
    assert private_torch_uses(source)


def test_the_check_allows_the_integrations_own_names() -> None:
    source = (
        "from moe_overlap.args import check_arg\n"
        "from moe_overlap.integrations.pipelining import _torch\n"
        "self._live.clear()\n"
        "type(x).__name__\n"
        "_torch.kinds()\n"
    )
    assert private_torch_uses(source) == []
