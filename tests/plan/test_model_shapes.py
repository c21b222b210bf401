"""The search on models of any shape: one layer, dense layers, one microbatch; recompute
choices of layers or microbatches the model or step does not have refused up front."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

import pytest

from moe_overlap.errors import ConfigError
from moe_overlap.plan import (
    CHOICE_SPACE,
    QUICK_CHOICE_SPACE,
    Costs,
    Recompute,
    ScheduleGraph,
    SearchSpace,
    check_exact,
    choose_schedule,
    fit_activations,
    search_schedules,
)
from moe_overlap.steps import Slot
from tests.plan import main_profile
from tests.plan.main_profile import MEMORY

PRE, MLP = Slot.PRE_DISPATCH, Slot.MLP
# The default space, small: one of each choice but recompute's.
SMALL = dataclasses.replace(
    SearchSpace(),
    chunks=(1,),
    delay_wgrad=(False,),
    early_recompute=(False,),
    in_flight=(1, 2),
    stagger=(0,),
    memory_caps=(None,),
    rules=("oldest",),
    slack_ms=(0.0,),
    improve_passes=0,
)


@pytest.fixture(scope="module")
def main_costs() -> Costs:
    return main_profile.main_costs()


def _layers(costs: Costs, moe: Sequence[bool]) -> Costs:
    """``costs``' first layers, MoE as ``moe`` says (a dense layer: pre-dispatch and mlp)."""

    def kept(layer: int | None, slot: Slot) -> bool:
        return layer is None or (layer < len(moe) and (moe[layer] or slot in (PRE, MLP)))

    times = {k: v for k, v in costs.times.items() if kept(k[0], k[1])}
    return costs.replace(moe=tuple(moe), times=times)


def _searched(costs: Costs, microbatches: int, space: SearchSpace | None) -> list[str]:
    """The recompute choices ``search_schedules`` searched, as the progress names them."""
    labels: list[str] = []
    result = search_schedules(costs, microbatches, MEMORY, space, progress=labels.append)
    for point in result.frontier:
        check_exact(point.order, point.graph)
    choices = [x.split(" recompute=")[1].split(" ")[0] for x in labels if " recompute=" in x]
    return list(dict.fromkeys(choices))


def test_the_default_space_fits_one_layer(main_costs: Costs) -> None:
    """The default recomputed layers 0 and 1: on one layer a misleading ConfigError (only the
    pre-dispatch and the mlp can be recomputed). Clipped to layer 0, equal to every layer's."""
    whole = ["none", "mlp", "pre_dispatch+mlp"]
    for moe in ((True,), (False,)):
        costs = _layers(main_costs, moe)
        assert _searched(costs, 1, None) == whole
        assert _searched(costs, 3, SMALL) == whole
        for space in (None, CHOICE_SPACE, QUICK_CHOICE_SPACE):
            choice = choose_schedule(costs, 2, MEMORY, space=space)
            assert choice.step_ms <= choice.serial.step_ms
            assert (choice.kind == "serial") == (moe == (False,))


def test_the_default_space_drops_a_choice_equal_to_another(main_costs: Costs) -> None:
    """Two layers (one dense): layers 0 and 1 are every layer, searched once; four: all."""
    two = _layers(main_costs, (False, True))
    assert _searched(two, 2, SMALL) == ["none", "mlp", "pre_dispatch+mlp", "pre_dispatch+mlp@L0"]
    four = _searched(main_costs, 2, dataclasses.replace(SMALL, in_flight=(1,)))
    assert four == [str(rc) for rc in SearchSpace().recompute]


def test_recompute_of_layers_or_microbatches_not_there_is_refused(main_costs: Costs) -> None:
    """Each was ScheduleGraph.recompute's 'only the pre-dispatch and the mlp can be
    recomputed', raised after the search had begun."""
    one = _layers(main_costs, (True,))
    two = _layers(main_costs, (True, True))
    past_layer = Recompute((MLP,), (0, 1))
    space = dataclasses.replace(SMALL, recompute=(Recompute(), past_layer))
    layer_message = (
        "space.recompute: item 1 must be a Recompute of the model's layers (0..0: the model has "
        f"1 layer), received Recompute {past_layer!r} (it names layer 1); name only the model's layers "
        "(layers=None: all of them), or drop the option"
    )
    cases: list[tuple[Callable[[], object], str]] = [
        (lambda: search_schedules(one, 2, MEMORY, space), f"search_schedules: {layer_message}"),
        (
            lambda: search_schedules(
                two,
                2,
                MEMORY,
                dataclasses.replace(SMALL, recompute=(Recompute((MLP,), (0, 2, 3)),)),
            ),
            "item 0 must be a Recompute of the model's layers (0..1: the model has 2 layers), "
            "received Recompute Recompute(slots=(<Slot.MLP: 'mlp'>,), layers=(0, 2, 3), microbatches=None) "
            "(it names layers 2, 3)",
        ),
        (
            lambda: search_schedules(
                one,
                2,
                MEMORY,
                dataclasses.replace(SMALL, recompute=(Recompute((MLP,), None, (2,)),)),
            ),
            "item 0 must be a Recompute of the step's microbatches (0..1: the step has 2 "
            "microbatches), received Recompute Recompute(slots=(<Slot.MLP: 'mlp'>,), layers=None, "
            "microbatches=(2,)) (it names microbatch 2); name only the step's microbatches "
            "(microbatches=None: all of them), or drop the option",
        ),
        (
            lambda: search_schedules(one, 2, MEMORY, SMALL, today_recompute=past_layer),
            "search_schedules: today_recompute must be a Recompute of the model's layers (0..0",
        ),
        (
            lambda: fit_activations(
                MEMORY,
                one,
                2,
                serial=1.0,
                fill_drain=2.0,
                serial_recompute=0.9,
                recompute=past_layer,
            ),
            "fit_activations: recompute must be a Recompute of the model's layers (0..0",
        ),
        (
            lambda: ScheduleGraph(microbatches=2, moe=(True,), recompute=frozenset({(0, 1, MLP)})),
            "received (0, 1, <Slot.MLP: 'mlp'>); the graph has no layer 1: name only its layers",
        ),
        (
            lambda: ScheduleGraph(microbatches=2, moe=(True,), recompute=frozenset({(2, 0, MLP)})),
            "received (2, 0, <Slot.MLP: 'mlp'>); the graph has no microbatch 2: name only its",
        ),
    ]
    for call, message in cases:
        with pytest.raises(ConfigError, match=re.escape(message)):
            call()
    # choose_schedule refuses a layer subset (the engine recomputes every layer) on any model
    with pytest.raises(ConfigError, match=r"choose_schedule: space\.recompute: expected whole"):
        choose_schedule(one, 2, MEMORY, space=dataclasses.replace(SMALL, recompute=(past_layer,)))
