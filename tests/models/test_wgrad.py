"""Delayed weight gradients: exactness, gradcheck and misuse detection."""

from __future__ import annotations

import copy
import dataclasses
import gc
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

from moe_overlap import (
    ConfigError,
    ModelChunkSchedulePlan,
    ScheduleError,
    ScheduleOptions,
    WgradError,
    combined_1f1b,
)
from moe_overlap.blocks import (
    DelayedWgradGroupedLinear,
    DelayedWgradLinear,
    DelayedWgradModule,
    accumulate_grad,
    discard_wgrad,
    finish_wgrad,
)
from moe_overlap.models import GPTMoEModel
from moe_overlap.wgrad import check_wgrad_done, claim_wgrad, owed_wgrad, wgrad_claimed
from tests.models._helpers import SMALL, microbatches


def _linear(delay: bool, dtype: torch.dtype = torch.float64) -> DelayedWgradLinear:
    torch.manual_seed(0)
    lin = DelayedWgradLinear(5, 3, delay_wgrad=delay, dtype=dtype)
    torch.nn.init.normal_(lin.weight)
    return lin


def test_linear_gradcheck_immediate() -> None:
    """gradcheck over input and weight (swapped in with functional_call)."""
    lin = _linear(False)
    x = torch.randn(4, 2, 5, dtype=torch.float64, requires_grad=True)
    w = lin.weight.detach().clone().requires_grad_(True)

    def f(a: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.func.functional_call(lin, {"weight": weight}, (a,))
        return out

    assert torch.autograd.gradcheck(f, (x, w))


@pytest.mark.parametrize("delay", [False, True])
def test_linear_matches_autograd_float64(delay: bool) -> None:
    lin = _linear(delay)
    x = torch.randn(4, 2, 5, dtype=torch.float64, requires_grad=True)
    gy = torch.randn(4, 2, 3, dtype=torch.float64)
    with claim_wgrad(lin):
        lin(x).backward(gy)
    if delay:
        assert lin.weight.grad is None and lin.pending_wgrad == 1
        lin.backward_dw()
    ref_w = lin.weight.detach().clone().requires_grad_(True)
    ref_x = x.detach().clone().requires_grad_(True)
    torch.autograd.backward(torch.nn.functional.linear(ref_x, ref_w), gy)
    assert x.grad is not None and ref_x.grad is not None
    assert lin.weight.grad is not None and ref_w.grad is not None
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lin.weight.grad, ref_w.grad, rtol=1e-12, atol=1e-12)


