"""The microbatch-level schedule as data: pure, without a tensor."""

from __future__ import annotations

import re

import pytest

from moe_overlap import ConfigError
from moe_overlap.steps import (
    Direction,
    MacroStep,
    ScheduleMode,
    Step,
    backward_microbatches,
    format_macro,
    forward_microbatches,
    macro_steps,
    parse_macro,
)

F, B = Direction.FORWARD, Direction.BACKWARD

MODES = tuple(ScheduleMode)


def _today(n: int, mode: ScheduleMode) -> list[str]:
    """The order combined_1f1b ran before the schedule was data (its three branches)."""
    if mode is ScheduleMode.SERIAL:
        return [s for i in range(n) for s in (f"F{i}", f"B{i}")]
    if n == 0:
        return []
    if mode is ScheduleMode.FILL_DRAIN and n >= 2:
        return ["F0+F1", *(f"F{i}+B{i - 2}" for i in range(2, n)), f"B{n - 2}+B{n - 1}"]
    return ["F0", *(f"F{i}+B{i - 1}" for i in range(1, n)), f"B{n - 1}"]


@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
@pytest.mark.parametrize("n", range(9))
def test_every_mode_and_size_is_todays_order(n: int, mode: ScheduleMode) -> None:
    steps = macro_steps(n, mode)
    assert [format_macro([s]) for s in steps] == _today(n, mode)
    assert parse_macro(format_macro(steps)) == steps
    assert all(parse_macro(format_macro([s])) == (s,) for s in steps)
    forwards = [i for s in steps for i in forward_microbatches(s)]
    backwards = [i for s in steps for i in backward_microbatches(s)]
    assert forwards == list(range(n)) and backwards == list(range(n))
    for k, step in enumerate(steps):  # each backward after its forward, two at most
        assert 1 <= len(step) <= 2
        assert all(s == Step(s.direction, s.microbatch) for s in step)  # microbatch steps
        done = {i for s in steps[:k] for i in forward_microbatches(s)}
        assert set(backward_microbatches(step)) <= done


def test_the_mode_of_the_driver_flags() -> None:
    assert ScheduleMode.of(overlap=False, fill_drain=False) is ScheduleMode.SERIAL
    assert ScheduleMode.of(overlap=True, fill_drain=False) is ScheduleMode.OVERLAPPED
    assert ScheduleMode.of(overlap=True, fill_drain=True) is ScheduleMode.FILL_DRAIN


def test_string_forms() -> None:
    steps = macro_steps(3, ScheduleMode.OVERLAPPED)
    assert format_macro(steps) == "F0 | F1+B0 | F2+B1 | B2"
    drain: MacroStep = (Step(B, 2), Step(B, 3))
    assert parse_macro("B2+B3") == (drain,)
    assert parse_macro("F0+F1") == ((Step(F, 0), Step(F, 1)),)
    assert parse_macro(" F1+B0 |B1") == ((Step(F, 1), Step(B, 0)), (Step(B, 1),))
    assert forward_microbatches(drain) == () and backward_microbatches(drain) == (2, 3)
    assert parse_macro("") == ()


_JOINED = "'+'-joined F<i> and B<i> (forwards first)"
_TWO = "at most two parts, forwards before backwards"


@pytest.mark.parametrize(
    ("text", "rule"),
    [
        *[
            (t, _JOINED)
            for t in (" ", "F", "X1", "F0,B1", "f0", "W1", "F1@comp", "f.F1", "F0 + B1")
        ],
        *[(t, _TWO) for t in ("B0+F1", "F0+F1+F2", "F01")],
    ],
)
def test_a_malformed_step_is_refused(text: str, rule: str) -> None:
    """The same rules and words as before a macro step's parts were steps."""
    with pytest.raises(ConfigError, match=re.escape(f"parse_macro: expected {rule}")):
        parse_macro(f"F0 | {text}")


def test_arguments_are_checked() -> None:
    with pytest.raises(ConfigError, match="macro_steps: n"):
        macro_steps(-1, ScheduleMode.SERIAL)
    with pytest.raises(ConfigError, match="macro_steps: mode"):
        macro_steps(2, "serial")  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
