"""The one runner's step lists: every macro step kind, and what it refuses."""

from __future__ import annotations

import pytest

from moe_overlap import ConfigError
from moe_overlap.steps import (
    ChunkShape,
    LayerShape,
    backward_pair_steps,
    chunk_steps,
    forward_pair_steps,
    macro_node_steps,
)

A = ChunkShape(layers=(LayerShape(index=0, is_moe=True), LayerShape(index=1, is_moe=False)))
C = ChunkShape(layers=A.layers, has_post_process=False)


def test_each_macro_step_kind_lists_its_runs_steps() -> None:
    assert macro_node_steps([], []) == chunk_steps(None, None) == []
    assert macro_node_steps([A], []) == chunk_steps(A, None)
    assert macro_node_steps([], [A]) == chunk_steps(None, A)
    assert macro_node_steps([A], [C], pre_forward=True, post_backward=True) == chunk_steps(
        A, C, pre_forward=True, post_backward=True
    )
    assert macro_node_steps([A, C], []) == forward_pair_steps(A, C)
    assert macro_node_steps([], [A, C]) == backward_pair_steps(A, C)


@pytest.mark.parametrize(
    ("forward", "backward", "hooks", "match"),
    [
        ([A, A, A], [], False, r"received 3 forwards and 0 backwards$"),
        ([A], [A, C], False, r"received 1 forwards and 2 backwards$"),
        ([A, C], [A], False, r"received 2 forwards and 1 backwards$"),
        ([A, C], [], True, r"received 2 forwards and 0 backwards with hooks$"),
    ],
)
def test_other_kinds_are_refused(
    forward: list[ChunkShape], backward: list[ChunkShape], hooks: bool, match: str
) -> None:
    with pytest.raises(
        ConfigError, match=r"macro_node_steps: expected at most one forward.*" + match
    ):
        macro_node_steps(forward, backward, pre_forward=hooks)
