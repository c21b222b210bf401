"""Each Protocol's contract is written once: its rule table lists exactly its members."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from typing import Any

import pytest
import typing_extensions

import moe_overlap
from moe_overlap.engine.contracts import (
    LAYER,
    MODEL,
    STEP_OBSERVER,
    Kind,
    contract_of,
    contracts,
)

# Modules that need an optional dependency this environment may lack.
_OPTIONAL = ("moe_overlap.adapters", "moe_overlap.timeline")


def _runtime_protocols() -> list[type]:
    """Every ``@runtime_checkable`` Protocol defined in the package, found by importing it all."""
    found: dict[str, type] = {}
    for info in pkgutil.walk_packages(moe_overlap.__path__, "moe_overlap."):
        try:
            module = importlib.import_module(info.name)
        except ImportError:
            if info.name.startswith(_OPTIONAL):
                continue
            raise
        for value in vars(module).values():
            if (
                inspect.isclass(value)
                and value.__module__ == module.__name__
                and typing_extensions.is_protocol(value)
                and getattr(value, "_is_runtime_protocol", False)
            ):
                found[f"{value.__module__}.{value.__qualname__}"] = value
    return [found[k] for k in sorted(found)]


PROTOCOLS = _runtime_protocols()


def test_the_walk_finds_the_protocols() -> None:
    names = {p.__name__ for p in PROTOCOLS}
    assert {"PreprocessableModel", "SchedulableLayer", "WgradLayer", "SlotContext"} <= names


@pytest.mark.parametrize("protocol", PROTOCOLS, ids=lambda p: p.__name__)
def test_every_runtime_protocol_has_a_table_of_exactly_its_members(protocol: type) -> None:
    contract = contract_of(protocol)
    assert contract is not None, f"{protocol.__qualname__} has no rule table (engine/contracts.py)"
    assert len(set(contract.names)) == len(contract.names), contract

    # A member that is object's own asks nothing of an implementation: debug mode's beartype
    # sets a wrapper of ``object.__sizeof__`` on the classes it decorates.
    def objects_own(name: str) -> bool:
        mine = vars(protocol).get(name)
        return (
            hasattr(object, name)
            and callable(mine)
            and inspect.unwrap(mine) is getattr(object, name)
        )

    members = {n for n in typing_extensions.get_protocol_members(protocol) if not objects_own(n)}
    assert set(contract.names) == members


def test_every_table_belongs_to_a_runtime_protocol() -> None:
    assert set(contracts()) <= set(PROTOCOLS)


def test_member_kinds_follow_the_protocol() -> None:
    """A member the Protocol declares as a method is a method row; a property, an attribute."""
    for protocol in PROTOCOLS:
        contract = contract_of(protocol)
        assert contract is not None
        for member in contract.members:
            declared = inspect.getattr_static(protocol, member.name)
            kind = Kind.ATTRIBUTE if isinstance(declared, property) else Kind.METHOD
            assert member.kind is kind, (protocol.__name__, member.name)


class _Observer:
    def timer(self, step: object, microbatch: int | None) -> None:
        del step, microbatch


def test_one_checker_for_the_fast_path_and_the_message() -> None:
    assert STEP_OBSERVER.conforms(_Observer())
    assert not STEP_OBSERVER.conforms(object())
    assert STEP_OBSERVER.detail(object()) == "missing members: ['timer']"
    error = MODEL.error(object())
    assert str(error).startswith("object is not a PreprocessableModel; missing members: [")

    class Layer:
        config = None
        is_moe = "yes"

    message = str(LAYER.error(Layer(), "decoder.layers[3]"))
    assert message.startswith("decoder.layers[3]: Layer is not a SchedulableLayer; missing")


def test_passing_one_contract_does_not_pass_another() -> None:
    """Inside one ``combined_1f1b`` call each object is checked once *per contract*: a layer
    that passed the layer check and lists itself as a delayed-wgrad module is still checked
    as a WgradLayer (it has no ``backward_dw``) when the plan is built."""
    from moe_overlap import IntegrationError, combined_1f1b
    from tests.engine.toy_model import ToyConfig, ToyModel, make_microbatches

    config = ToyConfig()
    model = ToyModel(config, "mm")
    model.set_delay(True)
    layer: Any = model.decoder.layers[0]
    layer.mlp_wgrad = lambda: [layer]  # the layer itself: a LAYER, not a WGRAD_LAYER
    with pytest.raises(IntegrationError, match=r"mlp_wgrad\(\)\[0\].*backward_dw"):
        combined_1f1b(model, make_microbatches(2, config))
    assert all(p.grad is None for p in model.parameters())