def test_gradcheck_through_delay() -> None:
    """torch.autograd.gradcheck on the input; the weight grad checked after backward_dw."""
    lin = _linear(True)
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)

    def f(a: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = lin(a)
        return out

    with claim_wgrad(lin):
        assert torch.autograd.gradcheck(f, (x,))
    assert lin.pending_wgrad > 0
    finish_wgrad(lin)  # gradcheck ran backward several times
    assert lin.pending_wgrad == 0


def test_grouped_matches_per_group_autograd() -> None:
    torch.manual_seed(0)
    sizes = [3, 0, 2, 1]
    g = DelayedWgradGroupedLinear(4, 5, 3, delay_wgrad=True, dtype=torch.float64)
    torch.nn.init.normal_(g.weight)
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    gy = torch.randn(6, 3, dtype=torch.float64)
    with claim_wgrad(g):
        g(x, sizes).backward(gy)
    assert g.weight.grad is None
    g.backward_dw()
    w = g.weight.detach().clone().requires_grad_(True)
    xr = x.detach().clone().requires_grad_(True)
    parts = torch.split(xr, sizes)
    ref = torch.cat([torch.nn.functional.linear(p, w[i]) for i, p in enumerate(parts)])
    torch.autograd.backward(ref, gy)
    assert g.weight.grad is not None and w.grad is not None and x.grad is not None
    torch.testing.assert_close(g.weight.grad, w.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, xr.grad)
    assert torch.equal(g.weight.grad[1], torch.zeros_like(g.weight.grad[1]))


def test_delayed_bit_identical_to_immediate() -> None:
    now, later = _linear(False, torch.float32), _linear(True, torch.float32)
    for _ in range(2):  # second pass accumulates
        x = torch.randn(7, 5)
        gy = torch.randn(7, 3)
        now(x.requires_grad_()).backward(gy)
        with claim_wgrad(later):
            later(x.detach().requires_grad_()).backward(gy)
        assert later.pending_wgrad == 1
        later.backward_dw()
    assert now.weight.grad is not None and later.weight.grad is not None
    assert torch.equal(now.weight.grad, later.weight.grad)


def test_double_backward_dw_raises() -> None:
    lin = _linear(True)
    with claim_wgrad(lin):
        lin(torch.randn(2, 5, dtype=torch.float64, requires_grad=True)).sum().backward()
    lin.backward_dw()
    with pytest.raises(WgradError, match="expected a pending weight gradient"):
        lin.backward_dw()


def test_backward_dw_without_delay_raises() -> None:
    with pytest.raises(WgradError, match="delay_wgrad=False"):
        _linear(False).backward_dw()


def _delayed_model() -> GPTMoEModel:
    return GPTMoEModel(dataclasses.replace(SMALL, delay_wgrad_compute=True))


def test_pending_wgrad_detected_at_next_forward() -> None:
    """A backward a claim made queue (a custom schedule) and nothing computed is owed."""
    model = _delayed_model()
    mb = microbatches(1, vocab=SMALL.vocab_size)[0]
    assert mb.input_ids is not None
    with claim_wgrad(model):
        model(mb.input_ids, mb.position_ids, mb.labels, mb.loss_mask).backward()
    assert owed_wgrad(model)
    with pytest.raises(WgradError, match="pending"):
        check_wgrad_done(model)
    with pytest.raises(WgradError, match=r"decoder\.layers\.0\.attn_block\.attention\.qkv"):
        model(mb.input_ids, mb.position_ids, mb.labels, mb.loss_mask)
    finish_wgrad(model)
    check_wgrad_done(model)
    model(mb.input_ids, mb.position_ids, mb.labels, mb.loss_mask)


@pytest.mark.parametrize("delay", [True, False])
def test_schedule_option_that_contradicts_the_model_is_refused(delay: bool) -> None:
    """The layers decide what is delayed; an option saying otherwise fails at plan build."""
    model = _delayed_model() if delay else GPTMoEModel(SMALL)
    data = microbatches(2, vocab=SMALL.vocab_size)
    with pytest.raises(ConfigError, match=r"decoder\.layers\[0\]: ScheduleOptions\(delay_wgrad"):
        combined_1f1b(model, data, options=ScheduleOptions(delay_wgrad_compute=not delay))
    assert all(p.grad is None for p in model.parameters())
    check_wgrad_done(model)
    combined_1f1b(model, data)  # the layers' own choice
    check_wgrad_done(model)


def test_pending_wgrad_left_by_a_claimed_backward_blocks_the_step() -> None:
    """A claimed backward whose wgrad nothing ran leaves it pending: the step refuses to start."""
    model = _delayed_model()
    data = microbatches(2, vocab=SMALL.vocab_size)
    mb = data[0]
    with claim_wgrad(model):
        model(mb.input_ids, labels=mb.labels).backward()
    with pytest.raises(WgradError, match="before the step"):
        combined_1f1b(model, data)
    model.zero_grad(set_to_none=True)
    discard_wgrad(model)
    combined_1f1b(model, data)
    check_wgrad_done(model)


def test_delayed_weight_gradients_carry_no_graph() -> None:
    """backward_dw runs without autograd: the grads are plain tensors, nothing kept alive."""
    model = _delayed_model()
    combined_1f1b(model, microbatches(2, vocab=SMALL.vocab_size))
    delayed = [p for m in model.modules() if isinstance(m, DelayedWgradModule) for p in [m.weight]]
    assert delayed
    for p in delayed:
        assert p.grad is not None
        assert p.grad.grad_fn is None and not p.grad.requires_grad
        p.grad.numpy()  # raises for a grad that requires grad


def test_backward_dw_of_a_frozen_weight_is_a_no_op() -> None:
    lin = _linear(True)
    lin.weight.requires_grad_(False)
    x = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
    lin(x).sum().backward()
    assert lin.pending_wgrad == 0
    lin.backward_dw()
    assert lin.weight.grad is None and x.grad is not None


def test_schedule_with_frozen_attention_and_delayed_wgrad() -> None:
    """Fine-tuning with frozen attention: the delayed schedule still matches plain backward."""
    config = dataclasses.replace(SMALL, delay_wgrad_compute=True)
    scheduled = GPTMoEModel(config)
    plain = GPTMoEModel(dataclasses.replace(config, delay_wgrad_compute=False))
    for model in (scheduled, plain):
        for layer in model.layer_list:
            layer.attn_block.attention.requires_grad_(False)
    data = microbatches(3, vocab=SMALL.vocab_size)
    losses = combined_1f1b(scheduled, data, options=scheduled.schedule_options())
    check_wgrad_done(scheduled)
    for mb, loss in zip(data, losses, strict=True):
        assert mb.input_ids is not None
        ref = plain(mb.input_ids, mb.position_ids, mb.labels, mb.loss_mask)
        ref.backward()
        assert torch.equal(loss, ref.detach())
    for (name, p), q in zip(scheduled.named_parameters(), plain.parameters(), strict=True):
        if "attention" in name:
            assert p.grad is None and q.grad is None, name
        else:
            assert p.grad is not None and q.grad is not None, name
            assert torch.equal(p.grad, q.grad), name


# --- issue 42: a delayed module computes its weight gradient at once unless claimed ------------


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is b if a is None or b is None else torch.equal(a, b)


def _assert_same_grads(got: torch.nn.Module, want: torch.nn.Module, what: str) -> None:
    g, w = _grads(got), _grads(want)
    assert list(g) == list(w), what
    differ = [n for n in w if not _same(g[n], w[n])]
    assert not differ, f"{what}: {len(differ)} gradients differ, e.g. {differ[:3]}"


@pytest.mark.parametrize("recompute", [(), ("attention", "activation")])
def test_plain_backward_of_a_delayed_model_and_of_its_copy_is_exact(
    recompute: tuple[str, ...],
) -> None:
    """Nothing claims the delayed linears of a plain ``loss.backward()`` (recomputed parts
    included): every weight gradient is computed at once, bit-identical to the model built
    without delay; so is a deep copy's, taken after the original ran the schedule."""
    parts: Any = recompute
    config = dataclasses.replace(SMALL, delay_wgrad_compute=True, recompute=parts)
    delayed = GPTMoEModel(config)
    undelayed = GPTMoEModel(dataclasses.replace(config, delay_wgrad_compute=False))
    undelayed.load_state_dict(delayed.state_dict())
    data = microbatches(2, vocab=SMALL.vocab_size)
    combined_1f1b(delayed, data, options=delayed.schedule_options())
    delayed.zero_grad(set_to_none=True)
    copied = copy.deepcopy(delayed)
    for model in (undelayed, delayed, copied):
        for mb in data:
            assert mb.input_ids is not None
            model(mb.input_ids, mb.position_ids, mb.labels, mb.loss_mask).backward()
    for model, what in ((delayed, "the delayed model"), (copied, "its deep copy")):
        assert not owed_wgrad(model), what
        _assert_same_grads(model, undelayed, what)


def test_claims_last_from_plan_build_to_release_and_end_with_the_step() -> None:
    """A layer plan claims its listed modules until release_state, or until it is collected
    unreleased; a failed step's plans release theirs; claims nest."""
    model = _delayed_model()
    delayed = [m for m in model.modules() if isinstance(m, DelayedWgradModule)]
    data = microbatches(2, vocab=SMALL.vocab_size)
    plan = ModelChunkSchedulePlan(model, data[0])
    assert all(wgrad_claimed(m) for m in delayed)
    plan.release_state()
    assert not any(wgrad_claimed(m) for m in delayed)
    plan = ModelChunkSchedulePlan(model, data[0])
    del plan
    gc.collect()
    assert not any(wgrad_claimed(m) for m in delayed)
    combined_1f1b(model, data)
    assert not any(wgrad_claimed(m) for m in delayed)
    with claim_wgrad(model):
        with claim_wgrad(delayed[0]):
            assert wgrad_claimed(delayed[0])
        assert all(wgrad_claimed(m) for m in delayed)
        assert not any(wgrad_claimed(m) for m in copy.deepcopy(model).modules())
    assert not any(wgrad_claimed(m) for m in delayed)


def test_a_failed_step_releases_its_claims() -> None:
    model = _delayed_model()
    data = microbatches(2, vocab=SMALL.vocab_size)
    layer = model.layer_list[1]
    original = layer.slot_mlp
    calls: list[int] = []

    def flaky(node: Any, inputs: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("expert kernel failed")
        return original(node, inputs)

    vars(layer)["slot_mlp"] = flaky
    try:
        with pytest.raises(ScheduleError, match="expert kernel failed"):
            combined_1f1b(model, data)
    finally:
        del vars(layer)["slot_mlp"]
    assert not any(wgrad_claimed(m) for m in model.modules())
    discard_wgrad(model)
    model.zero_grad(set_to_none=True)
    mb = data[0]
    assert mb.input_ids is not None
    model(mb.input_ids, mb.position_ids, mb.labels, mb.loss_mask).backward()
    assert not owed_wgrad(model)


def test_a_copy_of_a_module_owing_weight_gradients_is_refused() -> None:
    lin = _linear(True)
    with claim_wgrad(lin):
        lin(torch.randn(2, 5, dtype=torch.float64, requires_grad=True)).sum().backward()
    with pytest.raises(WgradError, match=r"deepcopy expected no delayed weight gradient pending"):
        copy.deepcopy(lin)
    lin.backward_dw()
    dup = copy.deepcopy(lin)
    assert dup.pending_wgrad == 0 and dup._pending is not lin._pending


def _plain_steps(model: GPTMoEModel, data: list[Any]) -> list[torch.Tensor]:
    """Plain ``loss.backward()`` per microbatch (the delayed wgrad of each finished)."""
    losses = []
    for mb in data:
        loss = model(mb.input_ids, mb.position_ids, labels=mb.labels, loss_mask=mb.loss_mask)
        loss.backward()
        finish_wgrad(model)
        losses.append(loss.detach())
    return losses


def _assert_same_dtype_grads(a: GPTMoEModel, b: GPTMoEModel) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        assert p.grad.dtype == q.grad.dtype, name
        assert torch.equal(p.grad, q.grad), name


@pytest.mark.parametrize("chunks", [1, 2])
def test_delayed_wgrad_under_autocast_is_exact(chunks: int) -> None:
    """Under ``torch.autocast`` a delayed weight gradient comes out in bfloat16, as the
    immediate one does inside autograd, which casts it to the weight's dtype before
    accumulating: so does ``backward_dw`` (each of a chunked expert's parts before the
    sum). It used to assign the bfloat16 tensor to the float32 ``.grad`` (a RuntimeError
    in the middle of the step)."""
    config = dataclasses.replace(SMALL, delay_wgrad_compute=True, moe_a2a_chunks=chunks)
    scheduled, plain = GPTMoEModel(config), GPTMoEModel(config)
    data = microbatches(3, vocab=SMALL.vocab_size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for _ in range(2):  # the second step accumulates into .grad
            losses = combined_1f1b(scheduled, data, fill_drain=True)
            expected = _plain_steps(plain, data)
            assert all(torch.equal(a, b) for a, b in zip(losses, expected, strict=True))
    _assert_same_dtype_grads(scheduled, plain)


@pytest.mark.parametrize("chunks", [1, 2])
def test_delayed_wgrad_into_a_grad_dtype_is_exact(chunks: int) -> None:
    """``param.grad_dtype = torch.float32`` on a bfloat16 model (float32 gradients):
    autograd casts each part before accumulating, and so does ``backward_dw``."""
    if not hasattr(torch.nn.Parameter(torch.zeros(1)), "grad_dtype"):
        pytest.skip("this torch has no Tensor.grad_dtype")
    config = dataclasses.replace(
        SMALL, delay_wgrad_compute=True, dtype=torch.bfloat16, moe_a2a_chunks=chunks
    )
    scheduled, plain = GPTMoEModel(config), GPTMoEModel(config)
    for p in [*scheduled.parameters(), *plain.parameters()]:
        p.grad_dtype = torch.float32
    data = microbatches(3, vocab=SMALL.vocab_size)
    losses = combined_1f1b(scheduled, data)
    assert all(torch.equal(a, b) for a, b in zip(losses, _plain_steps(plain, data), strict=True))
    _assert_same_dtype_grads(scheduled, plain)
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in plain.parameters())


_HOOKED = (
    r"GPTMoEModel: decoder\.layers\.1\.experts\.fc1\.weight: expected no gradient hook on a "
    r"weight whose gradient the schedule delays .*received 1 hook .*before backward_dw\(\) "
    r"computes its gradient.*delay_wgrad_compute=False"
)


@pytest.mark.parametrize("kind", ["register_hook", "post_accumulate"])
def test_a_gradient_hook_on_a_delayed_weight_is_refused(kind: str) -> None:
    """Autograd runs a weight's hooks when the backward reaches it, before ``backward_dw``
    computes the delayed gradient (``register_hook``'s with ``None``): an optimizer
    stepped in a post-accumulate-grad hook saw ``.grad`` without the microbatch's part. The
    plan is refused when built, before anything runs; without the hook the step is exact."""
    config = dataclasses.replace(SMALL, delay_wgrad_compute=True)
    scheduled, plain = GPTMoEModel(config), GPTMoEModel(config)
    data = microbatches(2, vocab=SMALL.vocab_size)
    weight = scheduled.get_parameter("decoder.layers.1.experts.fc1.weight")
    seen: list[torch.Tensor | None] = []
    if kind == "register_hook":
        handle = weight.register_hook(seen.append)  # type: ignore[no-untyped-call]
    else:
        handle = weight.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
            lambda p: seen.append(p.grad)
        )
    with pytest.raises(WgradError, match=_HOOKED):
        combined_1f1b(scheduled, data)
    with pytest.raises(WgradError, match=_HOOKED):  # plans driven by hand, when built
        ModelChunkSchedulePlan(scheduled, data[0], index=0)
    assert seen == [] and all(p.grad is None for p in scheduled.parameters())
    handle.remove()
    losses = combined_1f1b(scheduled, data)
    assert all(torch.equal(a, b) for a, b in zip(losses, _plain_steps(plain, data), strict=True))
    _assert_same_dtype_grads(scheduled, plain)


def test_gradient_hooks_on_weights_autograd_accumulates_run_as_in_plain_backward() -> None:
    """A hook on a parameter whose gradient is not delayed (the embedding, a router, a
    norm; a delayed weight that is frozen) is accepted: it runs as often, seeing the same
    ``.grad``, as under plain ``backward()``."""
    config = dataclasses.replace(SMALL, delay_wgrad_compute=True)
    scheduled, plain = GPTMoEModel(config), GPTMoEModel(config)
    seen: dict[str, list[list[torch.Tensor]]] = {}
    for model in (scheduled, plain):
        frozen = model.get_parameter("decoder.layers.2.experts.fc2.weight")
        frozen.register_hook(lambda g: g)  # type: ignore[no-untyped-call]
        frozen.requires_grad_(False)  # frozen after: the hook stays, never runs
        views = seen.setdefault("scheduled" if model is scheduled else "plain", [])
        for name in ("embedding.weight", "decoder.layers.1.router.weight", "final_norm.weight"):
            p = model.get_parameter(name)
            views.append([])
            p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                lambda q, got=views[-1]: got.append(q.grad.clone())
            )
    data = microbatches(3, vocab=SMALL.vocab_size)
    losses = combined_1f1b(scheduled, data)
    assert all(torch.equal(a, b) for a, b in zip(losses, _plain_steps(plain, data), strict=True))
    for got, want in zip(seen["scheduled"], seen["plain"], strict=True):
        assert len(got) == len(want) == 3
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


