"""The torchtitan adapter on one CPU process: the test-only attention stand-in against
flex, the self-check, parity with torchtitan's own forward and backward, the overlap
schedule bit-identical to the adapter's plain path (also with delayed weight gradients and
over optimizer steps with torchtitan's load-balancing hook), refusals."""

from __future__ import annotations

import copy
import functools
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

pytest.importorskip("torchtitan")

from moe_overlap import ConfigError, Microbatch, combined_1f1b
from moe_overlap.adapters.torchtitan import TorchtitanMoEAdapter
from tests.adapters._titan import (
    FAMILIES,
    CausalAttention,
    batch,
    build,
    causal_stand_in,
    eager_block_masks,
)

pytestmark = pytest.mark.filterwarnings(
    # torchtitan's MoE enters a float32 CPU autocast, which torch disables with a warning.
    "ignore:In CPU autocast, but the target dtype is not supported:UserWarning",
    # The self-check's float32 copy of a block casts its complex RoPE cache (see the report).
    "ignore:Casting complex values to real discards the imaginary part:UserWarning",
)

MICROBATCHES = 3
DTYPES = {"gpt_oss": torch.bfloat16}
"""gpt-oss's experts return bfloat16 and its own forward fails in float32: trained in it."""


@functools.cache
def _base(family: str) -> nn.Module:
    """``family``'s tiny model with the causal stand-in, in its training dtype (shared:
    tests take deep copies). Only a model trained in another dtype is cast: ``.to(float32)``
    would turn DeepSeek's and Kimi's complex RoPE caches real."""
    model = causal_stand_in(build(family))
    dtype = DTYPES.get(family)
    if dtype is not None:
        assert not any(b.is_complex() for b in model.buffers()), f"{family}: complex buffers"
        model = model.to(dtype)
    return model


def model_of(family: str) -> nn.Module:
    return copy.deepcopy(_base(family))


@functools.cache
def _batches(family: str, seed: int = 1) -> tuple[dict[str, Tensor], ...]:
    return tuple(batch(_base(family), MICROBATCHES, seed=seed))


def as_microbatch(mb: dict[str, Tensor], *, loss_mask: Tensor | None = None) -> Microbatch:
    return Microbatch(
        input_ids=mb["input_ids"],
        labels=mb["labels"],
        position_ids=mb["position_ids"],
        loss_mask=loss_mask,
    )


def microbatches(family: str, seed: int = 1) -> list[Microbatch]:
    return [as_microbatch(mb) for mb in _batches(family, seed)]


def grads(model: nn.Module) -> dict[str, Tensor | None]:
    """Every parameter's gradient (None where it got none: Kimi's vision encoder in a
    text-only step); a decoder block parameter without one fails the test."""
    out: dict[str, Tensor | None] = {}
    for name, p in model.named_parameters():
        assert p.grad is not None or not name.startswith("layers."), f"{name} got no gradient"
        out[name] = None if p.grad is None else p.grad.detach().clone()
    return out


def moe_buffers(model: nn.Module, what: str) -> dict[str, Tensor]:
    """The MoE buffers named ``what`` (``tokens_per_expert_E``, ``expert_bias_E``)."""
    found = {n: b.detach().clone() for n, b in model.named_buffers() if n.endswith(what)}
    assert found, f"{type(model).__name__} has no {what} buffers"
    return found


def _differ(a: Tensor | None, b: Tensor | None) -> str | None:
    if a is None or b is None:
        return (
            None
            if a is b
            else f"{'no' if a is None else 'a'} gradient vs {'none' if b is None else 'one'}"
        )
    return None if torch.equal(a, b) else f"max diff {float((a - b).abs().max()):.3g}"


def assert_bit_identical(
    got: Mapping[str, Tensor | None], want: Mapping[str, Tensor | None], what: str, where: str
) -> None:
    assert list(got) == list(want), f"{where}: {what}: different names"
    differ = {n: d for n in want if (d := _differ(got[n], want[n])) is not None}
    assert not differ, (
        f"{where}: {what} not bit-identical for {len(differ)} of {len(want)}: "
        + ", ".join(f"{n} ({d})" for n, d in differ.items())
    )


