"""DelayedWgradGroupedLinear: ragged groups (GroupSizes), capacity-padded input, misuse."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_overlap import ConfigError
from moe_overlap.blocks import DelayedWgradGroupedLinear, GroupSizes
from moe_overlap.wgrad import claim_wgrad


def _linear(delay: bool) -> DelayedWgradGroupedLinear:
    torch.manual_seed(0)
    layer = DelayedWgradGroupedLinear(3, 4, 5, delay_wgrad=delay)
    torch.nn.init.normal_(layer.weight)
    return layer


def test_group_sizes_is_the_sequence_of_its_sizes() -> None:
    sizes = GroupSizes([2, 0, 3], torch.tensor([2, 2, 5], dtype=torch.int32))
    assert list(sizes) == [2, 0, 3] and len(sizes) == 3 and sizes[2] == 3 and sum(sizes) == 5
    assert sizes.sizes == (2, 0, 3) and repr(sizes) == "GroupSizes([2, 0, 3])"


@pytest.mark.parametrize("delay", [False, True])
def test_ragged_groups_match_one_linear_per_group(delay: bool) -> None:
    layer = _linear(delay)
    x = torch.randn(5, 4, requires_grad=True)
    sizes = GroupSizes([2, 0, 3], torch.tensor([2, 2, 5], dtype=torch.int32))
    y = layer(x, sizes)
    parts = [F.linear(x[:2], layer.weight[0]), F.linear(x[2:], layer.weight[2])]
    torch.testing.assert_close(y, torch.cat(parts), rtol=0, atol=0)
    with claim_wgrad(layer):  # what a schedule that runs backward_dw does
        y.square().sum().backward()
    if delay:
        assert layer.weight.grad is None and layer.pending_wgrad == 1
        layer.backward_dw()
    grad = layer.weight.grad
    assert grad is not None and grad[1].abs().sum() == 0  # the empty group


def test_padded_input_is_one_batched_product_and_delay_is_exact() -> None:
    x = torch.randn(3, 2, 4)
    results = []
    for delay in (False, True):
        layer = _linear(delay)
        xi = x.clone().requires_grad_()
        y = layer(xi, ())
        expected = torch.stack([F.linear(x[g], layer.weight[g]) for g in range(3)])
        torch.testing.assert_close(y, expected)
        with claim_wgrad(layer):
            y.square().sum().backward()
        if delay:
            layer.backward_dw()
        assert layer.weight.grad is not None and xi.grad is not None
        results.append((layer.weight.grad, xi.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_sizes_that_do_not_cover_the_rows_are_refused() -> None:
    layer = _linear(False)
    with pytest.raises(ConfigError, match=r"3 group sizes summing to the 5 rows.*\[2, 2\]"):
        layer(torch.randn(5, 4), [2, 2])
    with pytest.raises(ConfigError, match=r"3 group sizes summing to the 5 rows.*\[2, 2, 2\]"):
        layer(torch.randn(5, 4), [2, 2, 2])
    with pytest.raises(ConfigError, match=r"padded input \[groups=3"):
        layer(torch.randn(2, 2, 4), ())


@pytest.mark.parametrize("delay", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_autocast_around_forward_only_matches_one_linear_per_group(
    delay: bool, padded: bool
) -> None:
    """The forward inside ``torch.autocast`` (bfloat16), ``backward()`` and
    ``backward_dw()`` outside: bit-identical to one ``F.linear`` per group under the same
    autocast, input and weight gradients alike. The backward used to multiply the
    bfloat16 output gradient by the float32 weight (a RuntimeError)."""
    layer = _linear(delay)
    weight = layer.weight.detach().clone().requires_grad_()
    x = torch.randn(3, 2, 4) if padded else torch.randn(5, 4)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    sizes = GroupSizes([2, 0, 3])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ya = layer(xa, () if padded else sizes)
        if padded:
            yb = torch.stack([F.linear(xb[g], weight[g]) for g in range(3)])
        else:
            yb = torch.cat([F.linear(xb[:2], weight[0]), F.linear(xb[2:], weight[2])])
    gy = torch.randn(ya.shape, dtype=torch.bfloat16)
    with claim_wgrad(layer):
        ya.backward(gy)
    if delay:
        layer.backward_dw()
    torch.autograd.backward(yb, gy)
    assert ya.dtype == torch.bfloat16 and torch.equal(ya, yb)
    assert xa.grad is not None and xb.grad is not None and torch.equal(xa.grad, xb.grad)
    grad, ref = layer.weight.grad, weight.grad
    assert grad is not None and ref is not None
    assert grad.dtype == torch.float32 and torch.equal(grad, ref)
