"""The schedule as data: order of a layer pair and of a chunk, without running tensors."""

from __future__ import annotations

import itertools
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moe_overlap import ConfigError
from moe_overlap.steps import (
    ChunkShape,
    Direction,
    LayerShape,
    Role,
    Slot,
    Step,
    StreamKind,
    chunk_steps,
    format_steps,
    layer_pair_steps,
)


def names(steps: list[Step]) -> list[str]:
    return [str(s) for s in steps]


def moe(
    index: int,
    *,
    delay_wgrad: bool = False,
    has_mtp_post: bool = False,
    early_attn_release: bool = False,
) -> LayerShape:
    return LayerShape(
        index=index,
        is_moe=True,
        delay_wgrad=delay_wgrad,
        has_mtp_post=has_mtp_post,
        early_attn_release=early_attn_release,
    )


def test_layer_pair_order_matches_spec() -> None:
    # SPEC §4: b.combine.bwd | f.pre_dispatch.fwd | b.mlp.bwd | f.dispatch.fwd |
    # b.mlp.wgrad, b.dispatch.bwd | f.mlp.fwd | f.combine.fwd | b.pre_dispatch.bwd |
    # f.mtp_post.fwd | b.pre_dispatch.wgrad
    f = moe(1, has_mtp_post=True)
    b = moe(0, delay_wgrad=True)
    assert names(layer_pair_steps(f, b)) == [
        "b.L0.combine.B@comm",
        "f.L1.pre_dispatch.F@comp",
        "b.L0.mlp.B@comp",
        "f.L1.dispatch.F@comm",
        "b.L0.mlp.W@comp",
        "b.L0.dispatch.B@comm",
        "f.L1.mlp.F@comp",
        "f.L1.combine.F@comm",
        "b.L0.pre_dispatch.B@comp",
        "f.L1.mtp_post.F@comp",
        "b.L0.pre_dispatch.W@comp",
    ]


def test_early_attention_release_moves_pre_dispatch_backward() -> None:
    steps = names(layer_pair_steps(moe(0), moe(0, early_attn_release=True)))
    assert steps == [
        "b.L0.combine.B@comm",
        "f.L0.pre_dispatch.F@comp",
        "b.L0.mlp.B@comp",
        "f.L0.dispatch.F@comm",
        "b.L0.dispatch.B@comm",
        "b.L0.pre_dispatch.B@comp",
        "f.L0.mlp.F@comp",
        "f.L0.combine.F@comm",
    ]


def test_last_backward_layer_leaves_its_wgrad_to_the_chunk() -> None:
    steps = layer_pair_steps(None, moe(0, delay_wgrad=True), is_last_layer_in_bwd=True)
    assert "b.L0.pre_dispatch.W@comp" not in names(steps)
    assert "b.L0.mlp.W@comp" in names(steps)


def test_dense_layers_have_no_comm_steps() -> None:
    dense = LayerShape(index=0, is_moe=False)
    steps = layer_pair_steps(dense, dense)
    assert all(s.stream is StreamKind.COMP for s in steps)
    assert names(steps) == [
        "f.L0.pre_dispatch.F@comp",
        "b.L0.mlp.B@comp",
        "f.L0.mlp.F@comp",
        "b.L0.pre_dispatch.B@comp",
    ]


def test_mtp_post_backward_comes_first() -> None:
    steps = layer_pair_steps(None, moe(0, has_mtp_post=True))
    assert str(steps[0]) == "b.L0.mtp_post.B@comp"


def test_chunk_phases() -> None:
    f = ChunkShape(layers=(moe(0), moe(1), moe(2)))
    b = ChunkShape(layers=(moe(0, delay_wgrad=True), moe(1, delay_wgrad=True)))
    steps = chunk_steps(
        f, b, pre_forward=True, pre_backward=True, post_forward=True, post_backward=True
    )
    text = names(steps)
    assert text[:4] == [
        "f.pre_forward.H@host",
        "f.pre_process.F@comp",
        "b.pre_backward.H@host",
        "b.post_process.B@comp",
    ]
    # forward layer i is paired with backward layer n-1-i
    pairs = [
        (s.layer, t.layer)
        for s, t in itertools.pairwise(steps)
        if s.role is Role.B and s.slot is Slot.COMBINE and t.role is Role.F
    ]
    assert pairs == [(1, 0), (0, 1)]
    # the leftover forward layer runs alone after the pairs
    leftover = [s for s in steps if s.layer == 2]
    assert all(s.role is Role.F for s in leftover)
    assert text[-5:] == [
        "f.post_forward.H@host",
        "b.post_backward.H@host",
        "b.L0.pre_dispatch.W@comp",
        "f.post_process.F@comp",
        "b.pre_process.B@comp",
    ]
    # every node of both microbatches appears exactly once per direction
    assert len(set(text)) == len(text)


