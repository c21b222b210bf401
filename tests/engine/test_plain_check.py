"""Debug mode's first-step check, its parts: how the plain forward is called, the tolerance.

The check itself runs in debug mode only (``tests/engine/test_debug_mode.py``,
``tests/engine/test_error_catalogue.py::test_debug_mode_catalogue``); these parts are plain code.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moe_overlap import Microbatch
from moe_overlap.engine._plain_check import (
    _first_difference,
    _parameters,
    _skip_reason,
    plain_call,
)
from moe_overlap.models import GPTMoEModel
from tests.engine.toy_model import ToyConfig, ToyModel
from tests.models._helpers import SMALL

IDS = torch.zeros(2, 8, dtype=torch.long)
MB = Microbatch(input_ids=IDS, labels=IDS, loss_mask=torch.ones(2, 8))


class MegatronLike(nn.Module):
    """Megatron-Core 0.19's ``GPTModel.forward`` signature."""

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        attention_mask: Tensor,
        decoder_input: Tensor | None = None,
        labels: Tensor | None = None,
        inference_context: object = None,
        packed_seq_params: object = None,
        extra_block_kwargs: dict[str, object] | None = None,
        runtime_gather_output: bool | None = None,
        *,
        inference_params: object = None,
        loss_mask: Tensor | None = None,
        padding_mask: Tensor | None = None,
    ) -> Tensor:
        return torch.zeros(())


def test_the_set_fields_go_in_by_name() -> None:
    call = plain_call(GPTMoEModel(SMALL), MB)
    assert call is not None
    assert call[1] == "GPTMoEModel.forward(input_ids=..., labels=..., loss_mask=...)"
    mask = torch.zeros(2, 1, 8, 8, dtype=torch.bool)
    full = Microbatch(input_ids=IDS, position_ids=IDS, attention_mask=mask, labels=IDS)
    found = plain_call(MegatronLike(), full)
    assert found is not None
    assert found[1] == (
        "MegatronLike.forward(input_ids=..., position_ids=..., attention_mask=..., labels=...)"
    )
    assert isinstance(found[0](), Tensor)


def test_a_forward_that_cannot_take_the_microbatch_is_not_used() -> None:
    # Megatron's forward needs position_ids and attention_mask: not given, not callable.
    assert plain_call(MegatronLike(), MB) is None

    class NoLabels(nn.Module):
        def forward(self, input_ids: Tensor) -> Tensor:
            return input_ids.float().sum()

    assert plain_call(NoLabels(), MB) is None
    assert plain_call(object(), MB) is None

    class Anything(nn.Module):
        def forward(self, **kwargs: object) -> Tensor:
            return torch.zeros(())

    found = plain_call(Anything(), MB)
    assert found is not None and found[1].startswith("Anything.forward(input_ids=...")


def test_a_forward_annotated_with_microbatch_gets_it() -> None:
    found = plain_call(ToyModel(ToyConfig(), "d"), MB)
    assert found is not None and found[1] == "ToyModel.forward(microbatch)"


def _grads(*values: float) -> list[Tensor | None]:
    return [torch.full((4,), v) for v in values]


def test_the_tolerance() -> None:
    names = ["a", "b"]
    loss = torch.tensor(2.0)
    g = [torch.randn(64), torch.randn(64)]
    assert _first_difference(loss, loss, g, [t.clone() for t in g], names) is None
    noisy = [t * (1 + 1e-3 * torch.randn(64)) for t in g]  # rounding-sized
    assert _first_difference(loss, loss, g, noisy, names) is None
    # A gradient zero mathematically: exactly 0 in one path, 1e-10 noise in the other.
    zero, noise = [g[0], torch.zeros(64)], [g[0], torch.full((64,), 1e-10)]
    assert _first_difference(loss, loss, zero, noise, names) is None
    # No gradient in one path, zeros in the other: the same.
    assert _first_difference(loss, loss, [g[0], None], [g[0], torch.zeros(64)], names) is None
    off = [g[0], g[1] * 1.2]
    found = _first_difference(loss, loss, g, off, names)
    assert found is not None and found.startswith("first parameter b: gradients differ by max")
    found = _first_difference(loss, loss, [g[0], None], g, names)
    assert found is not None and "first parameter b: no gradient through the schedule" in found
    found = _first_difference(loss, torch.tensor(2.5), g, g, names)
    assert found == "the loss: 2 through the schedule, 2.5 through forward"


def test_what_the_check_cannot_compare_is_named() -> None:
    model = ToyModel(ToyConfig(), "d")

    def reason() -> str | None:
        params = _parameters(model)
        assert params is not None
        return _skip_reason(model, params)

    assert reason() is None
    handle = model.embedding.weight.register_hook(lambda g: g)  # type: ignore[no-untyped-call]
    assert reason() == "parameters with gradient hooks (they would run for the check's passes)"
    handle.remove()
    assert reason() is None
    model.output.weight.main_grad = torch.zeros(1)  # type: ignore[attr-defined]  # pyright: ignore[reportAttributeAccessIssue]
    found = reason()
    assert found is not None and found.startswith("parameters with a main_grad")
    del model.output.weight.main_grad  # type: ignore[attr-defined]  # pyright: ignore[reportAttributeAccessIssue]
    model.post_process = False
    assert reason() == "not a whole model (a pipeline stage)"