class _Scaled(torch.nn.Module):
    """A parametrization: the weight is computed from the parameter it replaces."""

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w * 1.5


def test_a_parametrized_delayed_weight_is_refused_before_any_gradient() -> None:
    """``torch.nn.utils.parametrize`` makes ``fc1.weight`` a tensor computed at every read:
    ``backward_dw()`` wrote the delayed gradient to that throwaway tensor, and the parameter
    it is computed from got none (silently). Refused at the slot's first forward inside a
    schedule; plain ``backward()`` (unclaimed: computed at once) still reaches it."""
    config = dataclasses.replace(SMALL, delay_wgrad_compute=True)
    model = GPTMoEModel(config)
    fc1 = model.get_submodule("decoder.layers.0.mlp.fc1")
    assert isinstance(fc1, DelayedWgradLinear)
    torch.nn.utils.parametrize.register_parametrization(fc1, "weight", _Scaled())
    data = microbatches(2, vocab=SMALL.vocab_size)
    with pytest.raises(ScheduleError, match=r"layer 0, slot mlp, forward") as error:
        combined_1f1b(model, data)
    assert isinstance(error.value.__cause__, ConfigError)
    assert re.search(
        r"decoder\.layers\.0\.mlp\.fc1: expected a leaf weight \(an nn\.Parameter\) to "
        r"accumulate a delayed weight gradient into, received a computed one .*"
        r"delay_wgrad_compute=False\), or remove the parametrization",
        str(error.value.__cause__),
    )
    assert all(p.grad is None for p in model.parameters())
    _plain_steps(model, data[:1])
    original = model.get_parameter("decoder.layers.0.mlp.fc1.parametrizations.weight.original")
    assert original.grad is not None and bool(original.grad.abs().sum() > 0)


