"""The transformers adapter decides from structure, never from weight values (issue 24).

What the split hands on follows from the layer's forward (its autograd graph, which child's
output another takes), so zero-initialised weights (an upcycled model's shared expert, a
router) keep their path and train; the self-check's gradient comparison has an absolute
floor for gradients that are zero mathematically; per-layer top-k, a forward without a
load-balancing loss and deterministic routers in eval mode are accepted; every refusal
says why, with the internal exception as its cause.
"""

from __future__ import annotations

import copy
import importlib
import re
from typing import Any

import pytest
import torch
from torch import Tensor, nn

pytest.importorskip("transformers")

from moe_overlap import ConfigError, Microbatch, combined_1f1b
from moe_overlap.adapters.transformers import HFMoELayer, TransformersMoEAdapter
from tests.adapters import families
from tests.adapters._hf import ON_OLD_TORCH, grads, microbatches, mixtral, reference_step

FLOOR = 1e-7
"""Gradients are compared to ``max(|reference|, FLOOR / RTOL * G)`` with ``G`` the largest
gradient of the model: a mathematically-zero gradient (HunYuan's top-1 router, a key bias
without rotary) is float32 noise of ~1e-9 * G in both runs."""
RTOL = 1e-5


def _family(name: str, **settings: object) -> nn.Module:
    """A family's tiny build (``tests.adapters.families``), with ``settings`` on its config."""
    causal_lm = dict(families.discover())[name]
    module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    cls: Any = getattr(module, causal_lm)
    kw = families.tiny_config(name, cls.config_class)
    kw.update(settings)
    torch.manual_seed(0)
    model: nn.Module = cls(cls.config_class(**kw))
    return model.float().train()


def _worst(got: dict[str, Tensor], want: dict[str, Tensor]) -> tuple[float, str]:
    scale = max(float(t.abs().max()) for t in want.values())
    rel = {
        k: float((got[k] - want[k]).abs().max())
        / max(float(want[k].abs().max()), FLOOR / RTOL * scale, 1e-30)
        for k in want
    }
    worst = max(rel, key=lambda k: rel[k])
    return rel[worst], worst


def _exact(
    model: nn.Module, mbs: list[Microbatch], *, self_check: bool, delay: bool = False
) -> TransformersMoEAdapter:
    """Plain and overlapped schedules against the model's own forward + backward: losses
    within 1e-6, gradients within RTOL (with the floor), overlapped bit-identical to plain.
    Returns the plain adapter (its model holds the gradients)."""
    ref = copy.deepcopy(model)
    ref_losses = reference_step(ref, mbs)
    ref_grads = grads(ref)
    runs: list[tuple[TransformersMoEAdapter, list[Tensor]]] = []
    for overlap in (False, True):
        adapter = TransformersMoEAdapter(
            copy.deepcopy(model), self_check=self_check, delay_wgrad_compute=delay
        )
        runs.append((adapter, combined_1f1b(adapter, mbs, overlap=overlap)))
    (plain, lp), (over, lo) = runs
    assert max(abs(float(a - b)) for a, b in zip(lp, ref_losses, strict=True)) <= 1e-6
    diff, where = _worst(grads(plain.model), ref_grads)
    assert diff <= RTOL, (where, diff)
    gp, go = grads(plain.model), grads(over.model)
    assert all(torch.equal(a, b) for a, b in zip(lp, lo, strict=True))
    assert all(torch.equal(gp[k], go[k]) for k in gp)
    return plain


# --- 1. zero-initialised weights --------------------------------------------------------

SHARED_OUT = r"\.(shared_experts?|shared_expert)\.down_proj\.weight$"
ROUTER = r"\.(gate|router)\.weight$|e_score_correction_bias$"
SHARED_GATE = r"\.shared_expert_gate\.weight$"

ZERO_CASES = [
    ("qwen2_moe", SHARED_OUT),
    (
        "qwen3_next",
        SHARED_OUT,
    ),  # its softmax-attention layout (its default mixes in linear attention)
    ("deepseek_v3", SHARED_OUT),
    ("llama4", SHARED_OUT),
    ("deepseek_v3", ROUTER),  # router weight and correction bias
    ("llama4", ROUTER),
    ("qwen2_moe", SHARED_GATE),
]


