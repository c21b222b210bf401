"""The schedule core (``engine/core``) imports no check: only itself, the standard library,
torch, typing_extensions and the shared top-level modules ``moe_overlap.args``,
``moe_overlap.errors``, ``moe_overlap.microbatch`` and ``moe_overlap.protocols``, which import
nothing of the package at import time but each other. The checks attach to it through its
hooks (guards, the CPU stream model's observer); where the core keeps a piece a rule table
also states, the two agree."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
from torch import nn

from moe_overlap.engine._core_args import _CONFIG_FIELDS
from moe_overlap.engine._stream_check import (
    CPU_STREAM_OBSERVER,
    StreamOrderChecker,
    stream_order_check,
)
from moe_overlap.engine._stream_shake import STREAM_DELAY, shake
from moe_overlap.engine.contracts import FREE_INPUT_CONFIG, HOLDS_DELAYED_MODULES
from moe_overlap.engine.core import _stream_observer
from moe_overlap.engine.core._wgrad_claims import _holds_delayed_modules

SRC = Path(__file__).resolve().parents[2] / "src" / "moe_overlap"
CORE = SRC / "engine" / "core"
PACKAGE = "moe_overlap.engine.core"
ALLOWED = frozenset(sys.stdlib_module_names) | {"torch", "typing_extensions", "_typeshed"}
"""What the core may import besides itself (``_typeshed``: typing only, never imported)."""
SHARED: dict[str, set[str]] = {
    "moe_overlap.args": {"moe_overlap.errors"},
    "moe_overlap.errors": set(),
    "moe_overlap.microbatch": {"moe_overlap.args", "moe_overlap.errors"},
    "moe_overlap.protocols": set(),
}
"""The shared top-level modules the core may import, each with what of the package it
imports in turn at import time: only the shared modules, never the engine."""
DEFERRED: dict[str, set[str]] = {
    "moe_overlap.args": set(),
    "moe_overlap.errors": set(),
    "moe_overlap.microbatch": set(),
    "moe_overlap.protocols": {
        f"{PACKAGE}._state",  # ChunkState, LayerState: annotations only
        f"{PACKAGE}._steps",  # Step: annotations only
        f"{PACKAGE}._streams",  # AnyStream: annotations only
        "moe_overlap.engine.contracts",  # Contract, contract_of: read on first use
    },
}
"""What of the package each shared module names but does not import at import time: in
``if TYPE_CHECKING:`` blocks (annotations) and function bodies (attributes read lazily)."""


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


def imported_at_import(source: str) -> list[str]:
    """The modules ``source`` (a top-level module) imports when it is imported: its
    module-level imports, without ``if TYPE_CHECKING:`` blocks and function bodies."""
    found: list[str] = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "a top-level module imports absolutely"
            found.append(node.module or "")
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
        "from moe_overlap.microbatch import Microbatch\n"
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
def test_a_shared_module_imports_only_the_shared_modules_at_import(shared: str) -> None:
    """What the core may import outside itself reaches no check and no engine module when it
    is imported: ``moe_overlap.args`` imports only the errors, ``moe_overlap.microbatch`` the
    argument specs and the errors; the errors and the Protocols import nothing of the package
    (their other names are for annotations, or read lazily), so the core importing them starts
    no import cycle."""
    source = (SRC / f"{shared.rsplit('.', 1)[1]}.py").read_text()
    now = {n for n in imported_at_import(source) if n.split(".")[0] == "moe_overlap"}
    assert now == SHARED[shared], sorted(now ^ SHARED[shared])
    assert SHARED[shared] <= set(SHARED)
    later = {n for n in imported(source) if n.split(".")[0] == "moe_overlap"} - now
    assert later == DEFERRED[shared], sorted(later ^ DEFERRED[shared])


def test_the_protocols_read_the_rule_tables_on_first_use() -> None:
    """``Contract`` and ``contract_of`` stay importable from ``moe_overlap.protocols``."""
    from moe_overlap import protocols
    from moe_overlap.engine import contracts

    assert protocols.Contract is contracts.Contract
    assert protocols.contract_of is contracts.contract_of
    with pytest.raises(AttributeError, match="no attribute 'Contracts'"):
        _ = protocols.Contracts


def test_the_import_time_rule_skips_annotations_and_function_bodies() -> None:
    probe = (
        "from typing import TYPE_CHECKING\n"
        "from moe_overlap.errors import ConfigError\n"
        "if TYPE_CHECKING:\n"
        "    from moe_overlap.engine.core._state import ChunkState\n"
        "def f() -> None:\n"
        "    from moe_overlap.engine import contracts\n"
    )
    assert imported_at_import(probe) == ["typing", "moe_overlap.errors"]


def _core_imports(module: str) -> set[str]:
    """The core modules ``module`` imports (annotations and function bodies included)."""
    names = imported((CORE / f"{module}.py").read_text())
    return {n.rsplit(".", 1)[1] for n in names if n.startswith(f"{PACKAGE}.")}


def test_the_protocols_import_nothing_that_imports_them_back() -> None:
    """``moe_overlap.protocols``'s imports of the core (annotations included) never reach it
    again, so debug mode can load it before the rest of the package."""
    names = imported((SRC / "protocols.py").read_text())
    todo = [n.rsplit(".", 1)[1] for n in names if n.startswith(f"{PACKAGE}.")]
    assert todo
    seen: set[str] = set()
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        todo += _core_imports(module)
        assert "moe_overlap.protocols" not in imported((CORE / f"{module}.py").read_text()), module


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