_BF16 = torch.bfloat16


@pytest.mark.parametrize("delay", [False, True])
def test_a_linear_under_autocast_around_forward_only_is_nn_linear(delay: bool) -> None:
    """torch's recommended autocast use: the forward inside ``torch.autocast``,
    ``backward()`` (and here ``backward_dw()``) outside. The linear's backward runs under
    its forward's autocast state, as ``torch.amp.custom_bwd`` runs one, and so does the
    delayed weight gradient: bit-identical to ``nn.Linear``. The backward used to multiply
    the bfloat16 output gradient by the float32 weight (a RuntimeError)."""
    lin = _linear(delay, torch.float32)
    ref = torch.nn.Linear(5, 3, bias=False)
    with torch.no_grad():
        ref.weight.copy_(lin.weight)
    x = torch.randn(4, 2, 5)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=_BF16):
        ya, yb = lin(xa), ref(xb)
    gy = torch.randn(4, 2, 3, dtype=_BF16)
    with claim_wgrad(lin):
        ya.backward(gy)
    if delay:
        assert lin.weight.grad is None and lin.pending_wgrad == 1
        lin.backward_dw()
    yb.backward(gy)
    assert ya.dtype == _BF16 and torch.equal(ya, yb)
    for got, want in ((xa.grad, xb.grad), (lin.weight.grad, ref.weight.grad)):
        assert got is not None and want is not None
        assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want)