def test_leftover_backward_layers_run_before_leftover_forward() -> None:
    f = ChunkShape(layers=(moe(0),))
    b = ChunkShape(layers=(moe(0), moe(1), moe(2)))
    steps = chunk_steps(f, b)
    b_layers_alone = [s.layer for s in steps if s.role is Role.B and s.slot is Slot.COMBINE]
    assert b_layers_alone == [2, 1, 0]
    f2 = ChunkShape(layers=(moe(0), moe(1), moe(2)))
    steps2 = chunk_steps(f2, ChunkShape(layers=(moe(0),)))
    last_b = max(i for i, s in enumerate(steps2) if s.role is Role.B and s.layer is not None)
    first_alone_f = min(i for i, s in enumerate(steps2) if s.layer == 1)
    assert last_b < first_alone_f


def test_forward_only_and_backward_only() -> None:
    shape = ChunkShape(layers=(moe(0), moe(1)))
    fwd = chunk_steps(shape, None)
    assert all(s.role is Role.F for s in fwd)
    assert [s.direction for s in fwd] == [Direction.FORWARD] * len(fwd)
    bwd = chunk_steps(None, shape)
    assert all(s.role is Role.B for s in bwd)
    assert str(bwd[0]) == "b.post_process.B@comp"
    assert str(bwd[-1]) == "b.pre_process.B@comp"


step_strategy = st.builds(
    Step,
    st.sampled_from(Direction),
    microbatch=st.one_of(st.none(), st.integers(0, 10**6)),
    role=st.one_of(st.none(), st.sampled_from(Role)),
    layer=st.one_of(st.none(), st.integers(0, 10**6)),
    slot=st.one_of(st.none(), st.sampled_from(Slot)),
    stream=st.one_of(st.none(), st.sampled_from(StreamKind)),
)


@given(step_strategy)
def test_step_string_round_trips(step: Step) -> None:
    assert Step.parse(str(step)) == step


def test_every_combination_of_levels_round_trips() -> None:
    """Each field present or absent, every kind's every value: one text each, read back."""
    seen: set[str] = set()
    for direction, microbatch, role, layer, slot, stream in itertools.product(
        Direction,
        (None, 0, 17),
        (None, *Role),
        (None, 0, 3),
        (None, *Slot),
        (None, *StreamKind),
    ):
        step = Step(direction, microbatch, role, layer, slot, stream)
        text = str(step)
        assert Step.parse(text) == step, text
        seen.add(text)
    assert len(seen) == 4 * 3 * 5 * 3 * (len(Slot) + 1) * 4  # no two steps print alike


@pytest.mark.parametrize(
    ("text", "step"),
    [
        ("F1", Step(Direction.FORWARD, 1)),
        ("b.combine.B", Step(Direction.BACKWARD, role=Role.B, slot=Slot.COMBINE)),
        (
            "b.L3.combine.B@comm",
            Step(
                Direction.BACKWARD, role=Role.B, layer=3, slot=Slot.COMBINE, stream=StreamKind.COMM
            ),
        ),
        (
            "f.L0.mlp.F2@comp",
            Step(Direction.FORWARD, 2, Role.F, 0, Slot.MLP, StreamKind.COMP),
        ),
        (
            "f.pre_forward.H@host",
            Step(Direction.HOOK, None, Role.F, None, Slot.PRE_FORWARD, StreamKind.HOST),
        ),
    ],
)
def test_the_text_forms_of_each_level(text: str, step: Step) -> None:
    assert Step.parse(text) == step
    assert str(step) == text


@pytest.mark.parametrize(
    "bad",
    ["", "x.L0.mlp.F@comp", "f.L0.mlp.Q@comp", "F-1", "f1", "F1+B0", " F1", "L.F", "f.L0.mlp.F@"],
)
def test_step_parse_rejects_what_the_grammar_does_not_give(bad: str) -> None:
    expected = re.escape("Step.parse: expected '[role.][L<layer>.][slot.]D[<microbatch>][@stream]'")
    with pytest.raises(ConfigError, match=f"{expected}.*received {re.escape(repr(bad))}"):
        Step.parse(bad)


@pytest.mark.parametrize("bad", ["f.L0.nope.F@comp", "f.mlp.F@gpu", "attention.B"])
def test_step_parse_names_an_unknown_slot_or_stream(bad: str) -> None:
    with pytest.raises(ConfigError, match=f"unknown slot or stream in {re.escape(repr(bad))}"):
        Step.parse(bad)


def test_format_steps_marks_the_error() -> None:
    steps = layer_pair_steps(moe(0), moe(0))
    text = format_steps(steps, mark=3, context=1)
    lines = text.splitlines()
    assert len(lines) == 3
    assert lines[1].endswith("<-- ERROR HERE")
    assert "f.L0.dispatch.F@comm" in lines[1]
