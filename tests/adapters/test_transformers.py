"""The transformers adapter on one process: parity with the model's own forward, overlap
bit-identical to plain mode, mixed dense/MoE stacks, sharding round trip, errors."""

from __future__ import annotations

import copy
import itertools
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

pytest.importorskip("transformers")

from moe_overlap import (
    ConfigError,
    Microbatch,
    PreprocessableModel,
    SchedulableLayer,
    ScheduleError,
    TransformerLayerNode,
    WgradError,
    WgradLayer,
    combined_1f1b,
)
from moe_overlap.adapters.transformers import (
    HFDenseLayer,
    HFMoELayer,
    TransformersMoEAdapter,
    expert_parameter_names,
    gather_experts,
    shard_experts,
)
from tests.adapters import families
from tests.adapters._hf import (
    FAMILIES,
    compare,
    grads,
    microbatches,
    mixtral,
    other_family,
    qwen2_moe,
    reference_step,
)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize(("aux", "delay"), [(False, False), (True, False), (True, True)])
def test_matches_transformers_and_overlap_is_exact(family: str, aux: bool, delay: bool) -> None:
    """Plain mode == model.forward + backward() bit for bit; overlap == plain mode."""
    model = FAMILIES[family](aux=aux)
    result = compare(model, microbatches(3), delay=delay)
    assert result.ok and result.exact, result


_IMPLEMENTATIONS = [
    ("grouped_mm", False),
    ("grouped_mm", True),
    ("eager", False),
    ("eager", True),
    ("batched_mm", False),
]
"""(batched_mm with delayed weight gradients: those run as grouped GEMMs, not its per-row
products; equal up to rounding only.)"""


@pytest.mark.parametrize(("implementation", "delay"), _IMPLEMENTATIONS)
def test_bit_identical_whatever_the_experts_implementation(
    implementation: str, delay: bool
) -> None:
    """Each expert's rows reach its GEMM in the order the model's own experts take them
    (grouped_mm: its unstable sort, twice; eager: by k, then token), so each expert's
    weight gradient sums them in the same order (16 tokens, top-2: more rows than the sort
    keeps stable)."""
    model = mixtral()
    setattr(model.config, "_experts_implementation", implementation)  # noqa: B010 - transformers' switch
    result = compare(model, microbatches(3), delay=delay)
    assert result.ok and result.exact, result


_TOPK_FAMILIES = {
    "mixtral": lambda k: mixtral(num_experts_per_tok=k, num_local_experts=8),
    "qwen2_moe": lambda k: qwen2_moe(num_experts_per_tok=k, num_experts=8),
}


@pytest.mark.parametrize("delay", [False, True])
@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
@pytest.mark.parametrize("topk", [4, 8])
@pytest.mark.parametrize("family", sorted(_TOPK_FAMILIES))
def test_bit_identical_beyond_top2(
    family: str, topk: int, implementation: str, delay: bool
) -> None:
    """From top-3 on, the order in which a token's outputs and copy gradients are added
    changes the rounding: the copies are gathered at the block's call as the model's own
    experts gather them (grouped_mm: one gather in its sorted order; eager: one per expert,
    whose gradients autograd adds between the shared expert's gate's and the router's) and
    combined as they combine them (grouped_mm: a sum over the top-k slots; eager: by
    ascending expert). Qwen2-MoE's shared expert gate makes eager differ even at top-2."""
    model = _TOPK_FAMILIES[family](topk)
    setattr(model.config, "_experts_implementation", implementation)  # noqa: B010 - transformers' switch
    result = compare(model, microbatches(2), delay=delay)
    assert result.ok and result.exact, result


def test_tied_embeddings_bit_identical() -> None:
    """The LM head's and the embedding's gradients of a tied weight are summed before they
    reach ``.grad``, as the model's own backward sums them (from the second microbatch on
    the schedule's separate steps would round otherwise)."""
    model = qwen2_moe(tie_word_embeddings=True)
    hf: Any = model
    assert hf.get_output_embeddings().weight is hf.get_input_embeddings().weight
    for delay in (False, True):
        result = compare(model, microbatches(3), delay=delay)
        assert result.ok and result.exact, result


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
def test_other_families_by_structure(family: str) -> None:
    """Qwen3-MoE and OLMoE share the structure; nothing family-specific is needed."""
    result = compare(other_family(family), microbatches(2), delay=True)
    assert result.ok, result


