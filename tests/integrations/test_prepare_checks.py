"""What prepare_schedule refuses, on schedule objects built without a process group."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, cast

import pytest
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining.schedules import (
    BACKWARD_INPUT,
    FORWARD,
    OVERLAP_F_B,
    ScheduleInterleaved1F1B,
    _Action,
)

from moe_overlap import ConfigError, IntegrationError
from moe_overlap.integrations.pipelining import prepare_schedule
from moe_overlap.models import GPTMoEConfig, GPTMoEModel, GPTMoEStage

CONFIG = GPTMoEConfig(num_layers=4, hidden_size=16, ffn_hidden_size=32, num_experts=4)


class _Stage:
    """What the schedule and prepare_schedule read of a stage (rank 0 of 2)."""

    def __init__(self, index: int, module: nn.Module, *, dw_builder: object = None) -> None:
        self.stage_index = index
        self.num_stages = 4
        self.group_size = 2
        self.group_rank = 0
        self.is_first = index == 0
        self.is_last = index == 3
        self.submod = module
        self.dw_builder = dw_builder


def _schedule(*modules: nn.Module, dw_builder: object = None) -> Any:
    stages: list[Any] = [
        _Stage(i, m, dw_builder=dw_builder) for i, m in zip((0, 2), modules, strict=True)
    ]
    return ScheduleInterleaved1F1B(stages, n_microbatches=4, loss_fn=lambda a, b: a)


def _stages() -> tuple[GPTMoEStage, GPTMoEStage]:
    model = GPTMoEModel(CONFIG)
    return GPTMoEStage(model, range(0, 1)), GPTMoEStage(model, range(2, 3))


def test_interleaved_1f1b_is_paired_and_prepared_once() -> None:
    schedule = _schedule(*_stages())
    overlap = prepare_schedule(schedule, pair=True)
    assert overlap.paired > 0
    kinds = {a.computation_type for a in schedule.pipeline_order_with_comms[0]}
    assert OVERLAP_F_B in kinds
    with pytest.raises(ConfigError, match="already prepared; prepare a schedule once"):
        prepare_schedule(schedule)


def test_a_schedule_without_the_action_runtime_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"received object; a single-stage schedule"):
        prepare_schedule(object())


def test_a_stage_module_that_is_not_a_preprocessable_model_is_refused() -> None:
    first, _ = _stages()
    with pytest.raises(IntegrationError, match="Identity"):
        prepare_schedule(_schedule(first, nn.Identity()))


def test_a_stage_placed_against_its_pre_and_post_process_is_refused() -> None:
    first, _ = _stages()
    later = GPTMoEStage(GPTMoEModel(CONFIG), range(1, 4))  # ends at the last layer
    with pytest.raises(
        IntegrationError,
        match=r"pipeline stage 2 \(GPTMoEStage\): expected post_process=False for stage 2 "
        r"of 4 \(the last stage's output goes to loss_fn\), received post_process=True",
    ):
        prepare_schedule(_schedule(first, later))


def test_data_parallel_wrappers_and_dw_builder_are_refused() -> None:
    first, second = _stages()
    with pytest.raises(ConfigError, match="expected a stage without dw_builder"):
        prepare_schedule(_schedule(first, second, dw_builder=lambda: None))
    # fully_shard swaps the module's class for one deriving from FSDPModule, like this.
    second.__class__ = type("FSDPGPTMoEStage", (FSDPModule, GPTMoEStage), {})
    with pytest.raises(ConfigError, match="wrapped by FSDPGPTMoEStage; data-parallel"):
        prepare_schedule(_schedule(first, second))


def test_an_overlap_action_the_plans_cannot_run_is_refused() -> None:
    schedule = _schedule(*_stages())
    parts = (_Action(0, FORWARD, 1), _Action(2, BACKWARD_INPUT, 0))
    schedule.pipeline_order_with_comms[0] = [_Action(-1, OVERLAP_F_B, None, parts)]
    with pytest.raises(ConfigError, match=r"expected each OVERLAP_F_B as \(FORWARD, FULL_BACK"):
        prepare_schedule(schedule)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"pair": 1}, "pair must be a bool, received int"),
        ({"options": {"free_input": False}}, "options must be a ScheduleOptions or None"),
        ({"observer": object()}, "observer must be a StepObserver"),
        ({"consensus_timeout": 5}, "consensus_timeout must be a positive datetime.timedelta"),
        ({"consensus_timeout": timedelta(0)}, r"received datetime.timedelta\(0\)"),
        ({"consensus_group": "world"}, "consensus_group must be a torch.distributed Process"),
        (
            {"consensus_group": object(), "consensus_timeout": timedelta(seconds=1)},
            "received it with a consensus_group of yours, whose own timeout applies",
        ),
    ],
)
def test_arguments_are_checked(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        prepare_schedule(_schedule(*_stages()), **kwargs)


def test_overlap_and_observer_are_checked_when_set() -> None:
    """``overlap = "no"`` was kept and read as true (the pairs overlapped); an observer
    without ``timer`` failed inside the next step."""
    prepared = prepare_schedule(_schedule(*_stages()), pair=True)
    with pytest.raises(ConfigError, match="PipelineOverlap: overlap must be a bool, received str"):
        prepared.overlap = cast(Any, "no")
    with pytest.raises(ConfigError, match="PipelineOverlap: observer must be a StepObserver"):
        prepared.observer = cast(Any, 3)
    assert prepared.overlap is True and prepared.observer is None
    prepared.overlap = False
    assert prepared.overlap is False


def test_compiled_checkpointed_or_hooked_stage_modules_are_refused() -> None:
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    first, second = _stages()
    with pytest.raises(
        ConfigError,
        match=r"^pipeline stage 2: OptimizedModule: expected no torch\.compile of it, received "
        r"an OptimizedModule around GPTMoEStage; the schedule never calls the model's forward",
    ):
        prepare_schedule(_schedule(first, cast(nn.Module, torch.compile(second))))
    with pytest.raises(ConfigError, match=r"^pipeline stage 2: CheckpointWrapper: .*GPTMoEStage"):
        prepare_schedule(_schedule(first, checkpoint_wrapper(second)))
    handle = second.decoder.layers[0].register_forward_hook(lambda *args: None)
    with pytest.raises(
        ConfigError, match=r"^pipeline stage 2: GPTMoEStage\.decoder\.layers\[0\] \(\w+Layer\)"
    ):
        prepare_schedule(_schedule(first, second))
    handle.remove()
    assert prepare_schedule(_schedule(first, second)).paired == 0
