"""The inputs a model reads: declared, defaulted, refused at plan build when unread."""

from __future__ import annotations

import copy
from collections.abc import Collection
from typing import Any

import pytest
import torch
from torch import Tensor

from moe_overlap import (
    ChunkState,
    ConfigError,
    IntegrationError,
    Microbatch,
    ModelChunkSchedulePlan,
    combined_1f1b,
)
from moe_overlap.inputs import (
    DEFAULT_INPUTS,
    OPTIONAL_INPUTS,
    DeclaresInputs,
    ValidatesInputs,
    check_inputs,
    read_inputs,
)
from moe_overlap.megatron import build_schedule_plan
from moe_overlap.models import GPTMoEConfig, GPTMoEModel, GPTMoEStage

from .test_parity import assert_same
from .toy_model import ToyConfig, ToyModel, grads, make_microbatches, plain_step

CONFIG = ToyConfig()
MASK = torch.zeros(2, 8, dtype=torch.bool)

# One set value per optional input the toy model does not read by default.
UNREAD: dict[str, object] = {
    "attention_mask": torch.zeros(2, 1, 8, 8, dtype=torch.bool),
    "loss_mask": torch.ones(2, 8),
    "padding_mask": MASK,
    "packed_seq_params": object(),
    "extra_block_kwargs": {"k": 1},
    "runtime_gather_output": False,
}


def test_the_default_is_positions_and_labels() -> None:
    assert {"position_ids", "labels"} == DEFAULT_INPUTS
    assert read_inputs(ToyModel(CONFIG, "m")) == DEFAULT_INPUTS
    assert set(OPTIONAL_INPUTS) >= DEFAULT_INPUTS
    assert read_inputs(GPTMoEModel(GPTMoEConfig(num_layers=1))) == {
        "position_ids",
        "attention_mask",
        "labels",
        "loss_mask",
        "padding_mask",
    }
    assert isinstance(GPTMoEModel(GPTMoEConfig(num_layers=1)), DeclaresInputs)
    assert isinstance(GPTMoEModel(GPTMoEConfig(num_layers=1)), ValidatesInputs)
    assert not isinstance(ToyModel(CONFIG, "m"), DeclaresInputs)


@pytest.mark.parametrize("field", sorted(UNREAD))
def test_an_unread_field_is_refused_before_any_step(field: str) -> None:
    model = ToyModel(CONFIG, "dm")
    mbs = make_microbatches(3, CONFIG)
    last = Microbatch(**{**_fields(mbs[2]), field: UNREAD[field]})
    with pytest.raises(
        ConfigError, match=rf"microbatches\[2\]: Microbatch field {field} is set, but ToyModel"
    ):
        combined_1f1b(model, [*mbs[:2], last])
    assert all(p.grad is None for p in model.parameters()), "nothing ran"


def test_empty_extra_block_kwargs_and_none_are_not_inputs() -> None:
    model = ToyModel(CONFIG, "dm")
    ref = copy.deepcopy(model)
    mbs = make_microbatches(2, CONFIG)
    given = [Microbatch(**{**_fields(mb), "extra_block_kwargs": {}}) for mb in mbs]
    plain_step(ref, mbs)
    combined_1f1b(model, given)
    assert_same(grads(model), grads(ref))


def test_a_direct_plan_refuses_what_the_model_does_not_read() -> None:
    model = ToyModel(CONFIG, "m")
    mb = make_microbatches(1, CONFIG)[0]
    cases: list[dict[str, Any]] = [
        {"padding_mask": MASK},
        {"output_processor": print},
        {"output_processor_context": object()},
    ]
    for kwargs in cases:
        name = next(iter(kwargs))
        with pytest.raises(ConfigError, match=rf"microbatch 4\): input {name} is set"):
            build_schedule_plan(
                model, mb.input_ids, None, None, labels=mb.labels, index=4, **kwargs
            )
    with pytest.raises(ConfigError, match="input attention_mask is set"):
        ModelChunkSchedulePlan(model, Microbatch(input_ids=mb.input_ids, attention_mask=MASK))


class _Strict(ToyModel):
    """Declares labels only: positions are refused too."""

    microbatch_inputs = frozenset({"labels"})


