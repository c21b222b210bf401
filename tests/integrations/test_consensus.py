"""The step consensus's verdict: when nothing of a failed step can be in flight."""

from __future__ import annotations

import pytest

from moe_overlap.integrations._consensus import Phase, Verdict

OK, BEFORE, AFTER, DURING = Phase.OK, Phase.BEFORE, Phase.AFTER, Phase.DURING


@pytest.mark.parametrize(
    ("phases", "consistent"),
    [
        ((OK, OK), True),
        ((OK, AFTER), True),  # every rank's communication completed
        ((AFTER, AFTER), True),
        ((BEFORE, BEFORE), True),  # no rank communicated
        ((BEFORE, OK), False),  # one rank communicated with a rank that did not
        ((BEFORE, AFTER), False),
        ((DURING, OK), False),
        ((DURING, DURING), False),
        ((BEFORE, DURING), False),
    ],
)
def test_consistent_only_when_nothing_can_be_in_flight(
    phases: tuple[Phase, ...], consistent: bool
) -> None:
    verdict = Verdict(dict(enumerate(phases)))
    assert verdict.consistent is consistent
    assert verdict.failed == [r for r, p in enumerate(phases) if p != OK]


def test_one_process_is_always_consistent_and_describes_the_failed_ranks() -> None:
    assert Verdict({0: DURING}, single_process=True).consistent
    verdict = Verdict({0: OK, 1: DURING, 3: AFTER, 2: OK})
    assert verdict.describe() == (
        "global rank 1 (while the step communicated), "
        "global rank 3 (after the step's communication completed)"
    )