def plain_step(
    adapter: TorchtitanMoEAdapter, mbs: Sequence[Microbatch], *, delay: bool = False
) -> list[Tensor]:
    """The adapter's plain path: forward and backward per microbatch (no schedule claims
    the delayed linears: their weight gradients are computed in backward)."""
    losses = []
    for mb in mbs:
        assert mb.input_ids is not None
        loss = adapter.forward(mb.input_ids, mb.position_ids, labels=mb.labels)
        torch.autograd.backward(loss)
        assert adapter.pending_wgrad == 0, f"delay={delay}: a plain backward left wgrad owed"
        losses.append(loss.detach())
    return losses


def torchtitan_step(model: nn.Module, mbs: Sequence[Microbatch]) -> list[Tensor]:
    """torchtitan's own forward and its cross-entropy, mean over labelled tokens."""
    from torchtitan.components.loss import cross_entropy_loss

    losses = []
    for mb in mbs:
        assert mb.labels is not None
        logits = model(mb.input_ids, positions=mb.position_ids)
        loss = cross_entropy_loss(logits, mb.labels) / (mb.labels != -100).sum()
        loss.backward()
        losses.append(loss.detach())
    return losses


def schedule(adapter: TorchtitanMoEAdapter, mbs: Sequence[Microbatch]) -> list[Tensor]:
    losses = combined_1f1b(adapter, list(mbs), options=adapter.schedule_options())
    return [x.detach() for x in losses]


# --- the stand-in ---------------------------------------------------------------------------
def test_causal_stand_in_equals_flex_attention_in_forward() -> None:
    """:class:`CausalAttention` (what the CPU tests train with) gives torchtitan's
    FlexAttention's output, on the BlockMask the model builds, with GQA and a scale; its
    ``out_transform`` sees flex's log-sum-exp (compared with eager flex: compiled flex on
    CPU does not return it). The model's BlockMask (torchtitan's compiled
    ``create_block_mask``; this model has no stand-in) is the one the stand-in's models
    build eagerly (:func:`~tests.adapters._titan.eager_block_masks`)."""
    from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention
    from torchtitan.models.common.attention import FlexAttention

    model: Any = build("deepseek_v3")
    flex: Any = next(m for m in model.modules() if isinstance(m, FlexAttention))
    positions = torch.arange(16).expand(2, 16)
    masks = model.get_attention_masks(positions)
    with eager_block_masks():
        eager = model.get_attention_masks(positions)
    assert isinstance(masks, BlockMask) and isinstance(eager, BlockMask)
    for name in BlockMask._TENSOR_ATTRS:
        a, b = getattr(masks, name), getattr(eager, name)
        assert (a is None and b is None) or (
            a is not None and b is not None and torch.equal(a, b)
        ), name
    assert (masks.seq_lengths, masks.BLOCK_SIZE) == (eager.seq_lengths, eager.BLOCK_SIZE)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 16, 4, 8, generator=g)
    k, v = torch.randn(2, 16, 2, 8, generator=g), torch.randn(2, 16, 2, 8, generator=g)
    stand_in = CausalAttention()
    with torch.no_grad():
        # One call: each scale is a compile of flex on CPU (tens of seconds cold).
        want = flex(q, k, v, attention_masks=masks, scale=0.3, enable_gqa=True)
        got = stand_in(q, k, v, attention_masks=masks, scale=0.3, enable_gqa=True)
        torch.testing.assert_close(got, want)
        out, aux = flex_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            block_mask=masks,
            enable_gqa=True,
            return_aux=AuxRequest(lse=True),
        )
        seen: list[tuple[Tensor, Tensor]] = []

        def keep(o: Tensor, lse: Tensor) -> Tensor:
            seen.append((o, lse))
            return o

        stand_in(q, k, v, attention_masks=masks, enable_gqa=True, out_transform=keep)
    (o, lse), want_lse = seen[0], aux.lse
    assert want_lse is not None
    torch.testing.assert_close(o, out.transpose(1, 2))
    torch.testing.assert_close(lse, want_lse.transpose(1, 2))


