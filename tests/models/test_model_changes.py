"""A reference model changed between steps is trained as it is now, not as it was built.

The schedule reads ``decoder.layers`` and each layer's submodules at every plan build, so a
layer added, removed or replaced, or a layer's attention, router, experts, shared expert
or norm replaced, is followed exactly: the next step is bit-identical to plain
per-microbatch ``backward()`` of the changed model. (CUDA graphs captured before the change
are refused until ``reset_graphs()``: ``tests/models/test_gpu_graphs.py``.)
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from moe_overlap import Microbatch, combined_1f1b
from moe_overlap.models import GPTMoEModel, MoELayer
from tests.models._helpers import SMALL, assert_matches_plain


def _microbatches(seed: int) -> list[Microbatch]:
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, SMALL.vocab_size, (2, 8), generator=g) for _ in range(3)]
    return [Microbatch(input_ids=x, labels=x.roll(-1, 1)) for x in ids]


def _donor(delay: bool) -> GPTMoEModel:
    """Another model (other weights, one layer more) whose modules are put in."""
    return GPTMoEModel(
        dataclasses.replace(
            SMALL, seed=7, num_layers=SMALL.num_layers + 1, delay_wgrad_compute=delay
        )
    )


def _moe(model: GPTMoEModel) -> Any:
    return next(layer for layer in model.layer_list if isinstance(layer, MoELayer))


CHANGES: dict[str, Callable[[GPTMoEModel, GPTMoEModel], object]] = {
    "a layer appended": lambda m, d: m.decoder.layers.append(d.decoder.layers[-1]),
    "the last layer removed": lambda m, d: m.decoder.layers.__delitem__(-1),
    "a layer replaced": lambda m, d: m.decoder.layers.__setitem__(1, d.decoder.layers[1]),
    "the experts replaced": lambda m, d: setattr(_moe(m), "experts", _moe(d).experts),
    "the router replaced": lambda m, d: setattr(_moe(m), "router", _moe(d).router),
    "the attention replaced": lambda m, d: setattr(_moe(m), "attn_block", _moe(d).attn_block),
    "the norm replaced": lambda m, d: setattr(_moe(m), "pre_mlp_norm", _moe(d).pre_mlp_norm),
}


@pytest.mark.parametrize("delay", [False, True])
@pytest.mark.parametrize("change", list(CHANGES))
def test_a_changed_model_is_trained_as_it_is_now(change: str, delay: bool) -> None:
    model = GPTMoEModel(dataclasses.replace(SMALL, delay_wgrad_compute=delay))
    combined_1f1b(model, _microbatches(0))  # plans built on the model as constructed
    model.zero_grad(set_to_none=True)
    CHANGES[change](model, _donor(delay))
    plain = copy.deepcopy(model)
    mbs = _microbatches(1)
    losses = combined_1f1b(model, mbs)
    assert_matches_plain(model, plain, mbs, losses)
    assert len(model.layer_list) == len(model.decoder.layers)