def test_a_delayed_weight_gradient_is_computed_under_its_forward_autocast_state() -> None:
    """``backward_dw()`` inside ``torch.autocast`` for a forward that ran outside computes
    in float32, as the immediate gradient was (it used to compute in bfloat16)."""
    now, later = _linear(False, torch.float32), _linear(True, torch.float32)
    x, gy = torch.randn(7, 5), torch.randn(7, 3)
    now(x.clone().requires_grad_()).backward(gy)
    with claim_wgrad(later):
        later(x.clone().requires_grad_()).backward(gy)
    with torch.autocast("cpu", dtype=_BF16):
        later.backward_dw()
    assert now.weight.grad is not None and later.weight.grad is not None
    assert torch.equal(now.weight.grad, later.weight.grad)


@pytest.mark.parametrize("delay", [False, True])
def test_autocast_around_forward_only_matches_the_schedule_under_autocast(delay: bool) -> None:
    """The reference model with its forward alone under ``torch.autocast`` (plain
    ``backward()`` outside; with delayed weight gradients, the backward claimed and
    ``finish_wgrad`` outside too) is bit-identical to ``combined_1f1b`` run inside it."""
    config = dataclasses.replace(SMALL, delay_wgrad_compute=delay)
    scheduled, plain = GPTMoEModel(config), GPTMoEModel(config)
    data = microbatches(3, vocab=SMALL.vocab_size)
    expected = []
    for mb in data:
        with torch.autocast("cpu", dtype=_BF16):
            loss = plain(mb.input_ids, mb.position_ids, labels=mb.labels, loss_mask=mb.loss_mask)
        with claim_wgrad(plain):
            loss.backward()
        assert {m.pending_wgrad for m in plain.modules() if isinstance(m, DelayedWgradModule)} == {
            int(delay)
        }
        finish_wgrad(plain)
        expected.append(loss.detach())
    with torch.autocast("cpu", dtype=_BF16):
        losses = combined_1f1b(scheduled, data)
    assert all(torch.equal(a, b) for a, b in zip(losses, expected, strict=True))
    _assert_same_dtype_grads(scheduled, plain)