class _Reads(ToyModel):
    """Declares (and checks) a padding mask it is given."""

    seen: list[Tensor | None]

    @property
    def microbatch_inputs(self) -> Collection[str]:
        return ["position_ids", "labels", "padding_mask"]  # any collection of names

    def validate_inputs(self, state: ChunkState, /) -> None:
        self.seen.append(state.padding_mask)
        if state.padding_mask is not None and state.padding_mask.dtype != torch.bool:
            raise ConfigError("_Reads: padding_mask: expected bool")


def test_a_declaration_replaces_the_default() -> None:
    strict = _Strict(CONFIG, "m")
    mbs = make_microbatches(2, CONFIG)
    with pytest.raises(ConfigError, match=r"position_ids is set, but _Strict.*as its "):
        combined_1f1b(strict, mbs)
    combined_1f1b(strict, [Microbatch(input_ids=mb.input_ids, labels=mb.labels) for mb in mbs])

    reads = _Reads(CONFIG, "m")
    reads.seen = []
    ref = ToyModel(CONFIG, "m")
    ref.load_state_dict(reads.state_dict())
    padded = [Microbatch(**{**_fields(mb), "padding_mask": MASK}) for mb in mbs]
    combined_1f1b(reads, padded)
    plain_step(ref, mbs)
    assert_same(grads(reads), grads(ref))
    # Checked once per microbatch: up front for every one, not again by its plan.
    assert len(reads.seen) == 2 and all(s is MASK for s in reads.seen)
    with pytest.raises(ConfigError, match="expected bool"):
        combined_1f1b(reads, [Microbatch(**{**_fields(mbs[0]), "padding_mask": MASK.long()})])


@pytest.mark.parametrize(
    ("declared", "match"),
    [
        ("labels", r"expected a collection of input names .* received str 'labels'"),
        (3, r"expected a collection of input names .* received int 3"),
        ({"labels", 1}, r"expected names among .*received also \[1\]"),
    ],
)
def test_a_bad_declaration_is_an_integration_error(declared: object, match: str) -> None:
    model = ToyModel(CONFIG, "m")
    setattr(model, "microbatch_inputs", declared)  # noqa: B010 - the misuse under test
    with pytest.raises(IntegrationError, match=r"ToyModel\.microbatch_inputs: " + match):
        read_inputs(model)


def test_check_inputs_on_a_mapping_names_what() -> None:
    model = ToyModel(CONFIG, "m")
    check_inputs(model, {"position_ids": None, "attention_mask": None})
    with pytest.raises(ConfigError, match=r"^here: stage keyword attention_mask is set"):
        check_inputs(model, {"attention_mask": MASK}, where="here", what="stage keyword")


def _fields(mb: Microbatch) -> dict[str, Any]:
    return {name: getattr(mb, name) for name in mb.__dataclass_fields__}


# --- prepared pipelining schedules: a stage keyword is consumed or refused, never dropped -


class _Stage:
    """What prepare_schedule and a plan read of a stage (rank 0 of 2)."""

    def __init__(self, index: int, module: torch.nn.Module) -> None:
        self.stage_index = index
        self.num_stages = 4
        self.group_size = 2
        self.group_rank = 0
        self.is_first = index == 0
        self.is_last = index == 3
        self.submod = module
        self.dw_builder = None


class _NoMaskStage(GPTMoEStage):
    """A stage whose plain forward takes no masks (torch's own run refuses them)."""

    def forward(  # type: ignore[override]  # pyright: ignore[reportIncompatibleMethodOverride]
        self, x: Tensor, position_ids: Tensor | None = None
    ) -> Tensor:
        return self.plain_forward(x, position_ids)


class _NoPaddingStage(GPTMoEStage):
    """A stage that declares no padding mask, though its forward takes one."""

    microbatch_inputs = frozenset({"position_ids", "attention_mask"})


