"""The schedule core (``engine/core``) imports no check: only itself, the standard library,
torch, typing_extensions and the shared top-level module ``moe_overlap.args``, which imports
nothing of the package but the errors. The checks attach to it through its hooks (guards,
the CPU stream model's observer); where the core keeps a piece a rule table also states, the
two agree."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
from torch import nn

from moe_overlap.engine._stream_check import (
    CPU_STREAM_OBSERVER,
    StreamOrderChecker,
    stream_order_check,
)
from moe_overlap.engine._stream_shake import STREAM_DELAY, shake
from moe_overlap.engine.contracts import FREE_INPUT_CONFIG, HOLDS_DELAYED_MODULES
from moe_overlap.engine.core import _stream_observer
from moe_overlap.engine.core._megatron import _CONFIG_FIELDS
from moe_overlap.engine.core._wgrad_claims import _holds_delayed_modules

SRC = Path(__file__).resolve().parents[2] / "src" / "moe_overlap"
CORE = SRC / "engine" / "core"
PACKAGE = "moe_overlap.engine.core"
ALLOWED = frozenset(sys.stdlib_module_names) | {"torch", "typing_extensions", "_typeshed"}
"""What the core may import besides itself (``_typeshed``: typing only, never imported)."""
SHARED = {"moe_overlap.args": {"moe_overlap.errors"}, "moe_overlap.errors": {f"{PACKAGE}._errors"}}
"""The shared top-level modules the core may import, each with what of the package it may
import in turn (the errors' classes are defined in the core and shown from ``errors``)."""


def imported(source: str) -> list[str]:
    """Every module ``source`` (a core module) imports, absolute, statically:
    ``TYPE_CHECKING`` blocks and function bodies included."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                found.append(node.module or "")
                continue
            base = PACKAGE.rsplit(".", node.level - 1)[0] if node.level > 1 else PACKAGE
            if node.module:
                found.append(f"{base}.{node.module}")
            else:  # from . import x: each name a module
                found += [f"{base}.{alias.name}" for alias in node.names]
    return found


def outside(source: str) -> list[str]:
    """The modules ``source`` imports that the core may not."""
    return [
        name
        for name in imported(source)
        if name != PACKAGE
        and not name.startswith(f"{PACKAGE}.")
        and name not in SHARED
        and name.split(".")[0] not in ALLOWED
    ]


def core_modules() -> list[Path]:
    return sorted(CORE.glob("*.py"))


def test_the_core_imports_only_itself_the_standard_library_and_torch() -> None:
    assert len(core_modules()) > 20
    found = {p.name: outside(p.read_text()) for p in core_modules()}
    assert {name: bad for name, bad in found.items() if bad} == {}


def test_the_rule_finds_an_import_from_outside_the_core() -> None:
    probe = (
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "import torch.nn\n"
        "from typing_extensions import Self\n"
        "from ._node import ScheduleNode\n"
        "from . import _hooks\n"
        "from moe_overlap.args import BOOL\n"
        "from .. import contracts\n"
        "from moe_overlap.engine._guards import attach\n"
        "from moe_overlap.engine._node_order_check import check_node_order\n"
        "from moe_overlap import steps\n"
        "import numpy\n"
        "if TYPE_CHECKING:\n"
        "    from .._guards import BaseGuard\n"
        "def f() -> None:\n"
        "    from moe_overlap.blocks import DelayedWgradModule\n"
    )
    assert outside(probe) == [
        "moe_overlap.engine.contracts",
        "moe_overlap.engine._guards",
        "moe_overlap.engine._node_order_check",
        "moe_overlap",
        "numpy",
        "moe_overlap.engine._guards",
        "moe_overlap.blocks",
    ]


@pytest.mark.parametrize("shared", sorted(SHARED))
def test_a_shared_module_imports_no_more_of_the_package_than_its_own_list(shared: str) -> None:
    """What the core may import outside itself reaches no check: ``moe_overlap.args`` imports
    only the errors, which import only the core's error classes."""
    source = (SRC / f"{shared.rsplit('.', 1)[1]}.py").read_text()
    package = {n for n in imported(source) if n.split(".")[0] == "moe_overlap"}
    assert package <= SHARED[shared], sorted(package - SHARED[shared])
    assert package, f"{shared} imports nothing of the package: is the list still needed?"


def _core_imports(module: str) -> set[str]:
    """The core modules ``module`` imports (annotations and function bodies included)."""
    names = imported((CORE / f"{module}.py").read_text())
    return {n.rsplit(".", 1)[1] for n in names if n.startswith(f"{PACKAGE}.")}


def test_the_protocols_import_nothing_that_imports_them_back() -> None:
    """core/_protocols.py's imports (annotations included) never reach it again."""
    seen: set[str] = set()
    todo = list(_core_imports("_protocols"))
    assert todo
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        todo += _core_imports(module)
    assert "_protocols" not in seen, sorted(seen)


def test_the_megatron_config_fields_are_the_rule_tables() -> None:
    """``layer_args`` names a config's missing fields in the order FREE_INPUT_CONFIG does."""
    assert FREE_INPUT_CONFIG.names == _CONFIG_FIELDS


class _Method:
    def delayed_modules(self) -> list[nn.Module]:
        return []


class _Value:
    delayed_modules = 3


class _NoneValue:
    delayed_modules = None


class _Missing:
    pass


class _Served:
    def __getattr__(self, name: str) -> object:
        if name == "delayed_modules":
            return list
        raise AttributeError(name)


@pytest.mark.parametrize(
    ("kind", "holds"),
    [(_Method, True), (_Value, False), (_NoneValue, False), (_Missing, False), (_Served, True)],
)
def test_a_claim_walks_what_the_holds_delayed_modules_table_accepts(
    kind: type, holds: bool
) -> None:
    part = kind()
    assert _holds_delayed_modules(part) is holds
    assert HOLDS_DELAYED_MODULES.conforms(part) is holds


def test_the_stream_checker_observes_the_cpu_streams_while_active() -> None:
    assert CPU_STREAM_OBSERVER.conforms(StreamOrderChecker())
    before = list(_stream_observer.observers)
    with stream_order_check() as checker:
        assert _stream_observer.observers[-1] is checker
    assert _stream_observer.observers == before


def test_race_shaking_delays_the_cuda_streams_while_active() -> None:
    before = list(_stream_observer.delays)
    with shake(3) as shaker:
        assert STREAM_DELAY.conforms(shaker)
        assert _stream_observer.delays[-1] is shaker
    assert _stream_observer.delays == before