def test_a_listed_module_whose_delay_was_turned_off_is_refused_at_plan_build() -> None:
    """A delayable linear its layer lists for ``backward_dw()``, its ``delay_wgrad`` set to
    False after it was built: its backward would compute the gradient at once and the
    layer's ``backward_dw()`` refused it mid-step, after gradients were accumulated. Now a
    ``WgradError`` when the plan is built, nothing run; set back, the step is exact."""
    config = dataclasses.replace(SMALL, delay_wgrad_compute=True)
    scheduled, plain = GPTMoEModel(config), GPTMoEModel(config)
    fc1 = scheduled.get_submodule("decoder.layers.1.experts.fc1")
    assert isinstance(fc1, DelayedWgradModule)
    data = microbatches(2, vocab=SMALL.vocab_size)
    fc1.delay_wgrad = False
    with pytest.raises(
        WgradError,
        match=r"decoder\.layers\.1\.experts\.fc1 \(DelayedWgradGroupedLinear\): expected "
        r"delay_wgrad=True of a module decoder\.layers\[1\] lists for backward_dw\(\).*"
        r"received delay_wgrad=False",
    ):
        combined_1f1b(scheduled, data)
    assert all(p.grad is None for p in scheduled.parameters())
    fc1.delay_wgrad = True
    losses = combined_1f1b(scheduled, data)
    assert all(torch.equal(a, b) for a, b in zip(losses, _plain_steps(plain, data), strict=True))
    _assert_same_dtype_grads(scheduled, plain)