def test_prepared_stage_keywords() -> None:
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    from moe_overlap.integrations.pipelining import prepare_schedule

    config = GPTMoEConfig(num_layers=4, hidden_size=16, ffn_hidden_size=32, num_experts=4)
    model = GPTMoEModel(config)
    modules = {
        "plain": (GPTMoEStage(model, range(0, 1)), GPTMoEStage(model, range(2, 3))),
        "no_mask": (_NoMaskStage(model, range(0, 1)), _NoMaskStage(model, range(2, 3))),
        "no_padding": (_NoPaddingStage(model, range(0, 1)), _NoPaddingStage(model, range(2, 3))),
    }
    ids = torch.randint(0, config.vocab_size, (2, 8))
    keys = torch.zeros(2, 1, 8, 8, dtype=torch.bool)
    for name, pair in modules.items():
        stages: list[Any] = [_Stage(i, m) for i, m in zip((0, 2), pair, strict=True)]
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=4, loss_fn=lambda a, b: a)
        overlap = prepare_schedule(schedule, pair=True)
        build = overlap._runner.plan  # the plan/keyword step
        first, later = stages
        hidden = torch.randn(2, 8, config.hidden_size)
        if name == "plain":
            plan = build(first, 0, (ids,), {"attention_mask": keys, "padding_mask": MASK})
            assert plan.state.attention_mask is keys and plan.state.padding_mask is MASK
            plan.release_state()
            with pytest.raises(ConfigError, match=r"padding_mask: expected a bool tensor"):
                build(later, 0, (hidden,), {"padding_mask": MASK.float()})
        elif name == "no_mask":
            for kwargs in ({"attention_mask": keys}, {"attention_mask": None}):
                with pytest.raises(
                    ConfigError,
                    match=r"pipeline stage 2 \(_NoMaskStage\): stage keyword attention_mask "
                    r"is not a parameter of _NoMaskStage\.forward\(x: 'Tensor', .*torch's own "
                    r"run of the stage refuses it",
                ):
                    build(later, 0, (hidden,), kwargs)
        else:
            build(first, 0, (ids,), {"padding_mask": None}).release_state()
            with pytest.raises(
                ConfigError,
                match=r"pipeline stage 0 \(_NoPaddingStage\): stage keyword padding_mask is "
                r"set, but _NoPaddingStage does not read it",
            ):
                build(first, 0, (ids,), {"padding_mask": MASK})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"positions": None}, r"Microbatch: positions: .*torchtitan's name for position_ids"),
        ({"attention_masks": None}, r"attention_masks: .*builds them from position_ids"),
        ({"tokens": None}, r"tokens: .*torchtitan's name for input_ids"),
        ({"label": None}, r"label: expected one of its fields .*did you mean labels\?"),
        ({"xyz": None}, r"xyz: .*; leave it out"),
    ],
)
def test_a_name_that_is_not_a_field_is_the_librarys_error(
    kwargs: dict[str, object], match: str
) -> None:
    """Not Python's bare ``TypeError``: the error names the field meant (torchtitan's names
    among them) and lists the fields."""
    make: Any = Microbatch  # names no type checker accepts
    with pytest.raises(ConfigError, match=match):
        make(input_ids=torch.zeros(2, 8, dtype=torch.long), **kwargs)


def test_fields_are_keywords_only() -> None:
    make: Any = Microbatch  # positionally: what the type checkers refuse too
    with pytest.raises(ConfigError, match=r"Microbatch: expected its fields by keyword"):
        make(torch.zeros(2, 8, dtype=torch.long))


def test_a_microbatch_copies_and_pickles() -> None:
    """``Microbatch.__new__`` checks names only: copies, pickles and ``replace`` work; the
    class is named by its public module."""
    import dataclasses
    import pickle

    from moe_overlap import microbatch

    assert Microbatch is microbatch.Microbatch
    assert Microbatch.__module__ == "moe_overlap.microbatch"
    ids = torch.zeros(2, 8, dtype=torch.long)
    mb = Microbatch(input_ids=ids)
    data = pickle.dumps(mb)
    assert b"moe_overlap.microbatch" in data and b"engine" not in data
    for other in (copy.copy(mb), pickle.loads(data)):
        assert other.input_ids is not None and torch.equal(other.input_ids, ids)
    assert dataclasses.replace(mb, labels=mb.input_ids).labels is mb.input_ids
