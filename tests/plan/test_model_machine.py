"""The planner's cost model: parameter counts, FLOPs, configs read, links and rooflines."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, cast

import pytest

from moe_overlap import ConfigError
from moe_overlap.engine import Direction, Slot
from moe_overlap.plan._machine import (
    MACHINES,
    Link,
    Machine,
    a2a_ms,
    p2p_ms,
    roofline_durations,
)
from moe_overlap.plan._model import PRESETS, LayerKind, ModelSpec
from tests.debug_mode import refusal

F, B, W = Direction.FORWARD, Direction.BACKWARD, Direction.WGRAD

# --------------------------------------------------------------------- configs (public)

DEEPSEEK_V3: dict[str, object] = {
    "model_type": "deepseek_v3",
    "num_hidden_layers": 61,
    "hidden_size": 7168,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "vocab_size": 129280,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "head_dim": 64,
    "torch_dtype": "bfloat16",
}

QWEN3_MOE: dict[str, object] = {
    "model_type": "qwen3_moe",
    "num_hidden_layers": 94,
    "hidden_size": 4096,
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 151936,
    "torch_dtype": "bfloat16",
}

MIXTRAL: dict[str, object] = {
    "model_type": "mixtral",
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 32000,
    "torch_dtype": "bfloat16",
}

QWEN2_MOE: dict[str, object] = {
    "model_type": "qwen2_moe",
    "num_hidden_layers": 24,
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "intermediate_size": 5632,
    "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632,
    "num_experts": 60,
    "num_experts_per_tok": 4,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 151936,
    "torch_dtype": "bfloat16",
}


def small(**changes: Any) -> ModelSpec:
    fields: dict[str, Any] = {
        "num_layers": 4,
        "hidden_size": 256,
        "num_attention_heads": 4,
        "ffn_hidden_size": 512,
        "moe_ffn_hidden_size": 128,
        "num_experts": 8,
        "top_k": 2,
        "shared_experts": 1,
        "first_k_dense": 1,
        "vocab_size": 1000,
        "seq_len": 64,
    }
    fields.update(changes)
    return ModelSpec(**fields)


# ------------------------------------------------------------------------ params


@pytest.mark.parametrize(
    ("name", "total", "active", "total_tol", "active_tol"),
    [
        ("deepseek-v3-671b", 671e9, 37e9, 0.03, 0.10),
        ("qwen3-235b-a22b", 235e9, 22e9, 0.03, 0.10),
        ("qwen3-30b-a3b", 30.5e9, 3.3e9, 0.03, 0.10),
        ("mixtral-8x7b", 46.7e9, 12.9e9, 0.03, 0.10),
        ("deepseek-v2-lite", 15.7e9, 2.4e9, 0.03, 0.15),
    ],
)
def test_presets_match_the_published_parameter_counts(
    name: str, total: float, active: float, total_tol: float, active_tol: float
) -> None:
    spec = ModelSpec.preset(name)
    assert spec.total_params() == pytest.approx(total, rel=total_tol)
    assert spec.active_params() == pytest.approx(active, rel=active_tol)
    assert spec.rank_params(1) == spec.total_params()
    assert spec.rank_params(spec.num_experts) < spec.rank_params(2) < spec.total_params()


def test_every_preset_is_listed_and_an_unknown_one_names_them() -> None:
    assert "deepseek-v3-671b" in PRESETS and "qwen3-235b-a22b" in PRESETS
    for name in PRESETS:
        assert ModelSpec.preset(name, seq_len=128).tokens == 128
    with pytest.raises(ConfigError, match="deepseek-v3-671b") as info:
        ModelSpec.preset("gpt-5")
    assert "'gpt-5'" in str(info.value)


def test_layer_pattern_dense_prefix_then_every_kth() -> None:
    v3 = ModelSpec.preset("deepseek-v3-671b")
    assert [v3.is_moe(i) for i in range(5)] == [False, False, False, True, True]
    assert (v3.moe_layers, v3.dense_layers) == (58, 3)
    stepped = small(num_layers=7, first_k_dense=1, moe_layer_freq=2)
    assert [stepped.is_moe(i) for i in range(7)] == [False, False, True, False, True, False, True]
    assert stepped.moe_layers == 3 and stepped.dense_layers == 4
    with pytest.raises(ConfigError, match="layer"):
        stepped.is_moe(7)


# ------------------------------------------------------------------------- FLOPs


def _step_flops(spec: ModelSpec) -> float:
    total = 0.0
    for layer in range(spec.num_layers):
        kind = spec.layer_kind(layer)
        for slot in (Slot.PRE_DISPATCH, Slot.MLP):
            total += sum(spec.node_flops(kind, slot, d) for d in (F, B, W))
    total += sum(spec.node_flops("pre", Slot.PRE_PROCESS, d) for d in (F, B, W))
    total += sum(spec.node_flops("post", Slot.POST_PROCESS, d) for d in (F, B, W))
    return total


@pytest.mark.parametrize("name", ["deepseek-v3-671b", "qwen3-235b-a22b", "mixtral-8x7b"])
def test_flops_are_six_active_params_per_token_without_the_attention_core(name: str) -> None:
    # One-token sequences: the attention core (quadratic in the sequence) vanishes.
    spec = ModelSpec.preset(name, seq_len=1, micro_batch_size=4096)
    flops = _step_flops(spec)
    assert flops == pytest.approx(6 * spec.active_params() * spec.tokens, rel=0.03)
    # Exactly, but for the embedding lookup and the norms (no matmul FLOPs).
    matmul_params = spec.active_params() - spec.vocab_size * spec.hidden_size
    assert flops == pytest.approx(6 * matmul_params * spec.tokens, rel=2e-3)


def test_backward_adds_twice_the_attention_core_and_wgrad_none() -> None:
    spec = ModelSpec.preset("qwen3-235b-a22b", seq_len=4096)
    core = spec.tokens * spec.seq_len * 64 * (128 + 128)  # 2 T s heads (qk+v) / 2
    fwd = spec.node_flops("moe", Slot.PRE_DISPATCH, F)
    bwd = spec.node_flops("moe", Slot.PRE_DISPATCH, B)
    wgrad = spec.node_flops("moe", Slot.PRE_DISPATCH, W)
    assert fwd - wgrad == pytest.approx(core)
    assert bwd - wgrad == pytest.approx(2 * core)
    experts = 2 * spec.tokens * 8 * 3 * 4096 * 1536
    for d in (F, B, W):
        assert spec.node_flops("moe", Slot.MLP, d) == pytest.approx(experts)
        assert spec.node_flops("moe", Slot.DISPATCH, d) == 0.0
        assert spec.node_flops("moe", Slot.COMBINE, d) == 0.0
    assert spec.node_flops("post", Slot.POST_PROCESS, F) == 2 * spec.tokens * 4096 * 151936
    assert spec.node_flops("pre", Slot.PRE_PROCESS, F) == 0.0


def test_node_arguments_are_checked() -> None:
    spec = small()
    with pytest.raises(ConfigError, match=r"node_flops: slot .*received Slot.*dispatch"):
        spec.node_flops("dense", Slot.DISPATCH, F)
    with refusal(r"layer_kind .*received str 'attn'", hinted="layer_kind"):
        spec.node_flops(cast(Any, "attn"), Slot.MLP, F)
    with pytest.raises(ConfigError, match=r"direction .*received Direction"):
        spec.node_flops("moe", Slot.MLP, Direction.HOOK)
    with pytest.raises(ConfigError, match=r"node_bytes: ep must be a divisor of num_experts=8"):
        spec.node_bytes("moe", Slot.MLP, F, ep=3)


def test_bytes_read_fewer_expert_weights_with_more_ranks() -> None:
    spec = ModelSpec.preset("deepseek-v3-671b", seq_len=4096)
    one = spec.node_bytes("moe", Slot.MLP, F, ep=8)
    many = spec.node_bytes("moe", Slot.MLP, F, ep=64)
    weights = (32 - 4) * 3 * 7168 * 2048 * 2  # 32 vs 4 local experts
    assert one - many == pytest.approx(weights)
    assert spec.node_bytes("moe", Slot.DISPATCH, F, ep=8) == 0.0
    assert spec.node_bytes("moe", Slot.PRE_DISPATCH, B) > spec.node_bytes(
        "moe", Slot.PRE_DISPATCH, F
    )


def test_a2a_bytes() -> None:
    spec = ModelSpec.preset("deepseek-v3-671b", seq_len=4096)
    assert spec.a2a_bytes(1) == 0.0
    assert spec.a2a_bytes(8) == 4096 * 8 * 7168 * 2 * 7 / 8
    assert spec.a2a_bytes(64) > spec.a2a_bytes(8)


def test_activation_bytes() -> None:
    spec = small(seq_len=128)
    t, h = 128, 256
    assert spec.activation_bytes("pre") == t * h * 2
    assert spec.activation_bytes("post") == 2 * t * h * 2 + t * 1000 * 4
    assert spec.activation_bytes("moe") > spec.activation_bytes("dense") > 0
    doubled = dataclasses.replace(spec, micro_batch_size=2)
    kinds: tuple[LayerKind, ...] = ("moe", "dense", "post")
    for kind in kinds:
        assert doubled.activation_bytes(kind) >= 2 * spec.activation_bytes(kind)


# ---------------------------------------------------------------- HF configs


def test_deepseek_v3_config_is_the_preset() -> None:
    spec = ModelSpec.from_hf_config(DEEPSEEK_V3, seq_len=4096)
    preset = ModelSpec.preset("deepseek-v3-671b")
    assert dataclasses.replace(spec, name=preset.name) == preset
    assert spec.name == "deepseek_v3" and spec.is_mla


def test_qwen3_moe_config_is_the_preset() -> None:
    spec = ModelSpec.from_hf_config(QWEN3_MOE, seq_len=2048, micro_batch_size=2, name="q")
    assert spec == dataclasses.replace(
        ModelSpec.preset("qwen3-235b-a22b", seq_len=2048, micro_batch_size=2), name="q"
    )


def test_mixtral_experts_take_the_intermediate_size() -> None:
    spec = ModelSpec.from_hf_config(MIXTRAL, seq_len=4096)
    assert spec.moe_ffn_hidden_size == 14336 and spec.num_experts == 8 and spec.top_k == 2
    assert spec == dataclasses.replace(ModelSpec.preset("mixtral-8x7b"), name="mixtral")


def test_qwen2_moe_shared_expert_width_becomes_a_count() -> None:
    spec = ModelSpec.from_hf_config(QWEN2_MOE, seq_len=4096)
    assert spec.shared_experts == 4  # 5632 / 1408
    assert spec.total_params() == pytest.approx(14.3e9, rel=0.03)
    assert spec.active_params() == pytest.approx(2.7e9, rel=0.05)


class _Config:
    def __init__(self, fields: Mapping[str, object]) -> None:
        self.fields = dict(fields)

    def to_dict(self) -> dict[str, object]:
        return dict(self.fields)


def test_config_objects_nested_text_configs_and_dtypes() -> None:
    assert ModelSpec.from_hf_config(_Config(MIXTRAL), seq_len=8).num_layers == 32
    nested = {"model_type": "wrapper", "text_config": _Config(QWEN3_MOE)}
    assert ModelSpec.from_hf_config(nested, seq_len=8).num_experts == 128
    fp32 = ModelSpec.from_hf_config({**MIXTRAL, "dtype": "float32"}, seq_len=8)
    assert fp32.dtype_bytes == 4
    with pytest.raises(ConfigError, match=r"config\['torch_dtype'\].*str 'int4'"):
        ModelSpec.from_hf_config({**MIXTRAL, "torch_dtype": "int4"}, seq_len=8)


def test_qwen_layer_patterns() -> None:
    stepped = ModelSpec.from_hf_config({**QWEN3_MOE, "decoder_sparse_step": 2}, seq_len=8)
    assert [stepped.is_moe(i) for i in range(4)] == [False, True, False, True]
    prefix = ModelSpec.from_hf_config({**QWEN3_MOE, "mlp_only_layers": [0, 1]}, seq_len=8)
    assert prefix.first_k_dense == 2 and prefix.moe_layers == 92
    with pytest.raises(ConfigError, match=r"mlp_only_layers.*received list \[5\]"):
        ModelSpec.from_hf_config({**QWEN3_MOE, "mlp_only_layers": [5]}, seq_len=8)


def test_dense_and_malformed_configs_are_refused() -> None:
    dense = {k: v for k, v in MIXTRAL.items() if k != "num_local_experts"}
    with pytest.raises(ConfigError, match="not a mixture-of-experts config.*pass a ModelSpec"):
        ModelSpec.from_hf_config(dense, seq_len=8)
    with pytest.raises(ConfigError, match="not a mixture-of-experts config"):
        ModelSpec.from_hf_config({**QWEN3_MOE, "num_experts": 0}, seq_len=8)
    with pytest.raises(ConfigError, match=r"config\['hidden_size'\].*received str '4096'"):
        ModelSpec.from_hf_config({**MIXTRAL, "hidden_size": "4096"}, seq_len=8)
    with pytest.raises(ConfigError, match=r"config has no 'vocab_size'"):
        ModelSpec.from_hf_config({k: v for k, v in MIXTRAL.items() if k != "vocab_size"}, seq_len=8)
    with pytest.raises(ConfigError, match=r"config must be a mapping.*received int 3"):
        ModelSpec.from_hf_config(cast(Any, 3), seq_len=8)
    with pytest.raises(
        ConfigError, match=r"ModelSpec.seq_len: expected an int >= 1, received int 0"
    ):
        ModelSpec.from_hf_config(MIXTRAL, seq_len=0)


# ------------------------------------------------------------------ ModelSpec fields


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        ({"num_layers": 0}, r"ModelSpec.num_layers: expected an int >= 1, received int 0"),
        ({"hidden_size": True}, r"ModelSpec.hidden_size: expected an int >= 1, received bool True"),
        ({"top_k": 9}, r"ModelSpec.top_k: expected an int in \[1, num_experts=8\], received int 9"),
        ({"first_k_dense": 5}, r"ModelSpec.first_k_dense: .*num_layers=4.*received int 5"),
        ({"num_kv_heads": 3}, r"ModelSpec.num_kv_heads: expected a divisor .*received int 3"),
        ({"hidden_size": 250}, r"ModelSpec.hidden_size: expected a multiple .*received int 250"),
        ({"dtype_bytes": 3}, r"ModelSpec.dtype_bytes: .*received int 3"),
        ({"q_lora_rank": 64}, r"ModelSpec.q_lora_rank: expected None without kv_lora_rank"),
        ({"kv_lora_rank": 64}, r"ModelSpec.qk_rope_head_dim: .*kv_lora_rank set.*NoneType None"),
        ({"name": 3}, r"ModelSpec.name: expected a string, received int 3"),
    ],
)
def test_bad_fields_are_refused_naming_field_and_value(
    changes: dict[str, Any], pattern: str
) -> None:
    # an int where the annotation says str: debug mode's beartype refuses it first
    hinted = "name" if "name" in changes else None
    with refusal(pattern, hinted=hinted):
        small(**changes)


# -------------------------------------------------------------------------- machine


def test_machine_presets_and_refusals() -> None:
    assert set(MACHINES) >= {"h100", "h200", "h800"}
    h200, h800 = Machine.preset("h200"), Machine.preset("h800")
    assert h200.hbm_GB == 141 and h200.hbm_GBps == 4800 and h200.peak_tflops == 989
    assert h800.nvlink.beta_GBps == 200 and h200.nvlink.beta_GBps == 450
    assert h200.network.beta_GBps == 50
    with pytest.raises(ConfigError, match="h200"):
        Machine.preset("b200")
    with pytest.raises(ConfigError, match=r"Machine.mfu: expected a fraction .*received float 1.5"):
        dataclasses.replace(h200, mfu=1.5)
    with pytest.raises(ConfigError, match=r"Link.beta_GBps: expected .*> 0, received int 0"):
        Link(name="x", alpha_us=1.0, beta_GBps=0)


def test_link_time() -> None:
    link = Link(name="l", alpha_us=10.0, beta_GBps=100.0)
    assert link.time_ms(0) == pytest.approx(0.01)
    assert link.time_ms(1e9, messages=0) == pytest.approx(10.0)  # 1 GB at 100 GB/s
    assert link.time_ms(1e9, messages=3) == pytest.approx(10.03)


def test_a2a_over_nvlink_and_across_nodes() -> None:
    h = Machine.preset("h200")
    nbytes = 420e6
    assert a2a_ms(h, nbytes, ep=1) == 0.0
    in_node = a2a_ms(h, nbytes, ep=8)
    assert in_node == pytest.approx(h.nvlink.time_ms(nbytes, 7))
    two_nodes = a2a_ms(h, nbytes, ep=16)
    near = h.nvlink.time_ms(nbytes * 7 / 15, 7)
    far = h.network.time_ms(nbytes * 8 / 15, 8)
    assert two_nodes == pytest.approx(max(near, far)) == pytest.approx(far)
    assert two_nodes > 3 * in_node
    # A group straddling two nodes pays the network even at ep=8.
    straddling = a2a_ms(h, nbytes, ep=8, first_rank_in_node=4)
    assert straddling == pytest.approx(h.network.time_ms(nbytes * 4 / 7, 4))
    with pytest.raises(ConfigError, match=r"first_rank_in_node must be an int in \[0, gpus_per"):
        a2a_ms(h, nbytes, ep=8, first_rank_in_node=8)
    assert p2p_ms(h, 1e6, same_node=True) < p2p_ms(h, 1e6, same_node=False)


# ------------------------------------------------------------------------- roofline


def test_roofline_keys_look_like_timeline_keys() -> None:
    spec = small()  # layer 0 dense, 1..3 MoE
    times = roofline_durations(spec, Machine.preset("h100"), ep=4)
    expected: set[tuple[int | None, Slot, Direction]] = {
        (None, Slot.PRE_PROCESS, F),
        (None, Slot.PRE_PROCESS, B),
        (None, Slot.POST_PROCESS, F),
        (None, Slot.POST_PROCESS, B),
        (None, Slot.POST_PROCESS, W),
    }
    for layer in range(4):
        for slot in (Slot.PRE_DISPATCH, Slot.MLP):
            expected |= {(layer, slot, d) for d in (F, B, W)}
        if layer:
            expected |= {(layer, s, d) for s in (Slot.DISPATCH, Slot.COMBINE) for d in (F, B)}
    assert set(times) == expected
    assert all(v > 0 for v in times.values())
    assert times[(1, Slot.DISPATCH, F)] == times[(1, Slot.COMBINE, B)] > 0
    only = roofline_durations(spec, Machine.preset("h100"), ep=4, layers=[2])
    assert {k[0] for k in only} == {None, 2}
    assert roofline_durations(spec, Machine.preset("h100"), ep=1)[(1, Slot.DISPATCH, F)] == 0.0


def test_roofline_grows_with_tokens() -> None:
    machine = Machine.preset("h200")
    short = ModelSpec.preset("qwen3-235b-a22b", seq_len=2048)
    for longer in (
        dataclasses.replace(short, seq_len=4096),
        dataclasses.replace(short, micro_batch_size=2),
    ):
        a = roofline_durations(short, machine, ep=8)
        b = roofline_durations(longer, machine, ep=8)
        assert a.keys() == b.keys()
        assert all(b[k] >= a[k] for k in a)
        assert sum(b.values()) > 1.9 * sum(a.values())


def test_roofline_is_memory_bound_for_few_tokens() -> None:
    machine = Machine.preset("h100")
    spec = ModelSpec.preset("deepseek-v3-671b", seq_len=16)
    ms = roofline_durations(spec, machine, ep=64)[(3, Slot.MLP, F)]
    nbytes = spec.node_bytes("moe", Slot.MLP, F, ep=64)
    assert ms == pytest.approx(nbytes / (machine.hbm_GBps * 1e6))


def test_roofline_refuses_an_ep_that_does_not_divide_the_experts() -> None:
    with pytest.raises(
        ConfigError, match=r"ep must be a divisor of the model's num_experts=8.*int 3"
    ):
        roofline_durations(small(), Machine.preset("h100"), ep=3)
    with pytest.raises(ConfigError, match=r"layers must be None or a collection"):
        roofline_durations(small(), Machine.preset("h100"), ep=2, layers=[4])