def test_padding_mask_and_masked_aux_loss() -> None:
    """A 2-D attention mask reaches attention and the masked load-balancing loss."""
    result = compare(mixtral(aux=True), microbatches(2, padded=True))
    assert result.ok, result


def test_mixed_dense_and_moe_layers() -> None:
    model = qwen2_moe(num_hidden_layers=4, mlp_only_layers=[0], decoder_sparse_step=2)
    adapter = TransformersMoEAdapter(copy.deepcopy(model))
    kinds = [type(layer) for layer in adapter.decoder.layers]
    # Layer 0 is in mlp_only_layers; of the rest only (i + 1) % 2 == 0 are sparse.
    assert kinds == [HFDenseLayer, HFMoELayer, HFDenseLayer, HFMoELayer]
    result = compare(model, microbatches(3), delay=True)
    assert result.ok, result


def test_sliding_window_mask() -> None:
    result = compare(mixtral(sliding_window=4, attn_implementation="eager"), microbatches(2))
    assert result.ok, result


def test_protocols_and_wgrad_lists() -> None:
    adapter = TransformersMoEAdapter(qwen2_moe(), delay_wgrad_compute=True)
    assert isinstance(adapter, PreprocessableModel)
    for layer in adapter.decoder.layers:
        assert isinstance(layer, SchedulableLayer)
        assert all(isinstance(s.module, WgradLayer) for s in layer.pre_dispatch_wgrad())
        assert all(isinstance(m, WgradLayer) for m in layer.mlp_wgrad())
    moe = adapter.decoder.layers[0]
    assert isinstance(moe, HFMoELayer) and moe.num_local_experts == 4
    assert [s.scope.name for s in moe.pre_dispatch_wgrad()] == ["attn", "moe_router"]
    assert TransformersMoEAdapter(mixtral()).decoder.layers[0].mlp_wgrad() == []


def test_delayed_wgrad_keeps_state_dict_format() -> None:
    model = qwen2_moe()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    TransformersMoEAdapter(model, delay_wgrad_compute=True)
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    # The model's own forward still runs on the swapped linears.
    mb = microbatches(1)[0]
    assert mb.input_ids is not None
    model(input_ids=mb.input_ids)


def test_logits_without_labels() -> None:
    """Without labels, ``_postprocess`` returns the LM head's logits (as the model does)."""
    model = mixtral()
    adapter = TransformersMoEAdapter(model)
    h = torch.randn(2, 8, 32)
    logits = adapter._postprocess(h, None, None, None, None, None, None)
    expected = model.get_submodule("lm_head")(model.get_submodule("model.norm")(h))
    assert torch.equal(logits, expected)


def test_shard_then_gather_is_exact_at_ep1() -> None:
    model = qwen2_moe()
    full = {k: v.clone() for k, v in model.state_dict().items()}
    shard_experts(model, None)
    back = gather_experts(model, None)
    assert list(back) == list(full)
    assert all(torch.equal(back[k], full[k]) for k in full)
    names = expert_parameter_names(model)
    assert names == [
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.0.mlp.experts.down_proj",
        "model.layers.2.mlp.experts.gate_up_proj",
        "model.layers.2.mlp.experts.down_proj",
    ]


def test_loss_mask_is_rejected() -> None:
    adapter = TransformersMoEAdapter(mixtral())
    mb = microbatches(1)[0]
    bad = Microbatch(input_ids=mb.input_ids, labels=mb.labels, loss_mask=torch.ones(2, 8))
    # Refused before any node runs: the adapter does not declare loss_mask.
    with pytest.raises(ConfigError, match=r"microbatches\[0\].*loss_mask is set.*MoEAdapter"):
        combined_1f1b(adapter, [bad])
    padded = Microbatch(
        input_ids=mb.input_ids, labels=mb.labels, padding_mask=torch.zeros(2, 8, dtype=torch.bool)
    )
    with pytest.raises(ConfigError, match="padding_mask is set"):
        combined_1f1b(adapter, [padded])


