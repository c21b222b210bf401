"""torch's private names in ``moe_overlap.adapters`` live in ``_torch_private.py`` alone.

Every other module of the subpackage is parsed (:mod:`tests.private_torch`); a private
torch name there fails, so a torch release that moves one breaks that module alone. The
adapters' reads of transformers' and torchtitan's private names are not torch's and pass.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import moe_overlap.adapters as adapters
from tests.private_torch import private_torch_uses

PACKAGE = Path(adapters.__file__).resolve().parent
OWNER = "_torch_private.py"
MODULES = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py"))


def test_the_owner_uses_private_torch_names() -> None:
    """The check sees the owner's names: it would see them elsewhere."""
    uses = "\n".join(private_torch_uses((PACKAGE / OWNER).read_text()))
    for name in ("._modules", "._parameters", "._version", "_checkpoint_wrapped_module"):
        assert name in uses


@pytest.mark.parametrize("module", [m for m in MODULES if m != OWNER])
def test_no_private_torch_name_outside_its_module(module: str) -> None:
    uses = private_torch_uses((PACKAGE / module).read_text())
    assert not uses, f"adapters/{module} uses private torch names (move them to {OWNER}): {uses}"


@pytest.mark.parametrize(
    "source",
    [
        "import torch._dynamo",
        "from torch.utils import _pytree",
        "from torch.utils._python_dispatch import TorchDispatchMode",
        "torch._C._set_grad_enabled(True)",
        "parent._modules[name] = stand_in",
        "module._parameters.items()",
        "tensor._version",
        "t._cdata",
        "getattr(torch, '_grouped_mm')",
        "sys.modules.get('torch.distributed.algorithms._checkpoint.checkpoint_wrapper')",
        "wrapper._modules.get('_checkpoint_wrapped_module')",
    ],
)
def test_the_check_sees_each_kind_of_use(source: str) -> None:
    assert private_torch_uses(source)


def test_the_check_allows_own_and_other_libraries_names() -> None:
    source = (
        "self._modules.items()\n"
        "object.__getattribute__(self, '_experts')\n"
        "getattr(config, '_experts_implementation', None)\n"
        "getattr(type(base), '_can_record_outputs', None)\n"
        "out._count = 0\n"
        "type(x).__name__\n"
    )
    assert private_torch_uses(source) == []