# --- self-check -----------------------------------------------------------------------------
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_self_check_passes(family: str) -> None:
    """Every MoE block structure compared, within tolerance; the model itself untouched
    (the probe runs on copies: no gradients, no token counts, the same state)."""
    model = model_of(family)
    assert all(b.is_complex() for n, b in model.named_buffers() if n.endswith("rope.cache")) or (
        family not in ("deepseek_v3", "kimi_k2_7")
    ), "the test model keeps its complex RoPE cache"
    before = {k: v.clone() for k, v in model.state_dict().items()}
    adapter = TorchtitanMoEAdapter(model)
    after = model.state_dict()
    assert list(after) == list(before)
    changed = [k for k in before if not torch.equal(after[k], before[k])]
    assert not changed, f"{family}: the self-check changed {changed}"
    touched = [n for n, p in model.named_parameters() if p.grad is not None]
    assert not touched, f"{family}: the self-check left gradients on {touched}"
    report = adapter.self_check_report
    assert report.enabled and report.seconds > 0
    assert report.structures, f"{family}: the self-check compared no block structure"
    dtype = DTYPES.get(family, torch.float32)
    for cls, names, difference, probe_dtype in report.structures:
        assert names, cls
        assert probe_dtype == str(dtype).removeprefix("torch."), report
        assert difference == 0.0, report  # bit-identical on CPU: the self-check's bound
    checked = [f"layers.{n}" for _, names, _, _ in report.structures for n in names]
    moe = [layer.name for layer in adapter.decoder.layers if layer.is_moe]
    assert sorted(checked) == sorted(moe), f"{family}: checked {checked}, MoE blocks {moe}"


def test_self_check_refuses_a_split_off_by_rounding() -> None:
    """A MoE whose output is not ``routed + rest`` by a float32 rounding's size (scaled by
    1 + 2**-20 after the sum): the split computes ``routed + rest * s``, off by ~1e-6
    relative. On CPU the self-check holds the split to bit-identity, so it is refused."""
    model = model_of("deepseek_v3")
    moe = model.get_submodule("layers.1.moe")

    class ScaledMoE(type(moe)):  # type: ignore[misc]
        def forward(self, x_BLD: Tensor) -> Tensor:
            out: Tensor = super().forward(x_BLD)
            return out * (1 + 2**-20)

    moe.__class__ = ScaledMoE
    with pytest.raises(ConfigError, match=r"layers\.1 .*expected bit-identical .*self_check=False"):
        TorchtitanMoEAdapter(model)


# --- parity with torchtitan -----------------------------------------------------------------
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_plain_path_matches_torchtitan(family: str) -> None:
    """Losses, every parameter gradient and the load-balancing token counts equal
    torchtitan's own forward and backward bit for bit, in the dtype the model trains in."""
    model = model_of(family)
    mbs = microbatches(family)
    ours = TorchtitanMoEAdapter(copy.deepcopy(model), self_check=False)
    ref = model
    ref_losses = torchtitan_step(ref, mbs)
    losses = plain_step(ours, mbs)
    assert_matches_torchtitan(family, ours.model, losses, ref, ref_losses)


def assert_matches_torchtitan(
    family: str,
    ours: nn.Module,
    losses: Sequence[Tensor],
    ref: nn.Module,
    ref_losses: Sequence[Tensor],
) -> None:
    """Losses, gradients and token counts of ``ours`` equal torchtitan's (``ref``) bit for
    bit (the adapter follows the original's operation order, down to the order autograd
    sums a gradient from several consumers)."""
    where = f"{family} adapter vs torchtitan"
    assert_bit_identical(
        {str(i): t for i, t in enumerate(losses)},
        {str(i): t for i, t in enumerate(ref_losses)},
        "losses",
        where,
    )
    assert_bit_identical(grads(ours), grads(ref), "gradients", where)
    assert_bit_identical(
        moe_buffers(ours, "tokens_per_expert_E"),
        moe_buffers(ref, "tokens_per_expert_E"),
        "tokens_per_expert_E",
        where,
    )


def test_logits_without_labels_are_the_models_own() -> None:
    """Without labels the adapter returns the LM head's logits, as the model's forward."""
    model = model_of("deepseek_v3")
    mb = _batches("deepseek_v3")[0]
    adapter = TorchtitanMoEAdapter(copy.deepcopy(model), self_check=False)
    with torch.no_grad():
        logits = adapter.forward(mb["input_ids"], mb["position_ids"])
        own = model(mb["input_ids"], positions=mb["position_ids"])
    torch.testing.assert_close(logits, own, rtol=1e-5, atol=1e-5 * float(own.abs().max()))


