"""The argument table (``tests/test_arguments.py``) in debug mode, on a sample.

Debug mode checks every annotation before the library's own checks: a wrong argument must
still be the library's error naming it (a check that raises, ``len()`` of a 0-d tensor,
included), and what the library's specs accept must pass (NumPy integers where the hint
says ``int``). The whole table runs in debug mode when the session does
(``MOE_OVERLAP_DEBUG=1``); otherwise this reruns a sample of it in the session's debug
interpreter: every ``STRIDE``-th row, the rows debug mode once broke, the numpy test and the
named nonsense cases.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from moe_overlap import ConfigError, CudaGraphModule, ScheduleOptions
from moe_overlap.engine import DEBUG
from moe_overlap.plan import Costs, ScheduleGraph, SearchSpace
from moe_overlap.steps import Slot
from tests import test_arguments as table
from tests.conftest import DebugPython

STRIDE = 10
PAIRS = {f"{e.name}-{a.name}": (e, a) for e, a in table.PAIRS}
ONCE_BROKEN = ["register_expert_shards-names", "register_fsdp_experts-modules"]
"""Rows debug mode once broke: a check that raised a bare ``TypeError``; a valid example
whose other argument broke its annotation, so the error named that one."""
SAMPLE = [*sorted({*list(PAIRS)[::STRIDE], *ONCE_BROKEN}), "numpy", "named"]


def rerun(case: str) -> None:
    """One case of the table, run in this process (the debug interpreter calls it)."""
    if case == "numpy":
        table.test_numpy_integers_are_ints_and_stored_as_ints()
    elif case == "named":
        for call, match, hinted in table.NAMED_NONSENSE:
            table.test_named_nonsense_is_refused(call, match, hinted)
    else:
        entry, arg = PAIRS[case]
        with table.group_for(entry):
            table.test_a_wrong_argument_is_a_library_error_naming_it(entry, arg)


@pytest.mark.skipif(DEBUG, reason="the whole table runs in debug mode in this session")
@pytest.mark.parametrize("case", SAMPLE)
def test_the_table_in_debug_mode(debug_python: DebugPython, case: str) -> None:
    out = debug_python(
        f"""
        from moe_overlap.engine import DEBUG
        from tests.test_arguments_debug import rerun
        assert DEBUG
        rerun({case!r})
        print("ok")
        """
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip() == "ok"


def test_the_sample_names_rows_of_the_table() -> None:
    assert set(ONCE_BROKEN) <= set(PAIRS)
    assert len(SAMPLE) >= len(PAIRS) // STRIDE


# --- collections: a list or a generator where the hint says tuple ------------------------------

RECORDS: dict[str, tuple[Callable[[Any], object], list[object]]] = {
    "ScheduleOptions.recompute": (lambda v: ScheduleOptions(recompute=v), ["mlp"]),
    "GPTMoEConfig.recompute": (lambda v: table.tiny_config(recompute=v), ["norm"]),
    "GPTMoEConfig.cuda_graph_modules": (
        lambda v: table.tiny_config(cuda_graph_modules=v),
        [CudaGraphModule.attn],
    ),
    "Costs.moe": (lambda v: Costs(times={}, moe=v), [True, False]),
    "Costs.activation_bytes": (
        lambda v: Costs(times={}, moe=(True, False), activation_bytes=v),
        [1.0, 2.0],
    ),
    "ScheduleGraph.moe": (lambda v: ScheduleGraph(microbatches=2, moe=v), [True]),
    "SearchSpace.wgrad_share": (lambda v: SearchSpace(wgrad_share=v), [[Slot.MLP, 0.5]]),
    **{
        f"SearchSpace.{f.name}": (
            (lambda name: lambda v: SearchSpace(**{name: v}))(f.name),
            list(getattr(SearchSpace(), f.name)),
        )
        for f in dataclasses.fields(SearchSpace)
        if isinstance(getattr(SearchSpace(), f.name), tuple) and f.name != "wgrad_share"
    },
}
"""Record fields annotated ``tuple[X, ...]`` whose spec takes any collection (not all in the
table's valid examples): the field's maker and its items."""
ORDERED = {"Costs.moe", "Costs.activation_bytes", "ScheduleGraph.moe"}
"""Of :data:`RECORDS`, the fields whose order means something (one item per layer): a
set, whose order is its hashing's, is refused there."""


def _variants(items: list[object]) -> dict[str, Callable[[], object]]:
    """The collections of ``items`` a spec (``args.Items``) takes."""
    made: dict[str, Callable[[], object]] = {
        "list": lambda: list(items),
        "tuple": lambda: tuple(items),
        "generator": lambda: (x for x in items),
    }
    try:
        if len(set(map(hash, items))) == len(items):
            made["set"] = lambda: set(items)
    except TypeError:  # an unhashable item
        pass
    return made


def _collection_cases() -> Iterator[tuple[str, Callable[[], object]]]:
    """Every collection argument of the table's valid examples (each runnable here) and of
    :data:`RECORDS`, as each collection kind."""
    for entry in table.ENTRIES:
        if not entry.valid_runs:
            continue
        with table.group_for(entry):
            valid = entry.valid()
        for name, value in valid.items():
            if not isinstance(value, (tuple, list)):
                continue
            for kind, make in _variants(list(value)).items():

                def call(entry: table.Entry = entry, name: str = name, make: Any = make) -> object:
                    with table.group_for(entry):
                        return entry.call(**(entry.valid() | {name: make()}))

                yield f"{entry.name}-{name}-{kind}", call
    for name, (maker, items) in RECORDS.items():
        for kind, make in _variants(items).items():

            def record(maker: Callable[[Any], object] = maker, make: Any = make) -> object:
                return maker(make())

            yield f"{name}-{kind}", record


def accepted() -> dict[str, bool]:
    """Whether each collection case is accepted in this process's mode."""
    out: dict[str, bool] = {}
    for name, call in _collection_cases():
        try:
            call()
        except Exception:
            out[name] = False
        else:
            out[name] = True
    return out


def test_record_fields_take_any_collection_stored_as_a_tuple() -> None:
    """What the specs promise (a collection is any iterable but a string, bytes, a mapping or
    a tensor, stored as a tuple): in this process's mode, debug mode included."""
    for name, (maker, items) in RECORDS.items():
        field = name.partition(".")[2]
        for kind, make in _variants(items).items():
            if kind == "set" and name in ORDERED:
                with pytest.raises(ConfigError, match="a set has no order"):
                    maker(make())
                continue
            if kind == "set" and len(items) > 1:
                continue  # stored in the set's order
            record = maker(make())
            stored = getattr(record, field)
            assert type(stored) is tuple, (name, kind, stored)


@pytest.mark.skipif(DEBUG, reason="needs the two modes: run without MOE_OVERLAP_DEBUG")
def test_collections_are_accepted_alike_with_and_without_debug_mode(
    debug_python: DebugPython,
) -> None:
    """A list, a tuple, a generator or a set where the hint says ``tuple[X, ...]`` (or
    ``Sequence[X]``): accepted in debug mode exactly where the library's specs accept it
    without (a record's fields through its own check; a function's hint says ``Iterable``
    where its spec takes any collection)."""
    here = accepted()
    out = debug_python(
        """
        import json
        from moe_overlap.engine import DEBUG
        from tests.test_arguments_debug import accepted
        assert DEBUG
        print(json.dumps(accepted()))
        """
    )
    assert out.returncode == 0, out.stderr[-4000:]
    there: dict[str, bool] = json.loads(out.stdout.strip().splitlines()[-1])
    assert there.keys() == here.keys()
    differ = {
        name: "accepted without debug mode only" if ok else "accepted in debug mode only"
        for name, ok in here.items()
        if there[name] != ok
    }
    assert not differ, differ
    assert sum(here.values()) > 60, "the cases pass collections the specs accept"