def _zero(model: nn.Module, pattern: str) -> list[str]:
    """Zero every parameter and buffer matching ``pattern``; their names."""
    zeroed: list[str] = []
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if re.search(pattern, name):
                t.zero_()
                zeroed.append(name)
    assert zeroed, pattern
    return zeroed


@pytest.mark.parametrize(("family", "pattern"), ZERO_CASES)
@ON_OLD_TORCH
def test_zero_initialised_weights_keep_their_path_and_train(family: str, pattern: str) -> None:
    """A shared expert whose output projection is zero (zero-init, upcycling), a zero
    router or gate: the shared expert's output still reaches combine, under the self-check
    and without it; the schedule is exact; the zero weights get gradients and train."""
    settings: dict[str, object] = {}
    if family == "qwen3_next":
        settings["layer_types"] = ["full_attention"] * families.LAYERS
    model = _family(family, **settings)
    zeroed = _zero(model, pattern)
    mbs = families.batches()
    for self_check in (True, False):
        adapter = _exact(model, mbs, self_check=self_check)
        moe = [layer for layer in adapter.decoder.layers if isinstance(layer, HFMoELayer)]
        assert moe and all(layer.split.block_adds for layer in moe)
        params = dict(adapter.model.named_parameters())
        trained = [n for n in zeroed if n in params and params[n].requires_grad]
        for name in trained:
            grad = params[name].grad
            assert grad is not None, name
            assert float(grad.abs().max()) > 0, name
        torch.optim.SGD(adapter.model.parameters(), lr=0.1).step()
        for name in trained:
            assert float(params[name].detach().abs().max()) > 0, f"{name} did not train"


def test_a_block_without_shared_experts_adds_nothing() -> None:
    """Mixtral's block returns its experts' output alone: nothing is handed to combine."""
    adapter = TransformersMoEAdapter(mixtral())
    moe = [layer for layer in adapter.decoder.layers if isinstance(layer, HFMoELayer)]
    assert moe and not any(layer.split.block_adds for layer in moe)


def test_without_the_self_check_the_split_follows_the_traced_identities() -> None:
    """A layer whose one middle norm normalizes the attention output (then x + a feeds the
    block) is split so without the self-check too: the block does not take the norm's
    output, the norm takes the attention's."""
    model = mixtral()
    base = type(model.get_submodule("model.layers.0"))

    class PostNormLayer(base):  # type: ignore[misc, valid-type]  # a transformers class
        def forward(self, hidden_states: Tensor, *args: object, **kwargs: object) -> Tensor:
            me: Any = self  # a transformers layer: its children are untyped here
            h, _ = me.self_attn(hidden_states=me.input_layernorm(hidden_states), **kwargs)
            h = hidden_states + me.post_attention_layernorm(h)
            out: Tensor = h + me.mlp(h)
            return out

    for i in range(2):
        model.get_submodule(f"model.layers.{i}").__class__ = PostNormLayer
    checked = TransformersMoEAdapter(copy.deepcopy(model))
    unchecked = TransformersMoEAdapter(copy.deepcopy(model), self_check=False)
    for adapter in (checked, unchecked):
        split = adapter.decoder.layers[0]
        assert isinstance(split, HFMoELayer)
        assert split.split.attn_out_norm == "post_attention_layernorm"
        assert split.split.pre_mlp_norm is None


# --- 2. the gradient comparison's absolute floor ----------------------------------------


def _llama4_with_key_bias(seed: int) -> nn.Module:
    """Llama 4 with attention biases: its layer without rotary (layer 3) has a key bias
    whose gradient is exactly zero mathematically (softmax ignores a shift every key
    shares), float32 noise of ~1e-10 in practice."""
    model = _family("llama4", attention_bias=True)
    torch.manual_seed(seed)
    model = type(model)(model.config).float().train()
    return model


@ON_OLD_TORCH
def test_mathematically_zero_gradients_do_not_refuse_llama4() -> None:
    """Seeds that the purely relative comparison refused (0, 2, 4, 5, 6 of 0..6) are
    accepted, and train exactly."""
    for seed in range(7):
        TransformersMoEAdapter(_llama4_with_key_bias(seed))
    TransformersMoEAdapter(_llama4_with_key_bias(0), delay_wgrad_compute=True)
    _exact(_llama4_with_key_bias(0), families.batches(), self_check=True)