# --- the schedule against the plain path ----------------------------------------------------
@pytest.mark.parametrize("delay", [False, True], ids=["wgrad", "delayed_wgrad"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_schedule_is_bit_identical_to_plain_path(family: str, delay: bool) -> None:
    mbs = microbatches(family)
    plain = TorchtitanMoEAdapter(model_of(family), delay_wgrad_compute=delay, self_check=False)
    sched = TorchtitanMoEAdapter(model_of(family), delay_wgrad_compute=delay, self_check=False)
    plain_losses = plain_step(plain, mbs, delay=delay)
    losses = schedule(sched, mbs)
    assert sched.pending_wgrad == 0 and plain.pending_wgrad == 0
    where = f"{family} (delay_wgrad_compute={delay}) schedule vs plain"
    assert len(losses) == len(mbs)
    assert all(torch.equal(a, b) for a, b in zip(losses, plain_losses, strict=True)), (
        f"{where}: losses {losses} vs {plain_losses}"
    )
    assert_bit_identical(grads(sched.model), grads(plain.model), "gradients", where)
    assert_bit_identical(
        moe_buffers(sched.model, "tokens_per_expert_E"),
        moe_buffers(plain.model, "tokens_per_expert_E"),
        "tokens_per_expert_E",
        where,
    )


# --- delayed linears outside their adapter's schedule (issue 42) -----------------------------
def test_a_second_adapter_on_the_same_model_is_exact_in_every_delay_combination() -> None:
    """Two adapters on one model, delayed wgrad on or off in each: the second's schedule,
    the first's, then torchtitan's own forward and backward, each bit-identical to
    torchtitan's own step on the untouched model, nothing owed (a linear one adapter
    swapped in computes its weight gradient at once for the other and for torchtitan)."""
    family = "deepseek_v3"
    mbs = microbatches(family)
    untouched = model_of(family)
    want_losses, want = torchtitan_step(untouched, mbs), grads(untouched)
    failures: list[str] = []
    for first, second in itertools.product((False, True), repeat=2):
        model = model_of(family)
        a = TorchtitanMoEAdapter(model, delay_wgrad_compute=first, self_check=False)
        b = TorchtitanMoEAdapter(model, delay_wgrad_compute=second, self_check=False)
        steps: list[tuple[str, Callable[[], list[Tensor]]]] = [
            ("the second adapter's schedule", functools.partial(schedule, b, mbs)),
            ("the first adapter's schedule", functools.partial(schedule, a, mbs)),
            ("torchtitan's own step", functools.partial(torchtitan_step, model, mbs)),
        ]
        for what, step in steps:
            where = f"delay {first}, then {second}: {what}"
            model.zero_grad(set_to_none=True)
            try:
                losses = step()
                got = grads(model)
            except Exception as e:  # reported with the others below
                failures.append(f"{where} raised {type(e).__name__}: {e}")
                continue
            if a.pending_wgrad or b.pending_wgrad:
                failures.append(f"{where} left {a.pending_wgrad} + {b.pending_wgrad} owed")
            if not all(torch.equal(x, y) for x, y in zip(losses, want_losses, strict=True)):
                failures.append(f"{where}: losses differ")
            differ = [n for n in want if _differ(got[n], want[n]) is not None]
            if differ:
                failures.append(f"{where}: {len(differ)} gradients differ, e.g. {differ[:3]}")
    assert not failures, "\n".join(failures)


def test_plain_backward_of_a_delayed_model_and_of_its_copy_is_exact() -> None:
    """No schedule claims the linears a delayed adapter swapped in: torchtitan's own
    forward and backward of the model and of a deep copy taken after a step, and the
    adapter's plain path, compute every weight gradient at once, bit-identical to
    torchtitan's own step on the untouched model."""
    family = "deepseek_v3"
    mbs = microbatches(family)
    untouched = model_of(family)
    want_losses, want = torchtitan_step(untouched, mbs), grads(untouched)
    model = model_of(family)
    adapter = TorchtitanMoEAdapter(model, delay_wgrad_compute=True, self_check=False)
    schedule(adapter, mbs)
    model.zero_grad(set_to_none=True)
    dup = copy.deepcopy(model)
    for where, m in (("a deep copy", dup), ("the delayed model", model)):
        losses = torchtitan_step(m, mbs)
        assert all(torch.equal(x, y) for x, y in zip(losses, want_losses, strict=True)), where
        assert_bit_identical(grads(m), want, "gradients", f"torchtitan's own step on {where}")
    model.zero_grad(set_to_none=True)
    plain_step(adapter, mbs, delay=True)
    assert_bit_identical(grads(model), want, "gradients", "the adapter's plain path")
    assert adapter.pending_wgrad == 0


# --- optimizer steps with torchtitan's load balancing ---------------------------------------
@pytest.fixture
def one_rank_group(tmp_path: Path) -> Iterator[None]:
    """A one-rank gloo process group: torchtitan's ``ParallelDims`` builds its device
    meshes (all of size 1) on it."""
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    init = f"file://{tmp_path / 'store'}"
    dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _optimizer(model: nn.Module) -> Any:
    """torchtitan's AdamW container with its MoE load-balancing hook, as its trainer
    builds them (one model part, every parallel degree 1)."""
    from torchtitan.components.optimizer.optimizer import (
        OptimizersContainer,
        default_adamw,
        register_moe_load_balancing_hook,
    )
    from torchtitan.distributed import ParallelDims

    config = default_adamw(lr=1e-3)
    config.implementation = "for-loop"  # "fused" is CUDA's
    optimizers = OptimizersContainer(config, model_parts=[model])
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
    register_moe_load_balancing_hook(optimizers, [model], dims)
    assert len(optimizers._optimizer_step_pre_hooks) == 1, "the load-balancing hook"
    return optimizers


@pytest.mark.usefixtures("one_rank_group")
def test_training_steps_with_load_balancing_hook_are_bit_identical() -> None:
    """Three AdamW steps through the schedule and through the plain path, each with
    torchtitan's load-balancing hook updating the expert biases from the token counts:
    counts, biases and parameters bit-identical after every step."""
    family = "deepseek_v3"
    plain = TorchtitanMoEAdapter(model_of(family), self_check=False)
    sched = TorchtitanMoEAdapter(model_of(family), self_check=False)
    assert all(
        getattr(m, "load_balance_coeff", None)
        for n, m in plain.model.named_modules()
        if n.endswith("moe")
    ), "deepseek_v3's debug model has load balancing on"
    opt_plain, opt_sched = _optimizer(plain.model), _optimizer(sched.model)
    bias0 = moe_buffers(plain.model, "expert_bias_E")
    bias = bias0
    for step in range(3):
        mbs = microbatches(family, seed=10 + step)
        where = f"step {step}"
        plain_losses, losses = plain_step(plain, mbs), schedule(sched, mbs)
        assert all(torch.equal(a, b) for a, b in zip(losses, plain_losses, strict=True)), where
        counts = moe_buffers(plain.model, "tokens_per_expert_E")
        assert all(float(c.sum()) > 0 for c in counts.values()), f"{where}: no tokens counted"
        assert_bit_identical(
            moe_buffers(sched.model, "tokens_per_expert_E"), counts, "tokens_per_expert_E", where
        )
        for opt in (opt_plain, opt_sched):
            opt.step()
            opt.zero_grad()
        bias = moe_buffers(plain.model, "expert_bias_E")
        assert_bit_identical(
            moe_buffers(sched.model, "expert_bias_E"), bias, "expert_bias_E", where
        )
        assert_bit_identical(
            moe_buffers(sched.model, "tokens_per_expert_E"),
            moe_buffers(plain.model, "tokens_per_expert_E"),
            "tokens_per_expert_E after the hook",
            where,
        )
        assert_bit_identical(
            dict(sched.model.named_parameters()),
            dict(plain.model.named_parameters()),
            "parameters",
            where,
        )
    assert any(not torch.equal(bias[n], bias0[n]) for n in bias0), (
        "the load-balancing hook never moved an expert bias"
    )


# --- refusals -------------------------------------------------------------------------------
def test_refuses_a_module_that_is_not_a_torchtitan_decoder() -> None:
    with pytest.raises(
        ConfigError, match=r"model: expected a torchtitan decoder model.*received Linear"
    ):
        TorchtitanMoEAdapter(nn.Linear(4, 4))


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("layers.1", r"DeepSeekV3Model\.layers\.1: expected no forward or backward hooks"),
        ("layers.1.moe", r"DeepSeekV3Model\.layers\.1\.moe: expected no forward"),
        ("layers.1.moe.routed_experts", r"layers\.1\.moe\.routed_experts: expected no"),
    ],
)
def test_refuses_a_forward_hook_on_a_split_module(where: str, message: str) -> None:
    model = model_of("deepseek_v3")
    model.get_submodule(where).register_forward_hook(lambda *args: None)
    with pytest.raises(ConfigError, match=message):
        TorchtitanMoEAdapter(model, self_check=False)


