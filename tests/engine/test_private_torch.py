"""torch's private names in ``moe_overlap.engine`` live in one module per place.

The engine has two places: the schedule core (``core/``), whose names live in
``core/_torch_private.py``, and the checks (every other module), whose names live in
``_torch_private.py``. Every other module is parsed (:mod:`tests.private_torch`); a private
torch name there fails, so a torch release that moves one breaks its owner alone. Like the
check, a private module path or a private attribute's name as a string counts as a use.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import moe_overlap.engine as engine
from tests.private_torch import private_torch_uses

PACKAGE = Path(engine.__file__).resolve().parent
OWNERS = {
    "core/_torch_private.py": (
        "torch.autograd.Variable._execution_engine",
        "torch._C._is_multithreading_enabled",
        "torch._C._set_multithreading_enabled",
        "torch._C._set_grad_enabled",
    ),
    "_torch_private.py": (
        "from torch.utils._python_dispatch import",
        "torch._C._storage_Use_Count",
        "torch.cuda._sleep",
        "'_cdata'",
        "'_base'",
        "'_use_count'",
        "'torch.distributed._composable.contract'",
        "'_compiled_call_impl'",
        "'_post_accumulate_grad_hooks'",
    ),
}
"""Each place's owner and names the check must see in it."""

MODULES = sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py"))

UNSEEN = frozenset(
    {"_cuda_getDevice", "_cuda_getCurrentStream", "_cuda_setStream", "_schema", "_orig_mod"}
)
"""torch names the owners hold that :func:`private_torch_uses` cannot see from this build's
objects (``torch._C``'s CUDA calls are absent from CPU builds; an op's schema and a compiled
module's original are attributes of objects it does not list): looked for by name here."""


def _unseen_uses(source: str) -> list[str]:
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in UNSEEN:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Constant) and node.value in UNSEEN:
            found.append(f"{node.lineno}: {node.value!r}")
    return found


def test_every_module_is_parsed() -> None:
    assert len(MODULES) > 40
    assert set(OWNERS) <= set(MODULES)


@pytest.mark.parametrize("owner", sorted(OWNERS))
def test_the_owner_uses_private_torch_names(owner: str) -> None:
    """The check sees each owner's names: it would see them elsewhere."""
    source = (PACKAGE / owner).read_text()
    uses = "\n".join(private_torch_uses(source))
    for name in OWNERS[owner]:
        assert name in uses
    unseen = "\n".join(_unseen_uses(source))
    cuda = {"_cuda_getDevice", "_cuda_getCurrentStream", "_cuda_setStream"}
    expected = cuda if owner.startswith("core/") else UNSEEN - cuda
    assert {name for name in UNSEEN if f"'{name}'" in unseen} == expected


@pytest.mark.parametrize("module", [m for m in MODULES if m not in OWNERS])
def test_no_private_torch_name_outside_its_module(module: str) -> None:
    owner = "core/_torch_private.py" if module.startswith("core/") else "_torch_private.py"
    source = (PACKAGE / module).read_text()
    uses = private_torch_uses(source) + _unseen_uses(source)
    assert not uses, f"engine/{module} uses private torch names (move them to {owner}): {uses}"


@pytest.mark.parametrize(
    "source",
    [
        "torch.autograd.Variable._execution_engine.run_backward",
        "_set = torch._C._set_multithreading_enabled",
        "storage._cdata",
        "base = out._base",
        "getattr(Tensor, '_use_count', None)",
        "sys.modules.get('torch.distributed._composable.contract')",
        "attrs.get('_compiled_call_impl')",
        "getattr(t, '_post_accumulate_grad_hooks', None)",
    ],
)
def test_the_check_sees_the_engines_kinds_of_use(source: str) -> None:
    assert private_torch_uses(source)


@pytest.mark.parametrize(
    "source",
    ["getattr(_C, '_cuda_setStream', None)", "schema = func._schema", "attrs.get('_orig_mod')"],
)
def test_the_unseen_names_are_found_by_name(source: str) -> None:
    assert private_torch_uses(source) == []
    assert _unseen_uses(source)