@ON_OLD_TORCH
def test_a_real_difference_in_a_small_gradient_is_still_refused() -> None:
    """A layer whose forward gives that key bias a real gradient the split does not
    compute (a term of value 0 in the output, of gradient 1e-4 * sum(grad)): refused,
    naming the gradient, although it is small next to the layer's largest."""
    model = _llama4_with_key_bias(0)
    layer = model.get_submodule("model.layers.3")

    class KeyBiasLayer(type(layer)):  # type: ignore[misc]  # a transformers class
        def forward(self, *args: object, **kwargs: object) -> Tensor:
            out = super().forward(*args, **kwargs)
            assert isinstance(out, Tensor)
            attn: Any = self.self_attn
            bias: Tensor = attn.k_proj.bias
            return out + 1e-4 * (bias.sum() - bias.sum().detach())

    layer.__class__ = KeyBiasLayer
    with pytest.raises(
        ConfigError, match=r"KeyBiasLayer \(layer 3\).*gradient of self_attn\.k_proj\.bias differs"
    ):
        TransformersMoEAdapter(model)


# --- 3. refusals that were not needed, and refusals that say why ------------------------


def test_per_layer_moe_topk() -> None:
    """HunYuan's ``moe_topk`` may give each layer its own top-k (here 1, 2, 3, 2): each
    MoE layer dispatches its own; exact with delayed weight gradients too (its top-1
    router's gradient is zero mathematically: the floor)."""
    model = _family("hunyuan_v1_moe", moe_topk=[1, 2, 3, 2])
    adapter = _exact(model, families.batches(), self_check=True, delay=True)
    top_ks = [
        layer.dispatcher.topk for layer in adapter.decoder.layers if isinstance(layer, HFMoELayer)
    ]
    assert top_ks == [1, 2, 3, 2]
    # transformers' load-balancing loss takes one top-k: asked for with these, refused.
    with pytest.raises(ConfigError, match=r"takes one top-k.*received per-layer top-k \[1, 2, 3\]"):
        TransformersMoEAdapter(model, router_aux_loss=True)


def test_a_forward_without_a_load_balancing_loss_is_followed() -> None:
    """HY-V3 with ``output_router_logits`` returns router logits but adds no aux loss: the
    adapter follows it (no aux loss) instead of refusing; asked for one explicitly, it
    refuses, saying the forward computes none."""
    model = _family("hy_v3", output_router_logits=True, router_aux_loss_coef=0.1)
    adapter = TransformersMoEAdapter(copy.deepcopy(model))
    assert adapter.aux is None
    mbs = families.batches(padded=True)
    _exact(model, mbs, self_check=True)
    with pytest.raises(ConfigError, match=r"standard load_balancing_loss_func.*computes no such"):
        TransformersMoEAdapter(model, router_aux_loss=True)


def test_the_load_balancing_loss_is_found_by_running_the_forward() -> None:
    """A causal LM subclass whose own forward only calls the parent's (its source names no
    loss) adds transformers' standard loss: accepted and exact; one whose loss differs (a
    doubled coefficient inside its forward) is refused, with both values."""
    base = mixtral(aux=True)

    class Wrapped(type(base)):  # type: ignore[misc]  # a transformers class
        def forward(self, *args: object, **kwargs: object) -> Any:
            return super().forward(*args, **kwargs)

    class Doubled(type(base)):  # type: ignore[misc]
        def forward(self, *args: object, **kwargs: object) -> Any:
            out = super().forward(*args, **kwargs)
            if out.loss is not None and out.aux_loss is not None:
                out.loss = out.loss + self.router_aux_loss_coef * out.aux_loss
            return out

    wrapped = copy.deepcopy(base)
    wrapped.__class__ = Wrapped
    adapter = TransformersMoEAdapter(copy.deepcopy(wrapped))
    assert adapter.aux is not None
    _exact(wrapped, microbatches(2, padded=True), self_check=True)
    doubled = copy.deepcopy(base)
    doubled.__class__ = Doubled
    with pytest.raises(ConfigError, match=r"computes another one \(it adds .* the standard"):
        TransformersMoEAdapter(doubled)