def test_refuses_a_block_replaced_after_construction() -> None:
    model = model_of("deepseek_v3")
    adapter = TorchtitanMoEAdapter(model, self_check=False)
    layers = model.get_submodule("layers")
    assert isinstance(layers, nn.ModuleDict)
    layers["2"] = copy.deepcopy(layers["2"])
    with pytest.raises(
        ConfigError,
        match=r"DeepSeekV3Model\.layers\.2: expected the block the adapter was built on",
    ):
        combined_1f1b(adapter, microbatches("deepseek_v3")[:1], options=adapter.schedule_options())


def test_refuses_loss_mask() -> None:
    adapter = TorchtitanMoEAdapter(model_of("deepseek_v3"), self_check=False)
    mb = _batches("deepseek_v3")[0]
    bad = as_microbatch(mb, loss_mask=torch.ones(2, 16))
    with pytest.raises(
        ConfigError, match=r"microbatches\[0\].*loss_mask is set.*TorchtitanMoEAdapter"
    ):
        combined_1f1b(adapter, [bad], options=adapter.schedule_options())


_POSITIONS = r"positions: torchtitan's name .*; pass position_ids=positions"
_MASKS = r"attention_masks: expected none \(the adapter builds the attention masks itself.*get_attention_masks\(position_ids\)"