def test_router_jitter_is_rejected() -> None:
    with pytest.raises(ConfigError, match="router_jitter_noise"):
        TransformersMoEAdapter(mixtral(router_jitter_noise=0.1))


def test_import_moe_overlap_does_not_import_transformers() -> None:
    code = (
        "import sys, moe_overlap, moe_overlap.adapters, moe_overlap.models; "
        "assert 'transformers' not in sys.modules, 'transformers imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_discard_wgrad_makes_the_adapter_usable_after_a_failed_step() -> None:
    """Pending weight gradients left by a broken step block the next one until discarded."""
    model = mixtral()
    adapter = TransformersMoEAdapter(model, delay_wgrad_compute=True)
    mbs = microbatches(2)
    layer = adapter.decoder.layers[1]
    original = layer.slot_dispatch
    calls: list[int] = []

    def flaky(
        node: TransformerLayerNode, inputs: tuple[Tensor, ...]
    ) -> Tensor | tuple[Tensor, ...]:
        calls.append(1)
        if len(calls) == 2:  # microbatch 1's forward, after microbatch 0's mlp backward
            raise RuntimeError("all-to-all failed")
        return original(node, inputs)

    vars(layer)["slot_dispatch"] = flaky  # an instance patch, removed below
    with pytest.raises(ScheduleError, match="all-to-all failed"):
        combined_1f1b(adapter, mbs)
    del layer.slot_dispatch
    assert adapter.pending_wgrad > 0
    with pytest.raises(WgradError, match="discard_wgrad") as info:
        combined_1f1b(adapter, mbs)
    # The message names the modules holding them by their place in the model: layer 0's
    # experts (a non-module WgradLayer the layer lists, found through mlp_wgrad(); down
    # and gate_up pending).
    assert "'model.layers.0.mlp.experts (ExpertWeights)': 2" in str(info.value), str(info.value)
    adapter.discard_wgrad()
    model.zero_grad(set_to_none=True)
    assert adapter.pending_wgrad == 0
    combined_1f1b(adapter, mbs, options=adapter.schedule_options())
    assert adapter.pending_wgrad == 0


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])
def test_checkpoint_round_trip_and_training_from_it(family: str, tmp_path: Path) -> None:
    """``save_pretrained`` -> ``from_pretrained`` gives the same weights; the loaded model
    trains through the adapter exactly as the saved one; shard/gather returns the same
    state dict."""
    causal_lm = dict(families.discover())[family]
    model: Any = families.build(family, causal_lm)  # a transformers PreTrainedModel
    model.save_pretrained(tmp_path)
    loaded: Any = type(model).from_pretrained(tmp_path).float().train()
    saved, back = model.state_dict(), loaded.state_dict()
    assert list(back) == list(saved)
    assert all(torch.equal(back[k], saved[k]) for k in saved)
    mbs = families.batches()
    a = combined_1f1b(TransformersMoEAdapter(model), mbs)
    b = combined_1f1b(TransformersMoEAdapter(loaded), mbs)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    full = {k: v.clone() for k, v in loaded.state_dict().items()}
    shard_experts(loaded, None)
    again = gather_experts(loaded, None)
    assert list(again) == list(full) and all(torch.equal(again[k], full[k]) for k in full)


def test_self_check_refuses_a_layer_it_cannot_split() -> None:
    """A decoder layer whose forward the split does not reproduce (here: the MoE output
    scaled by a factor the layer applies after its block) is refused, naming the layer."""
    model = mixtral()
    layer = model.get_submodule("model.layers.1")
    base = type(layer)

    class ScaledLayer(base):  # type: ignore[misc, valid-type]  # a transformers class
        def forward(self, *args: object, **kwargs: object) -> Tensor:
            out = super().forward(*args, **kwargs)
            assert isinstance(out, Tensor)
            return out * 1.5

    layer.__class__ = ScaledLayer
    with pytest.raises(ConfigError, match=r"ScaledLayer \(layer 1\).*differs by"):
        TransformersMoEAdapter(model)
    # Unverified, the same model is accepted: self_check=False is the only way past.
    TransformersMoEAdapter(model, self_check=False)


