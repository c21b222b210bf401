"""The transformers modules the adapter skips or splits: wrappers, compile and hooks on them
are refused at construction and at every plan build; hooks on what the slots call run."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, cast

import pytest
import torch
from torch import Tensor, nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
)

from moe_overlap import ConfigError, Microbatch, combined_1f1b
from moe_overlap.adapters.transformers import TransformersMoEAdapter

from ._hf import mixtral, qwen2_moe

QWEN = r"Qwen2MoeForCausalLM"


def _noop(*args: object) -> None:
    del args


def _batches(n: int = 2) -> list[Microbatch]:
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 64, (2, 6), generator=g) for _ in range(n)]
    return [Microbatch(input_ids=x, labels=x.roll(-1, 1)) for x in ids]


@pytest.fixture(scope="module")
def adapted() -> tuple[Any, TransformersMoEAdapter]:
    model: Any = qwen2_moe()  # layers 0 and 2 MoE (shared expert), layer 1 dense
    return model, TransformersMoEAdapter(model, self_check=False)


def _step(adapter: TransformersMoEAdapter) -> list[Tensor]:
    return combined_1f1b(adapter, _batches(), options=adapter.schedule_options())


REFUSED: list[tuple[str, Callable[[Any], nn.Module], str, str]] = [
    ("causal_lm", lambda m: m, "forward", rf"^{QWEN}: expected no forward or backward hooks"),
    ("base", lambda m: m.model, "pre", rf"^{QWEN}\.model: .*never as a whole"),
    (
        "moe_layer",
        lambda m: m.model.layers[0],
        "pre",
        rf"^{QWEN}\.model\.layers\.0: .*never its forward, so they would never run",
    ),
    (
        "moe_block_forward_hook",
        lambda m: m.model.layers[2].mlp,
        "forward",
        rf"^{QWEN}\.model\.layers\.2\.mlp: expected no forward or backward hooks on it but "
        r"forward pre-hooks \(which run\), received 1 forward hook .*routed experts stood in "
        r"for, so they would not see its real output",
    ),
    ("moe_block_backward_hook", lambda m: m.model.layers[0].mlp, "backward", r"backward hook"),
    (
        "experts",
        lambda m: m.model.layers[0].mlp.experts,
        "pre",
        r"layers\.0\.mlp\.experts: .*dispatched rows.*not run as in plain training",
    ),
    ("experts_child", lambda m: m.model.layers[0].mlp.experts.act_fn, "forward", r"act_fn"),
    (
        "rotary",
        lambda m: m.model.rotary_emb,
        "forward",
        rf"^{QWEN}\.model\.rotary_emb: .*3 times per microbatch",
    ),
]


def _hook(module: nn.Module, kind: str) -> Any:
    if kind == "pre":
        return module.register_forward_pre_hook(_noop)
    if kind == "backward":
        return module.register_full_backward_hook(_noop)
    return module.register_forward_hook(_noop)


@pytest.mark.parametrize(
    ("target", "kind", "match"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED]
)
def test_hooks_on_modules_the_adapter_skips_are_refused_at_plan_build(
    adapted: tuple[Any, TransformersMoEAdapter],
    target: Callable[[Any], nn.Module],
    kind: str,
    match: str,
) -> None:
    model, adapter = adapted
    handle = _hook(target(model), kind)
    try:
        with pytest.raises(ConfigError, match=match):
            _step(adapter)
    finally:
        handle.remove()


def test_hooks_on_modules_the_slots_call_run_once_per_microbatch(
    adapted: tuple[Any, TransformersMoEAdapter],
) -> None:
    model, adapter = adapted
    calls: dict[str, int] = {}

    def counter(name: str) -> Callable[..., None]:
        def count(*args: object) -> None:
            del args
            calls[name] = calls.get(name, 0) + 1

        return count

    targets = {
        "attention": model.model.layers[0].self_attn,
        "dense_layer": model.model.layers[1],
        "router": model.model.layers[0].mlp.gate,
        "block_pre": model.model.layers[2].mlp,
        "embedding": model.model.embed_tokens,
        "lm_head": model.lm_head,
    }
    handles = [
        m.register_forward_pre_hook(counter(n))
        if n == "block_pre"
        else m.register_forward_hook(counter(n))
        for n, m in targets.items()
    ]
    try:
        _step(adapter)
    finally:
        for h in handles:
            h.remove()
    assert calls == {name: 2 for name in targets}  # two microbatches, as the model's forward


def test_a_block_pre_hook_sees_the_input_the_model_gives_it(
    adapted: tuple[Any, TransformersMoEAdapter],
) -> None:
    model, adapter = adapted
    seen: list[Tensor] = []

    def record(module: nn.Module, args: tuple[Tensor, ...]) -> None:
        del module
        seen.append(args[0].detach().clone())

    handle = model.model.layers[0].mlp.register_forward_pre_hook(record)
    try:
        mb = _batches(1)
        combined_1f1b(adapter, mb, options=adapter.schedule_options())
        model.zero_grad(set_to_none=True)
        assert mb[0].input_ids is not None
        model(input_ids=mb[0].input_ids)
    finally:
        handle.remove()
    assert len(seen) == 2
    torch.testing.assert_close(seen[0].reshape(seen[1].shape), seen[1], rtol=1e-5, atol=1e-6)


def test_construction_refuses_wrapped_compiled_or_hooked_modules() -> None:
    model: Any = qwen2_moe()
    handle = model.model.layers[0].register_forward_hook(_noop)
    with pytest.raises(ConfigError, match=rf"^{QWEN}\.model\.layers\.0: expected no forward"):
        TransformersMoEAdapter(model, self_check=False)
    handle.remove()
    with pytest.raises(ConfigError, match=r"^OptimizedModule: .*around Qwen2MoeForCausalLM"):
        TransformersMoEAdapter(cast(nn.Module, torch.compile(model)), self_check=False)
    layer_cls = type(model.model.layers[0])
    wrapped = copy.deepcopy(model)
    apply_activation_checkpointing(wrapped, check_fn=lambda m: isinstance(m, layer_cls))
    with pytest.raises(
        ConfigError,
        match=rf"^{QWEN}\.model\.layers\.0: expected no activation checkpointing of it, received "
        r"a CheckpointWrapper around Qwen2MoeDecoderLayer.*TransformersMoEAdapter\(recompute=",
    ):
        TransformersMoEAdapter(wrapped, self_check=False)


def test_layers_wrapped_or_replaced_after_construction_are_refused_at_plan_build() -> None:
    model: Any = qwen2_moe()
    adapter = TransformersMoEAdapter(model, self_check=False)
    layer_cls = type(model.model.layers[0])
    layers = list(model.model.layers)
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, layer_cls))
    with pytest.raises(
        ConfigError,
        match=rf"^{QWEN} decoder layer 0: expected no activation checkpointing of it, received a "
        r"CheckpointWrapper around Qwen2MoeDecoderLayer; the adapter runs the decoder layer it "
        r"was built on",
    ):
        _step(adapter)
    model.model.layers[0] = copy.deepcopy(layers[0])  # a plain module in its place
    with pytest.raises(
        ConfigError,
        match=rf"^{QWEN} decoder layer 0: expected the Qwen2MoeDecoderLayer the adapter was built "
        r"on, received a Qwen2MoeDecoderLayer in its place",
    ):
        _step(adapter)
    for i, layer in enumerate(layers):
        model.model.layers[i] = layer
    _step(adapter)


def test_another_family_lists_its_own_modules() -> None:
    """Mixtral (no shared expert, no dense layer): the same modules, found by structure."""
    model: Any = mixtral()
    block = model.model.layers[1].mlp
    refused = [
        (model.model.layers[1], r"^MixtralForCausalLM\.model\.layers\.1: .*never its forward"),
        (block.experts, r"^MixtralForCausalLM\.model\.layers\.1\.mlp\.experts: "),
        (block, r"layers\.1\.mlp: expected no forward or backward hooks on it but forward"),
    ]
    for module, match in refused:
        handle = module.register_forward_hook(_noop)
        try:
            with pytest.raises(ConfigError, match=match):
                TransformersMoEAdapter(model, self_check=False)
        finally:
            handle.remove()
    calls: list[int] = []
    handle = block.register_forward_pre_hook(lambda *args: calls.append(1))
    adapter = TransformersMoEAdapter(model, self_check=False)
    calls.clear()  # construction probes the block
    _step(adapter)
    handle.remove()
    assert len(calls) == 2  # once per microbatch, as the model's forward
    model.model.rotary_emb.compile()
    with pytest.raises(ConfigError, match=r"rotary_emb: expected no torch\.compile of it"):
        _step(adapter)