@pytest.mark.parametrize(
    ("entry", "keyword", "match"),
    [
        ("forward", "positions", r"TorchtitanMoEAdapter\.forward: " + _POSITIONS),
        ("forward", "attention_masks", r"TorchtitanMoEAdapter\.forward: " + _MASKS),
        ("plain_forward", "positions", r"TorchtitanMoEAdapter\.plain_forward: " + _POSITIONS),
        ("plain_forward", "attention_masks", _MASKS),
        ("stage", "positions", r"TorchtitanMoEStage\.forward: " + _POSITIONS),
        ("stage", "attention_masks", r"TorchtitanMoEStage\.forward: " + _MASKS),
        ("stage.plain_forward", "positions", r"TorchtitanMoEStage\.plain_forward: " + _POSITIONS),
    ],
)
def test_torchtitans_keyword_names_are_the_librarys_error(
    entry: str, keyword: str, match: str
) -> None:
    """torchtitan's ``positions`` / ``attention_masks`` (what its model's forward and its
    trainer's ``schedule.step`` take) name ``position_ids`` and how the masks are built,
    not Python's bare ``TypeError``; ``None`` is refused too (the name is wrong, not the
    value)."""
    from moe_overlap.adapters.torchtitan import TorchtitanMoEStage

    model = model_of("deepseek_v3")
    adapter = TorchtitanMoEAdapter(model, self_check=False)
    mb = _batches("deepseek_v3")[0]
    value = None if keyword == "attention_masks" else mb["position_ids"]
    calls: dict[str, Callable[..., object]] = {
        "forward": adapter.forward,
        "plain_forward": adapter.plain_forward,
        "stage": TorchtitanMoEStage(adapter),
        "stage.plain_forward": TorchtitanMoEStage(adapter).plain_forward,
    }
    with pytest.raises(ConfigError, match=match):
        calls[entry](mb["input_ids"], **{keyword: value})
    assert all(p.grad is None for p in model.parameters())


