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

import pytest

from moe_overlap.engine import DEBUG
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