def test_self_check_report() -> None:
    model = qwen2_moe()
    adapter = TransformersMoEAdapter(copy.deepcopy(model))
    report = adapter.self_check_report
    assert report.enabled and report.seconds > 0
    assert [(cls, where) for cls, where, _ in report.structures] == [
        ("Qwen2MoeDecoderLayer", [0, 2]),
        ("Qwen2MoeDecoderLayer", [1]),
    ]
    assert report.structures[1][2] == "dense"
    shard_experts(model, None)  # EP=1 keeps every expert: the check still runs
    TransformersMoEAdapter(model)


def test_pre_sharded_model_needs_self_check_off() -> None:
    """Experts already sharded: the check needs the layer's own forward with all experts."""
    model = mixtral()
    for i in range(2):
        experts = model.get_submodule(f"model.layers.{i}.mlp.experts")
        for name in ("gate_up_proj", "down_proj"):
            full = experts.get_parameter(name)
            setattr(experts, name, torch.nn.Parameter(full.detach()[:2].clone()))
        object.__setattr__(experts, "_moe_overlap_num_experts", 4)
        setattr(experts, "num_experts", 2)  # noqa: B010 - what shard_experts leaves
    with pytest.raises(
        ConfigError, match=r"already sharded \(2 of 4 in layer 0\).*self_check=False"
    ):
        TransformersMoEAdapter(model)


def test_aux_loss_needs_the_standard_one() -> None:
    causal_lm = dict(families.discover())["deepseek_v3"]
    with pytest.raises(ConfigError, match="standard load_balancing_loss_func"):
        TransformersMoEAdapter(families.build("deepseek_v3", causal_lm), router_aux_loss=True)


def test_frozen_shared_expert_still_adds_its_output() -> None:
    """Expert-only fine-tuning: the frozen shared expert's output carries no gradient and
    must still reach combine (its presence is decided at construction, not per step)."""
    model = qwen2_moe()
    for name, p in model.named_parameters():
        p.requires_grad_("mlp.experts." in name or "lm_head" in name)
    mbs = microbatches(2)
    ref = reference_step(copy.deepcopy(model), mbs)
    adapter = TransformersMoEAdapter(copy.deepcopy(model))
    for overlap in (False, True):
        losses = combined_1f1b(adapter, mbs, overlap=overlap)
        assert max(abs(float(a - b)) for a, b in zip(losses, ref, strict=True)) <= 1e-6


