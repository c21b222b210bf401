"""A reference model changed between steps is trained as it is now, not as it was built.

The schedule reads ``decoder.layers`` and each layer's submodules at every plan build, so a
layer added, removed or replaced, or a layer's attention, router, experts, shared expert
or norm replaced, is followed exactly: the next step is bit-identical to plain
per-microbatch ``backward()`` of the changed model. (CUDA graphs captured before the change
are refused until ``reset_graphs()``: ``tests/models/test_gpu_graphs.py``.) A change that
makes two nodes use one parameter (tied weights, a module shared by two layers) is refused.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from moe_overlap import IntegrationError, Microbatch, WgradError, combined_1f1b
from moe_overlap.engine._torch_wrappers import has_grad_hooks
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


Undo = Callable[[], object]


def _tie(m: GPTMoEModel) -> Undo:
    own = m.output_layer.weight
    m.output_layer.weight = m.embedding.weight
    return lambda: setattr(m.output_layer, "weight", own)


def _listed_twice(m: GPTMoEModel) -> Undo:
    m.decoder.layers.append(m.decoder.layers[1])
    return lambda: m.decoder.layers.__delitem__(-1)


def _share_router(m: GPTMoEModel) -> Undo:
    own = m.decoder.layers[2].router
    m.decoder.layers[2].router = _moe(m).router
    return lambda: setattr(m.decoder.layers[2], "router", own)


def _share_norm(m: GPTMoEModel) -> Undo:
    own = m.final_norm
    setattr(m, "final_norm", m.decoder.layers[2].pre_mlp_norm)  # noqa: B010 - not an RMSNorm to the types
    return lambda: setattr(m, "final_norm", own)


SHARES: dict[str, Callable[[GPTMoEModel], Undo]] = {
    "the output layer tied to the embedding": _tie,
    "a layer listed twice": _listed_twice,
    "the router shared by two layers": _share_router,
    "the final norm shared with a layer": _share_norm,
}
TWO_NODES = (
    IntegrationError,
    r"expected each parameter's gradient accumulated into \.grad at most once per microbatch",
)
TWO_LAYERS = (
    WgradError,
    r"expected the modules its pre_dispatch_wgrad\(\) / mlp_wgrad\(\) list to be its own",
)


@pytest.mark.parametrize("delay", [False, True])
@pytest.mark.parametrize("change", list(SHARES))
def test_a_parameter_two_nodes_use_is_refused(change: str, delay: bool) -> None:
    """Each node's backward adds its part to ``.grad`` on its own, between other
    microbatches' parts: not plain ``backward()``'s one sum per microbatch, so refused
    (delayed weight gradients of a module two layers list: at plan build), also after
    clean steps; undone, the same model trains exactly again, with no hook left."""
    model = GPTMoEModel(dataclasses.replace(SMALL, delay_wgrad_compute=delay))
    combined_1f1b(model, _microbatches(0))  # clean: later steps count nothing ...
    combined_1f1b(model, _microbatches(0))
    undo = SHARES[change](model)  # ... until the parameters change
    kind, match = TWO_LAYERS if delay and change == "a layer listed twice" else TWO_NODES
    with pytest.raises(kind, match=match):
        combined_1f1b(model, _microbatches(1))
    assert not any(has_grad_hooks(p) for p in model.parameters())
    undo()
    model.zero_grad(set_to_none=True)
    plain = copy.deepcopy(model)
    mbs = _microbatches(2)
    losses = combined_1f1b(model, mbs)
    assert_matches_plain(model, plain, mbs, losses)


def test_a_shared_parameter_unfrozen_after_clean_steps_is_refused() -> None:
    """Later steps of a clean model skip the walk while nothing was registered and no
    ``requires_grad`` changed: unfreezing a tied (so far frozen, uncounted) parameter is
    such a change, and the next step is refused."""
    model = GPTMoEModel(SMALL)
    _tie(model)
    model.embedding.weight.requires_grad_(False)
    combined_1f1b(model, _microbatches(0))
    combined_1f1b(model, _microbatches(0))
    model.embedding.weight.requires_grad_(True)
    with pytest.raises(TWO_NODES[0], match=TWO_NODES[1]):
        combined_1f1b(model, _microbatches(1))