def _restrided(lin: DelayedWgradModule, layout: str) -> None:
    """``lin.weight`` replaced by a parameter of the same values in another layout."""
    w = lin.weight.detach()
    if layout == "transposed":  # the storage of the transpose: strides (..., 1, rows)
        lin.weight = torch.nn.Parameter(w.transpose(-2, -1).contiguous().transpose(-2, -1))
    elif layout == "strided":  # every other column of a wider tensor: not dense
        wide = torch.zeros(*w.shape[:-1], 2 * w.shape[-1])
        wide[..., ::2] = w
        lin.weight = torch.nn.Parameter(wide[..., ::2])


@pytest.mark.parametrize("layout", ["default", "transposed", "strided"])
@pytest.mark.parametrize("grouped", [False, True])
def test_a_delayed_weight_gradient_is_laid_out_as_plain_backward_lays_it_out(
    layout: str, grouped: bool
) -> None:
    """torch's gradient layout contract: a first gradient takes a dense parameter's
    strides (contiguous for another parameter), so bucket views and optimizers see what
    plain ``backward()`` gives. ``backward_dw`` assigned the weight gradient with its own
    strides (contiguous where a transposed-storage weight's are ``(1, rows)``)."""
    grads: list[torch.Tensor] = []
    for delay in (False, True):
        torch.manual_seed(0)
        lin: DelayedWgradModule
        if grouped:
            lin = DelayedWgradGroupedLinear(2, 5, 3, delay_wgrad=delay)
        else:
            lin = DelayedWgradLinear(5, 3, delay_wgrad=delay)
        torch.nn.init.normal_(lin.weight)
        _restrided(lin, layout)
        x = torch.randn(6, 5)
        with claim_wgrad(lin):
            y = lin(x, [4, 2]) if grouped else lin(x)
            y.square().sum().backward()
        if delay:
            lin.backward_dw()
        assert lin.weight.grad is not None
        grads.append(lin.weight.grad)
        if layout != "strided":
            assert lin.weight.grad.stride() == lin.weight.stride()
    now, later = grads
    assert later.stride() == now.stride() and torch.equal(later, now)


