"""The always-on slot rules refuse only what is wrong: patterns that are exact still run,
bit-identical to plain ``loss.backward()`` (the refusals are in ``test_error_catalogue.py``).

Each pattern patches one slot of the toy model's MoE layer; the math stays the plain
forward's, so the schedule must match it exactly.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from moe_overlap import ScheduleOptions, TransformerLayerNode, combined_1f1b

from .test_parity import assert_same
from .toy_model import Route, ToyConfig, ToyLayer, ToyModel, grads, make_microbatches, plain_step

Slot = Callable[[TransformerLayerNode, tuple[Tensor, ...]], "Tensor | tuple[Tensor, ...]"]


@dataclass(frozen=True)
class Pattern:
    """Slot replacements for the MoE layer (slot name -> function of the layer)."""

    slots: dict[str, Callable[[ToyLayer], Slot]]
    free_input: bool = True


def _dispatch_returns_its_input(layer: ToyLayer) -> Slot:
    def dispatch(node: TransformerLayerNode, inputs: tuple[Tensor, ...]) -> Tensor:
        rows, probs = inputs
        node.layer_state.dispatched_probs = node.detach(probs.clone())
        return rows  # its input as it is: fine where dispatch keeps its inputs

    return dispatch


def _dispatch_returns_a_view_of_its_input(layer: ToyLayer) -> Slot:
    def dispatch(node: TransformerLayerNode, inputs: tuple[Tensor, ...]) -> Tensor:
        rows, probs = inputs
        node.layer_state.dispatched_probs = node.detach(probs.clone())
        return rows.view(rows.shape)

    return dispatch


def _dispatch_keeps_a_copy_of_its_input(layer: ToyLayer) -> Slot:
    def dispatch(node: TransformerLayerNode, inputs: tuple[Tensor, ...]) -> Tensor:
        rows, probs = inputs
        node.layer_state.dispatched_probs = node.detach(probs)  # shares the input's memory
        return rows.clone()

    return dispatch


def _dispatch_replaces_what_it_kept(layer: ToyLayer) -> Slot:
    def dispatch(node: TransformerLayerNode, inputs: tuple[Tensor, ...]) -> Tensor:
        rows, probs = inputs
        state = node.layer_state
        state.dispatched_probs = probs  # replaced below: not what the slot hands on
        state.dispatched_probs = node.detach(probs.clone())
        state.stash("probs", probs)
        state.extras.pop("probs")
        return rows.clone()

    return dispatch


def _mlp_returns_a_view(layer: ToyLayer) -> Slot:
    def mlp(node: TransformerLayerNode, inputs: tuple[Tensor, ...]) -> Tensor:
        out = ToyLayer.slot_mlp(layer, node, inputs)
        assert isinstance(out, Tensor)
        return out.view(-1).view(out.shape)  # combine frees a view of a fresh tensor

    return mlp


def _mlp_returns_two_views(layer: ToyLayer) -> Slot:
    def mlp(node: TransformerLayerNode, inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        out = ToyLayer.slot_mlp(layer, node, inputs)
        assert isinstance(out, Tensor)
        return out[:, :8], out[:, 8:]  # two inputs of combine over one storage

    return mlp


def _combine_of_two_views(layer: ToyLayer) -> Slot:
    def combine(
        node: TransformerLayerNode, inputs: tuple[Tensor, ...]
    ) -> Tensor | tuple[Tensor, ...]:
        return ToyLayer.slot_combine(layer, node, (torch.cat(inputs, dim=1),))

    return combine


def _combine_index_adds_a_view_of_its_input(layer: ToyLayer) -> Slot:
    def combine(
        node: TransformerLayerNode, inputs: tuple[Tensor, ...]
    ) -> Tensor | tuple[Tensor, ...]:
        (y,) = inputs  # index_add keeps the view only for its sizes
        return ToyLayer.slot_combine(layer, node, (y.view(y.shape),))

    return combine


def _mlp_checkpoints_a_copy(layer: ToyLayer) -> Slot:
    def mlp(node: TransformerLayerNode, inputs: tuple[Tensor, ...]) -> Tensor:
        (rows,) = inputs
        probs = node.layer_state.dispatched_probs
        assert probs is not None
        route = node.layer_state.take("route", Route)

        def experts(r: Tensor) -> Tensor:
            return layer._experts(r, probs, route)

        out: Tensor = checkpoint(experts, rows.clone(), use_reentrant=False)
        return out

    return mlp


PATTERNS = {
    "dispatch_returns_its_input_without_free_input": Pattern(
        {"slot_dispatch": _dispatch_returns_its_input}, free_input=False
    ),
    "dispatch_returns_a_view_of_its_input_without_free_input": Pattern(
        {"slot_dispatch": _dispatch_returns_a_view_of_its_input}, free_input=False
    ),
    "dispatch_keeps_a_copy_of_its_input_without_free_input": Pattern(
        {"slot_dispatch": _dispatch_keeps_a_copy_of_its_input}, free_input=False
    ),
    "dispatch_replaces_what_it_kept": Pattern({"slot_dispatch": _dispatch_replaces_what_it_kept}),
    "combine_frees_a_view": Pattern({"slot_mlp": _mlp_returns_a_view}),
    "combine_frees_two_views_of_one_tensor": Pattern(
        {"slot_mlp": _mlp_returns_two_views, "slot_combine": _combine_of_two_views}
    ),
    "combine_index_adds_a_view_of_its_freed_input": Pattern(
        {"slot_combine": _combine_index_adds_a_view_of_its_input}
    ),
    "mlp_checkpoints_a_copy_of_its_freed_input": Pattern({"slot_mlp": _mlp_checkpoints_a_copy}),
}


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_exact_pattern_runs_bit_identical(name: str) -> None:
    pattern = PATTERNS[name]
    config = ToyConfig()
    ref = ToyModel(config, "dm")
    model = copy.deepcopy(ref)
    layer = model.decoder.layers[1]
    assert isinstance(layer, ToyLayer) and layer.is_moe
    for slot, make in pattern.slots.items():
        setattr(layer, slot, make(layer))
    mbs = make_microbatches(3, config)
    ref_losses = plain_step(ref, mbs)
    options = ScheduleOptions(free_input=pattern.free_input)
    losses = combined_1f1b(model, mbs, options=options)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True))
    assert_same(grads(model), grads(ref))