def _grads_of(model: nn.Module) -> dict[str, Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _same(a: Tensor | None, b: Tensor | None) -> bool:
    return a is b if a is None or b is None else torch.equal(a, b)


def _differ(got: dict[str, Tensor | None], want: dict[str, Tensor | None]) -> list[str]:
    """The parameters whose gradients are not bit-identical (or one side has none)."""
    return [n for n, w in want.items() if not _same(got[n], w)]


def test_a_second_adapter_on_the_same_model_is_exact_in_every_delay_combination() -> None:
    """Two adapters on one model, delayed wgrad on or off in each: the second's schedule,
    then the first's, bit-identical to a lone adapter's with the same setting, nothing owed
    (a linear one adapter swapped in computes its weight gradient at once for the other;
    qwen2_moe's MoE block holds a linear directly, its shared expert's gate)."""
    base = qwen2_moe()
    mbs = microbatches(2)

    def step(adapter: TransformersMoEAdapter) -> list[Tensor]:
        return combined_1f1b(adapter, mbs, options=adapter.schedule_options())

    want: dict[bool, tuple[list[Tensor], dict[str, Tensor | None]]] = {}
    for delay in (False, True):
        lone = copy.deepcopy(base)
        want[delay] = step(TransformersMoEAdapter(lone, delay_wgrad_compute=delay)), _grads_of(lone)
    failures: list[str] = []
    for first, second in itertools.product((False, True), repeat=2):
        model = copy.deepcopy(base)
        a = TransformersMoEAdapter(model, delay_wgrad_compute=first)
        b = TransformersMoEAdapter(model, delay_wgrad_compute=second)
        for which, adapter, delay in (("second", b, second), ("first", a, first)):
            where = f"delay {first}, then {second}: the {which} adapter's step"
            model.zero_grad(set_to_none=True)
            try:
                losses = step(adapter)
            except Exception as e:  # reported with the others below
                failures.append(f"{where} raised {type(e).__name__}: {e}")
                continue
            want_losses, want_grads = want[delay]
            if a.pending_wgrad or b.pending_wgrad:
                failures.append(f"{where} left {a.pending_wgrad} + {b.pending_wgrad} owed")
            if not all(torch.equal(x, y) for x, y in zip(losses, want_losses, strict=True)):
                failures.append(f"{where}: losses differ")
            differ = _differ(_grads_of(model), want_grads)
            if differ:
                failures.append(f"{where}: {len(differ)} gradients differ, e.g. {differ[:3]}")
    assert not failures, "\n".join(failures)


def test_plain_backward_of_a_delayed_model_and_of_its_copy_is_exact() -> None:
    """No schedule claims the linears a delayed adapter swapped in: transformers' own
    forward and backward (of the model, and of a deep copy taken after a step) compute
    every weight gradient at once, bit-identical to the untouched model's; the adapter's
    plain path, bit-identical to its schedule's."""
    base = qwen2_moe()
    mbs = microbatches(2)
    untouched = copy.deepcopy(base)
    want_losses, want = reference_step(untouched, mbs), _grads_of(untouched)
    model = copy.deepcopy(base)
    adapter = TransformersMoEAdapter(model, delay_wgrad_compute=True)
    combined_1f1b(adapter, mbs, options=adapter.schedule_options())
    model.zero_grad(set_to_none=True)
    dup = copy.deepcopy(model)
    for what, m in (("the model's own", model), ("a deep copy's own", dup)):
        losses = reference_step(m, mbs)
        assert all(torch.equal(x, y) for x, y in zip(losses, want_losses, strict=True)), what
        differ = _differ(_grads_of(m), want)
        assert not differ, f"{what} backward: {len(differ)} gradients differ, e.g. {differ[:3]}"
    assert adapter.pending_wgrad == 0
    scheduled = copy.deepcopy(base)
    delayed = TransformersMoEAdapter(scheduled, delay_wgrad_compute=True)
    combined_1f1b(delayed, mbs, overlap=False, options=delayed.schedule_options())
    model.zero_grad(set_to_none=True)
    for mb in mbs:
        assert mb.input_ids is not None
        loss = adapter.forward(mb.input_ids, attention_mask=mb.attention_mask, labels=mb.labels)
        torch.autograd.backward(loss)
    assert adapter.pending_wgrad == 0
    differ = _differ(_grads_of(model), _grads_of(scheduled))
    assert not differ, f"the adapter's plain path: {len(differ)} gradients differ, {differ[:3]}"


def test_router_noise_in_eval_mode_is_exact_and_refused_after_train() -> None:
    """Router jitter draws random numbers only in training mode: a model adapted in eval
    mode (as from_pretrained returns it) trains exactly there, and is refused at the next
    plan build once put back in training mode."""
    model = mixtral(router_jitter_noise=0.1).eval()
    mbs = microbatches(2)
    ref = copy.deepcopy(model)
    ref_losses = reference_step(ref, mbs)
    adapter = TransformersMoEAdapter(model)
    losses = combined_1f1b(adapter, mbs)
    assert max(abs(float(a - b)) for a, b in zip(losses, ref_losses, strict=True)) <= 1e-6
    theirs = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        q = theirs[name].grad
        assert p.grad is not None and q is not None, name
        assert float((p.grad - q).abs().max()) <= 1e-5 * float(q.abs().max()), name
    model.train()
    with pytest.raises(
        ConfigError,
        match=r"layers\.0\.mlp \(MixtralSparseMoeBlock\).*training mode.*router_jitter_noise",
    ):
        combined_1f1b(adapter, mbs)
    model.eval()
    combined_1f1b(adapter, mbs)  # back in eval mode: accepted again


def test_layers_differing_in_a_plain_setting_are_checked_apart() -> None:
    """Same class and parameters, but a per-layer number the forward uses: layer 0's factor
    is 1 (the split reproduces it), layer 1's is not, so layer 1 is checked on its own and
    refused instead of trained with layer 0's verdict."""
    model = mixtral()

    class FactorLayer(type(model.get_submodule("model.layers.0"))):  # type: ignore[misc]
        factor = 1.0

        def forward(self, *args: object, **kwargs: object) -> Tensor:
            out = super().forward(*args, **kwargs)
            assert isinstance(out, Tensor)
            return out * self.factor

    for i, factor in enumerate((1.0, 1.5)):
        layer = model.get_submodule(f"model.layers.{i}")
        layer.__class__ = FactorLayer
        setattr(layer, "factor", factor)  # noqa: B010 - an instance setting
    with pytest.raises(ConfigError, match=r"FactorLayer \(layer 1\).*differs by"):
        TransformersMoEAdapter(model)


@pytest.mark.parametrize("use_cache", [True, False])
def test_position_ids_reach_the_model_as_given(use_cache: bool) -> None:
    """Custom positions (every other one) give the model's own loss, through the rotary
    tables and the masks, which transformers builds differently with and without a KV
    cache (without one it reads such positions as packed sequences): the adapter follows
    the config's ``use_cache``, as the model's own ``forward`` does."""
    model = mixtral()
    setattr(model.config, "use_cache", use_cache)  # noqa: B010 - a transformers config
    ids = microbatches(1)[0].input_ids
    assert ids is not None
    pos = (2 * torch.arange(ids.shape[1])).unsqueeze(0).expand_as(ids)
    own = model(input_ids=ids, position_ids=pos, labels=ids).loss.detach()
    adapter = TransformersMoEAdapter(copy.deepcopy(model))
    (loss,) = combined_1f1b(adapter, [Microbatch(input_ids=ids, position_ids=pos, labels=ids)])
    assert abs(float(loss - own)) <= 1e-6


@pytest.mark.parametrize("delay", [False, True])
def test_with_the_models_activation_checkpointing(delay: bool) -> None:
    """transformers' activation checkpointing on (dense layers recompute inside their
    slot): the same exactness; the self-check probes the math without it."""
    model: Any = qwen2_moe()
    model.activation_checkpointing_enable()
    model.train()
    result = compare(model, microbatches(2), delay=delay)
    assert result.ok, result


def _moe_block(model: torch.nn.Module) -> Any:
    layer = model.get_submodule("model.layers.0")
    return layer, layer.mlp


@pytest.mark.parametrize(
    ("part", "says"),
    [
        ("moe", "submodule(s) ['mlp'] replaced"),
        ("experts", "submodule(s) ['experts'] replaced"),
        ("gate", "submodule(s) ['gate'] replaced"),
        ("self_attn", "submodule(s) ['self_attn'] replaced"),
    ],
)
def test_a_layer_changed_after_the_adapter_is_refused(part: str, says: str) -> None:
    """A layer's MoE block, experts, router or attention replaced after wrapping would be
    trained as it was: the next plan refuses it; a new adapter trains the changed model."""
    model = mixtral()
    adapter = TransformersMoEAdapter(model)
    layer, moe = _moe_block(model)
    if part == "moe":
        layer.mlp = copy.deepcopy(moe)
    elif part == "self_attn":
        layer.self_attn = copy.deepcopy(layer.self_attn)
    else:
        setattr(moe, part, copy.deepcopy(getattr(moe, part)))
    with pytest.raises(ConfigError, match="build a new TransformersMoEAdapter") as info:
        combined_1f1b(adapter, microbatches(2))
    assert says in str(info.value)
    assert not [n for n, p in model.named_parameters() if p.grad is not None]
    rebuilt = TransformersMoEAdapter(model)
    combined_1f1b(rebuilt, microbatches(2))
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_forward_takes_no_mask_or_positions_by_position() -> None:
    """transformers' models take ``(input_ids, attention_mask, position_ids)``; the adapter's
    order was ``(input_ids, position_ids, attention_mask)``, so a call in transformers'
    order swapped them silently. Everything after the token ids is keyword-only."""
    adapter = TransformersMoEAdapter(mixtral())
    ids = torch.randint(0, 60, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    with pytest.raises(TypeError, match="positional argument"):
        adapter.forward(ids, mask)  # type: ignore[call-arg]  # pyright: ignore[reportCallIssue]
    with torch.no_grad():
        by_name = adapter.forward(ids, attention_mask=mask)
        assert torch.equal(by_name, adapter.forward(ids))  # an all-ones mask changes nothing


def _reference_after(change: Callable[[nn.Module], object], *, tied: bool) -> nn.Module:
    """A fresh model of :func:`mixtral` with ``change`` made (the same seed: same weights)."""
    model = mixtral(tie_word_embeddings=tied)
    torch.manual_seed(5)
    change(model)
    return model


def _untie(model: nn.Module) -> None:
    head: Any = model.get_submodule("lm_head")
    head.weight = nn.Parameter(head.weight.detach().clone())


def _tie(model: nn.Module) -> None:
    head: Any = model.get_submodule("lm_head")
    head.weight = model.get_submodule("model.embed_tokens").weight


@pytest.mark.parametrize(
    ("change", "tied"), [(_tie, False), (_untie, True)], ids=["tied", "untied"]
)
def test_weights_tied_or_untied_after_the_adapter_are_trained_as_they_are_now(
    change: Callable[[nn.Module], None], tied: bool
) -> None:
    """Tied after wrapping, the embedding's two gradients were summed in the schedule's
    order (rounding apart from the model's); untied, the head's gradient went to the
    embedding and the new head got none. The adapter follows the ties at every plan build."""
    model = mixtral(tie_word_embeddings=tied)
    adapter = TransformersMoEAdapter(model)
    torch.manual_seed(5)
    change(model)
    ref = _reference_after(change, tied=tied)
    mbs = microbatches(2)
    got = combined_1f1b(adapter, mbs, options=adapter.schedule_options())
    want = reference_step(ref, mbs)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    mine, theirs = grads(model), grads(ref)
    assert [n for n in theirs if not torch.equal(mine[n], theirs[n])] == []


def _replace_expert_weight(model: nn.Module) -> None:
    experts: Any = model.get_submodule("model.layers.0.mlp.experts")
    experts.down_proj = nn.Parameter(experts.down_proj.detach() * 2)


def _replace_delayed_linear(model: nn.Module) -> None:
    attn: Any = model.get_submodule("model.layers.0.self_attn")
    attn.q_proj = nn.Linear(32, 32, bias=False)


@pytest.mark.parametrize(
    ("change", "router_aux_loss", "delay", "says"),
    [
        (
            lambda m: setattr(m.config, "output_router_logits", True),
            None,
            False,
            "config.output_router_logits: expected False",
        ),
        (
            lambda m: setattr(m, "router_aux_loss_coef", 0.5),
            True,
            False,
            ".router_aux_loss_coef: expected 0.1",
        ),
        (
            _replace_expert_weight,
            None,
            True,
            "mlp.experts: expected the modules the adapter was built on, received a changed "
            "model (parameter(s) ['down_proj'] replaced",
        ),
        (
            _replace_delayed_linear,
            None,
            True,
            "layers[0].self_attn: expected the modules the adapter was built on, received a "
            "changed model (submodule(s) ['q_proj'] replaced",
        ),
    ],
    ids=["output_router_logits", "aux_coef", "expert_weight", "delayed_linear"],
)
def test_what_the_adapter_holds_changed_after_it_is_refused(
    change: Callable[[nn.Module], object], router_aux_loss: bool | None, delay: bool, says: str
) -> None:
    """The aux-loss settings read at construction (the model's own forward reads them at
    every call), an expert weight the delayed-wgrad experts hold by reference, a linear
    swapped for a delayable one: changed after wrapping, the adapter trained the model as
    it was (another loss, the new weight without gradient, a wgrad never computed). The
    next plan refuses it, the model untouched."""
    model = mixtral()
    adapter = TransformersMoEAdapter(
        model, router_aux_loss=router_aux_loss, delay_wgrad_compute=delay
    )
    change(model)
    with pytest.raises(ConfigError, match="build a new TransformersMoEAdapter") as info:
        combined_1f1b(adapter, microbatches(1), options=adapter.schedule_options())
    assert says in str(info.value)
    assert not [n for n, p in model.named_parameters() if p.grad is not None]