# --- torchtitan's parallelize forward wrappers ----------------------------------------------
class _Dims:
    """Stands in for torchtitan's ``ParallelDims`` in the closure: every boundary resolves
    to ``mesh`` (``None``: no mesh, as under expert parallelism alone)."""

    def __init__(self, mesh: object = None, backend: str = "partial_dtensor") -> None:
        self.mesh = mesh
        self.spmd_backend = backend

    def resolve_shared_mesh(self, layouts: object) -> object:
        del layouts
        return self.mesh


def _parallelize_forward(module: nn.Module, dims: _Dims, *, local_map: bool = False) -> None:
    """A ``forward`` on ``module`` shaped as torchtitan's ``Module.parallelize`` sets it (a
    closure over the module, its forward, possibly in a local map, and the parallel dims),
    with a sharding config of one input and one output."""
    from torchtitan.protocols.sharding import ShardingConfig

    self = module
    fn = module.forward
    if local_map:
        fn = functools.partial(fn)
    parallel_dims = dims

    def forward_with_redistribution(*args: object, **kwargs: object) -> object:
        closure = (self, parallel_dims)  # what torchtitan's closure holds
        del closure
        return fn(*args, **kwargs)

    forward_with_redistribution.__module__ = "torchtitan.protocols.module"
    forward_with_redistribution.__qualname__ = (
        "Module.parallelize.<locals>.forward_with_redistribution"
    )
    inputs: Any = {"x_BLD": None}
    module.__dict__["_sharding_config"] = ShardingConfig(in_src_shardings=inputs)
    module.__dict__["forward"] = forward_with_redistribution


def test_honours_torchtitan_parallelize_forwards_that_do_nothing() -> None:
    """A no-op parallelize forward on a MoE's ``moe`` and ``routed_experts`` is honoured:
    the schedule stays bit-identical to the plain path on the model as it is."""
    models = [model_of("deepseek_v3") for _ in range(2)]
    for model in models:
        for where in ("layers.1.moe", "layers.1.moe.routed_experts"):
            _parallelize_forward(model.get_submodule(where), _Dims())
    plain = TorchtitanMoEAdapter(models[0], self_check=False)
    sched = TorchtitanMoEAdapter(models[1])
    mbs = microbatches("deepseek_v3")
    assert [float(x) for x in plain_step(plain, mbs)] == [float(x) for x in schedule(sched, mbs)]
    assert_bit_identical(grads(sched.model), grads(plain.model), "gradients", "parallelize")


@pytest.mark.parametrize(
    ("dims", "local_map", "message"),
    [
        (_Dims(mesh="DeviceMesh('cpu', [0, 1], mesh_dim_names=('tp',))"), False, "on DeviceMesh"),
        (_Dims(backend="spmd_types"), False, "under the 'spmd_types' SPMD backend"),
        (_Dims(), True, "received a local_map around it"),
    ],
    ids=["redistributes", "spmd_types", "local_map"],
)
def test_refuses_torchtitan_parallelize_forwards_that_act(
    dims: _Dims, local_map: bool, message: str
) -> None:
    model = model_of("deepseek_v3")
    _parallelize_forward(
        model.get_submodule("layers.1.moe.routed_experts"), dims, local_map=local_map
    )
    with pytest.raises(
        ConfigError,
        match=r"layers\.1\.moe\.routed_experts \(RoutedExperts\): expected .*" + message,
    ):
        TorchtitanMoEAdapter(model, self_check=False)


def test_refuses_the_parallelize_forward_of_a_copy() -> None:
    """A deep copy keeps the original's parallelize forward, which runs the original."""
    model = model_of("deepseek_v3")
    _parallelize_forward(model.get_submodule("layers.1.moe"), _Dims())
    with pytest.raises(ConfigError, match=r"layers\.1\.moe \(MoE\): expected .* own forward"):
        TorchtitanMoEAdapter(copy.deepcopy(model), self_check=False)


def test_refuses_a_forward_set_on_a_split_module() -> None:
    """A forward of another origin on a split module is refused by the bypass check."""
    model = model_of("deepseek_v3")
    moe = model.get_submodule("layers.1.moe")
    moe.__dict__["forward"] = lambda x: type(moe).forward(moe, x)
    with pytest.raises(
        ConfigError, match=r"layers\.1\.moe: expected the class's own forward, received a forward"
    ):
        TorchtitanMoEAdapter(model, self_check=False)


