"""After a step, nothing of the schedule survives, without help from the cyclic collector."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from moe_overlap import ModelChunkSchedulePlan, ScheduleOptions, combined_1f1b

from .toy_model import ToyConfig, ToyModel, make_microbatches


def refs_of(plan: ModelChunkSchedulePlan) -> Iterator[weakref.ref[object]]:
    yield weakref.ref(plan)
    yield weakref.ref(plan.state)
    for chunk_node in (plan.pre_process, plan.post_process):
        if chunk_node is not None:
            yield weakref.ref(chunk_node)
    for lp in plan.layers:
        yield weakref.ref(lp)
        yield weakref.ref(lp.layer_state)
        for node in lp.nodes.values():
            yield weakref.ref(node)


@pytest.fixture
def no_gc() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("delay", [True, False])
@pytest.mark.usefixtures("no_gc")
def test_nothing_survives_a_step(overlap: bool, delay: bool) -> None:
    config = ToyConfig(shared_expert=True)
    model = ToyModel(config, "dmt")
    model.set_delay(delay)
    mbs = make_microbatches(3, config)
    refs: list[weakref.ref[object]] = []
    combined_1f1b(
        model,
        mbs,
        overlap=overlap,
        options=ScheduleOptions(delay_wgrad_compute=delay),
        on_plan=lambda plan: refs.extend(refs_of(plan)),
    )
    assert len(refs) > 20
    alive = [r() for r in refs if r() is not None]
    assert alive == []


@pytest.mark.usefixtures("no_gc")
def test_no_garbage_cycles_created() -> None:
    config = ToyConfig()
    model = ToyModel(config, "mm")
    mbs = make_microbatches(2, config)
    combined_1f1b(model, mbs)  # warm up lazy module state
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        combined_1f1b(model, mbs)
        found = gc.collect()
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert found == 0, f"{found} objects were only reachable through reference cycles"