class _Hand(torch.autograd.Function):
    """Identity whose backward hands autograd the gradient in ``box`` (and keeps no
    reference to it: a fresh gradient, as a backward's output is)."""

    @staticmethod
    def forward(ctx: Any, p: torch.Tensor, box: list[torch.Tensor]) -> torch.Tensor:
        ctx.box = box
        return p.view_as(p)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.box.pop(), None


def _laid_out(layout: str) -> torch.Tensor:
    torch.manual_seed(1)
    if layout == "transposed":
        return torch.randn(3, 4).t()
    if layout == "strided":
        return torch.randn(4, 6)[:, ::2]
    return torch.randn(1, 3) if layout == "size-1 dim" else torch.randn(4, 3)


@pytest.mark.parametrize("layout", ["default", "transposed", "size-1 dim", "strided"])
def test_accumulate_grad_lays_a_first_gradient_out_as_autograd_does(layout: str) -> None:
    """A gradient of other strides than the parameter's (transposed, broadcast) is copied
    into the parameter's layout (a dense one) or a contiguous one (another), as
    ``AccumulateGrad`` copies it; one that obeys the contract is kept as it is."""
    shape = _laid_out(layout).shape
    makers: list[Callable[[], torch.Tensor]] = [
        lambda: torch.randn(shape[::-1]).t(),
        lambda: torch.randn(shape),
        lambda: torch.randn(shape[-1]).expand(shape),
        lambda: torch.randn(shape[::-1]).t().contiguous(),
    ]
    for make in makers:
        torch.manual_seed(2)
        mine = torch.nn.Parameter(_laid_out(layout))
        accumulate_grad(mine, make())
        torch.manual_seed(2)
        ref = torch.nn.Parameter(_laid_out(layout))
        _hand: Any = _Hand.apply
        _hand(ref, [make()]).sum().backward()
        assert mine.grad is not None and ref.grad is not None
        assert mine.grad.stride() == ref.grad.stride()
        assert torch.equal(mine.grad, ref.grad)


def test_a_linear_does_not_ask_autocast_availability_per_call_on_common_devices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch.compile before torch 2.13 cannot trace ``torch.amp.is_autocast_available``
    inside an autograd Function's forward (a compiled block with a delayable linear failed
    on the GPU with torch 2.11): the answer for common device types is asked once, at
    import, and a forward and backward run with the function made to fail."""

    def refuse(kind: str) -> bool:
        raise AssertionError(f"is_autocast_available({kind!r}) asked per call")

    monkeypatch.setattr(torch.amp, "is_autocast_available", refuse)
    for delay in (False, True):
        lin = _linear(delay, torch.float32)
        x = torch.randn(7, 5, requires_grad=True)
        with claim_wgrad(lin):
            lin(x).sum().backward()
        if delay:
            lin.backward_dw()
        assert lin.weight.grad is not None and x.grad is not None