# --- a model changed after the adapter was built ---------------------------------------------
def _add_block(model: nn.Module) -> None:
    layers: Any = model.layers
    last = list(layers.keys())[-1]
    layers[str(int(last) + 1)] = copy.deepcopy(layers[last])


def _moe_block(model: nn.Module) -> Any:
    layers: Any = model.layers
    return next(b for b in layers.values() if getattr(b, "moe_enabled", False))


def _replace_moe(model: nn.Module) -> None:
    block = _moe_block(model)
    block.moe = copy.deepcopy(block.moe)


def _replace_routed_experts(model: nn.Module) -> None:
    moe = _moe_block(model).moe
    moe.routed_experts = copy.deepcopy(moe.routed_experts)


def _replace_router(model: nn.Module) -> None:
    moe = _moe_block(model).moe
    moe.router = copy.deepcopy(moe.router)


def _replace_attention(model: nn.Module) -> None:
    block = _moe_block(model)
    block.attention = copy.deepcopy(block.attention)


def _remove_block(model: nn.Module) -> None:
    layers: Any = model.layers
    del layers[list(layers.keys())[-1]]


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (_add_block, "blocks added ["),
        (_remove_block, "removed ["),
        (_replace_moe, "submodule(s) ['moe'] replaced"),
        (_replace_routed_experts, "submodule(s) ['routed_experts'] replaced"),
        (_replace_router, "submodule(s) ['router'] replaced"),
        (_replace_attention, "submodule(s) ['attention'] replaced"),
    ],
)
def test_a_model_changed_after_the_adapter_is_refused(
    change: Callable[[nn.Module], None], says: str
) -> None:
    """Changed after wrapping, the model would be trained as it was (the new modules without
    gradient, torchtitan's token counts left at 0): the next plan refuses it; a new adapter
    trains the changed model."""
    model = model_of("qwen3")
    adapter = TorchtitanMoEAdapter(model, self_check=False)
    change(model)
    with pytest.raises(ConfigError, match="build a new TorchtitanMoEAdapter") as info:
        combined_1f1b(adapter, microbatches("qwen3")[:2], options=adapter.schedule_options())
    assert says in str(info.value)
    assert not [n for n, p in model.named_parameters() if p.grad is not None]
    rebuilt = TorchtitanMoEAdapter(model, self_check=False)
    combined_1f1b(rebuilt, microbatches("qwen3")[:2], options=rebuilt.schedule_options())
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_weights_tied_after_the_adapter_are_trained_as_they_are_now() -> None:
    """The LM head tied to the embedding after wrapping: the embedding's two gradients
    per microbatch were summed in the schedule's order (rounding apart from torchtitan's
    own backward). The adapter follows the ties at every plan build."""
    model, ref = model_of("qwen3"), model_of("qwen3")
    adapter = TorchtitanMoEAdapter(model, self_check=False)
    for m in (model, ref):
        m.get_submodule("lm_head").weight = m.get_submodule("tok_embeddings").weight
    mbs = microbatches("qwen3")[:2]
    got = schedule(adapter, mbs)
    want = torchtitan_step(ref, mbs)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert_bit_identical(grads(model), grads(ref), "gradients", "tied after wrapping")


def test_a_delayed_linear_replaced_after_the_adapter_is_refused() -> None:
    """A linear the adapter swapped for a delayable one, replaced after wrapping: its wgrad
    group still held the old one (a weight-gradient step failing mid-schedule, the new
    linear's gradient computed at once). The next plan refuses it, the model untouched."""
    model = model_of("qwen3")
    adapter = TorchtitanMoEAdapter(model, self_check=False, delay_wgrad_compute=True)
    attention: Any = model.get_submodule("layers.1.attention")
    attention.wo = nn.Linear(attention.wo.in_features, attention.wo.out_features, bias=False)
    with pytest.raises(ConfigError, match="build a new TorchtitanMoEAdapter") as info:
        schedule(adapter, microbatches("qwen3")[:1])
    assert "layers.1.attention: expected the modules" in str(info.value)
    assert "submodule(s) ['wo'] replaced" in str(info.value)
    assert not [n for n, p in model.named_parameters() if p.grad is not None]