def test_a_router_sampling_in_eval_mode_too_is_refused() -> None:
    """A router that samples its experts whatever the mode: refused at construction."""
    model = mixtral().eval()
    for i in range(2):
        router = model.get_submodule(f"model.layers.{i}.mlp.gate")

        class SamplingRouter(type(router)):  # type: ignore[misc]  # a transformers class
            def forward(self, hidden_states: Tensor) -> Any:
                noise = torch.rand_like(hidden_states) * 1e-3
                return super().forward(hidden_states + noise)

        router.__class__ = SamplingRouter
    with pytest.raises(
        ConfigError,
        match=r"model\.layers\.0\.mlp\.gate \(SamplingRouter\): its forward draws random numbers in eval",
    ):
        TransformersMoEAdapter(model)


def test_dropout_outside_the_layers_follows_its_mode() -> None:
    """An embedding followed by dropout: refused in training mode (naming the dropout),
    accepted and exact in eval mode."""
    model = mixtral()
    embed = model.get_submodule("model.embed_tokens")

    class DroppedEmbedding(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = embed
            self.drop = nn.Dropout(0.1)

        def forward(self, ids: Tensor) -> Tensor:
            out: Tensor = self.drop(self.embed(ids))
            return out

    setattr(model.model, "embed_tokens", DroppedEmbedding())  # noqa: B010 - a transformers model
    with pytest.raises(ConfigError, match=r"model\.embed_tokens\.drop \(Dropout\).*training mode"):
        TransformersMoEAdapter(copy.deepcopy(model))
    _exact(model.eval(), microbatches(2), self_check=True)


def test_an_exception_inside_a_layer_names_the_module_and_is_the_cause() -> None:
    model = mixtral()

    class Broken(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            raise RuntimeError("kernel not built for this shape")

    setattr(model.get_submodule("model.layers.1.self_attn"), "q_proj", Broken())  # noqa: B010
    with pytest.raises(ConfigError) as info:
        TransformersMoEAdapter(model)
    text = str(info.value)
    assert "MixtralDecoderLayer (layer 1): MixtralDecoderLayer.self_attn.q_proj (Broken)" in text
    assert "raised RuntimeError: kernel not built" in text
    assert isinstance(info.value.__cause__, RuntimeError)


@pytest.mark.parametrize(
    ("family", "says"),
    [
        ("glm_moe_dsa", r"takes layer 0's output apart \(it returns 2 values"),
        (
            "deepseek_v4",
            r"layer 0's hidden states shaped like the embeddings.*\[2, 6, 4, 64\]: several "
            r"residual streams",
        ),
    ],
)
def test_refusals_state_the_reason(family: str, says: str) -> None:
    """GLM-MoE-DSA hands its indexer's top-k from layer to layer; DeepSeek-V4 keeps four
    residual streams per token (hyper-connections): each refusal says so, not the
    ``too many values to unpack`` / ``mat1 and mat2 shapes`` the stand-ins caused."""
    with pytest.raises(ConfigError, match=says):
        TransformersMoEAdapter(_family(family))


def test_transformers_output_capture_before_and_after_adapting() -> None:
    """A model that ran its own forward with ``output_hidden_states`` (transformers then
    puts its output-capturing hooks on every layer) is accepted: those hooks record only
    inside the model's own forward. And after the adapter was built, the model's own
    forward still finds its router logits (its load-balancing loss used to raise
    ``IndexError``: the hooks were installed while the adapter stood in for the layers)."""
    model = mixtral(aux=True)
    ids = microbatches(1)[0].input_ids
    assert ids is not None
    model(input_ids=ids, output_hidden_states=True)
    adapter = TransformersMoEAdapter(copy.deepcopy(model))
    combined_1f1b(adapter, microbatches(2))
    fresh = mixtral(aux=True)
    TransformersMoEAdapter(fresh)
    out = fresh(input_ids=ids, labels=ids)
    assert out.aux_loss is not None and len(out.router_logits) == 2
