"""The Megatron-Core adapter on one CPU process (Megatron's CUDA-only calls replaced by the
test-only shim in ``_megatron_cpu.py``): a ``GPTModel`` with MoE layers through every
schedule, bit-identical to the same model's own forward and backward; the self-check, and
the refusals."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn

pytest.importorskip("megatron.core", reason="Megatron-Core is not installed")

from moe_overlap import ConfigError, ScheduleOptions, combined_1f1b
from moe_overlap.adapters.megatron import MegatronMoEAdapter
from tests.adapters._megatron import (
    TINY,
    assert_bit_identical,
    local_gpt,
    megatron_step,
    microbatches,
    node_schedule,
    tiny_config,
)
from tests.adapters._megatron_cpu import megatron_on_cpu
from tests.saved_bytes import peak_saved_bytes

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
    pytest.mark.filterwarnings("ignore::FutureWarning:megatron"),
]


@pytest.fixture(autouse=True)
def _megatron() -> Iterator[None]:
    with megatron_on_cpu():
        yield


def build(
    kind: str = "moe",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    tied: bool = False,
    **config: Any,
) -> nn.Module:
    """A tiny ``GPTModel`` with the local spec: ``moe`` two MoE layers (4 experts, top 2,
    all-to-all); ``mixed`` a dense layer, then a MoE layer with shared experts, the
    load-balancing loss and the all-gather dispatcher; ``bias`` ``moe`` with sigmoid
    routing and the expert bias (its token counts are compared too)."""
    specs: Any = importlib.import_module("megatron.core.models.gpt.gpt_layer_specs")
    tc: Any = importlib.import_module("megatron.core.transformer.transformer_config")

    args: dict[str, Any] = TINY | {"params_dtype": dtype, "bf16": dtype == torch.bfloat16}
    if kind == "mixed":
        args |= {
            "moe_layer_freq": [0, 1],
            "moe_shared_expert_intermediate_size": 24,
            "moe_token_dispatcher_type": "allgather",
            "moe_aux_loss_coeff": 0.01,
        }
    elif kind == "bias":
        args |= {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True}
    args |= config
    torch.manual_seed(seed)
    config = tc.TransformerConfig(**args)
    spec: Any = (
        specs.get_gpt_decoder_block_spec(config, use_transformer_engine=False)
        if kind == "mixed"
        else None
    )
    model = local_gpt(config, transformer_layer_spec=spec, share_embeddings_and_output_weights=tied)
    return model.to(dtype)


VARIANTS: dict[str, dict[str, Any]] = {
    "serial": {"overlap": False},
    "overlapped": {},
    "fill_drain": {"fill_drain": True},
    "recompute": {"recompute": ("pre_dispatch", "mlp")},
    "recompute_fill_drain": {"fill_drain": True, "recompute": ("pre_dispatch", "mlp")},
    "node_schedule": {"schedule": "random"},
}


@pytest.mark.parametrize("kind", ["moe", "mixed", "bias"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_schedules_are_bit_identical_to_megatron_s_own_forward_backward(
    kind: str, variant: str
) -> None:
    model, ref = build(kind), build(kind)
    adapter = MegatronMoEAdapter(model)
    kwargs = dict(VARIANTS[variant])
    recompute = kwargs.pop("recompute", ())
    if kwargs.get("schedule") == "random":
        kwargs["schedule"] = node_schedule("dm" if kind == "mixed" else "mm")
    mbs = microbatches(loss_mask=kind == "mixed", padding=kind == "mixed")
    options = adapter.schedule_options()
    options = ScheduleOptions(free_input=options.free_input, recompute=recompute)
    got = combined_1f1b(adapter, mbs, options=options, **kwargs)
    want = megatron_step(ref, mbs)
    assert [float(x) for x in got] == [float(x) for x in want]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert_bit_identical(model, ref)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_bfloat16_overlapped_and_fill_drain_are_bit_identical(tied: bool) -> None:
    """bfloat16, six microbatches; with the output layer sharing the word embedding's
    weight too (its two gradients per microbatch summed as the model's own backward sums
    them, whatever the schedule's order)."""
    for fill_drain in (False, True):
        model = build(dtype=torch.bfloat16, tied=tied)
        ref = build(dtype=torch.bfloat16, tied=tied)
        adapter = MegatronMoEAdapter(model)
        assert adapter.self_check_report.structures[0][3] == "bfloat16"
        mbs = microbatches(6)
        got = combined_1f1b(adapter, mbs, options=adapter.schedule_options(), fill_drain=fill_drain)
        want = megatron_step(ref, mbs)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        assert_bit_identical(model, ref)


def _peak_saved_bytes(recompute: tuple[Any, ...]) -> int:
    """Peak bytes of the tensors autograd keeps for backward over one fill/drain step."""
    adapter = MegatronMoEAdapter(build())
    free_input = adapter.schedule_options().free_input
    options = ScheduleOptions(free_input=free_input, recompute=recompute)
    return peak_saved_bytes(
        lambda: combined_1f1b(adapter, microbatches(), options=options, fill_drain=True)
    )


def test_recomputed_slots_release_their_forward_graph() -> None:
    """Megatron-Core keeps the router's probs on the dispatcher and the pre-MLP norm's
    input on the layer (its offload manager); held, they would keep a recomputed
    pre-dispatch's whole forward graph (attention included) alive until the next call.
    Measured: 0.66x of fill/drain's peak before the adapter released them, 0.17x after."""
    kept = _peak_saved_bytes(())
    recomputed = _peak_saved_bytes(("pre_dispatch", "mlp"))
    assert recomputed < 0.3 * kept


def test_the_plain_path_is_the_model_s_own() -> None:
    model, ref = build("mixed"), build("mixed")
    adapter = MegatronMoEAdapter(model)
    (mb,) = microbatches(1)
    assert mb.input_ids is not None
    logits = adapter.forward(mb.input_ids, mb.position_ids, mb.attention_mask)
    want = ref(mb.input_ids, mb.position_ids, mb.attention_mask)
    assert torch.equal(logits, want)


def test_a_model_that_has_already_trained_is_adapted_and_stays_exact() -> None:
    """The adapter wraps a model after steps of Megatron-Core's own (the dispatcher then holds
    the last call's routing tensors, with their graphs): the self-check copies it all the same,
    and the schedule goes on bit-identical to the model's own step."""
    model, ref = build(), build()
    first = microbatches(2)
    megatron_step(model, first)
    megatron_step(ref, first)
    adapter = MegatronMoEAdapter(model)
    mbs = microbatches()
    got = combined_1f1b(adapter, mbs, options=adapter.schedule_options())
    want = megatron_step(ref, mbs)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert_bit_identical(model, ref)


def test_the_self_check_reports_each_layer_structure() -> None:
    report = MegatronMoEAdapter(build()).self_check_report
    assert report.enabled
    assert report.structures == [
        ("TransformerLayer", ["decoder.layers.0", "decoder.layers.1"], 0.0, "float32")
    ]
    assert not MegatronMoEAdapter(build(), self_check=False).self_check_report.structures


@pytest.mark.parametrize("pre_process", [True, False], ids=["first", "later"])
def test_a_bf16_stage_with_fp32_norm_weights_is_self_checked_in_bf16(pre_process: bool) -> None:
    """Megatron-Core builds the local norms' weights in fp32 under ``params_dtype=bf16``;
    a stage without the embedding starts with one. The probe takes the model's compute
    dtype (most parameters'), not the first parameter's."""
    config = tiny_config(num_layers=1, bf16=True, params_dtype=torch.bfloat16)
    torch.manual_seed(0)
    model = local_gpt(config, pre_process=pre_process, post_process=False)
    assert next(model.parameters()).dtype == (torch.bfloat16 if pre_process else torch.float32)
    report = MegatronMoEAdapter(model).self_check_report
    assert report.structures == [("TransformerLayer", ["decoder.layers.0"], 0.0, "bfloat16")]


def test_a_failing_mixed_dtype_model_is_told_to_cast_the_whole_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CUDA a bf16 model with fp32 norm weights fails in ``layer_norm`` (mixed dtypes);
    the refusal names the dtypes and the cast Megatron-Core's Float16Module does."""
    config = tiny_config(num_layers=1, bf16=True, params_dtype=torch.bfloat16)
    model = local_gpt(config, pre_process=False, post_process=False)
    norm = model.get_submodule("decoder.layers.0.input_layernorm")

    def mixed(x: Tensor) -> Tensor:
        raise RuntimeError("expected scalar type BFloat16 but found Float")

    monkeypatch.setattr(norm, "forward", mixed)
    with pytest.raises(ConfigError, match=r"several dtypes \(torch.bfloat16, torch.float32\)"):
        MegatronMoEAdapter(model)


def test_the_self_check_catches_a_wrong_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """A split that drops the shared experts from combine (a probe of the check itself)."""
    from moe_overlap.adapters import _mc_layers

    real = _mc_layers.McMoELayer.combine

    def without_shared(self: Any, ctx: Any, out: Tensor) -> Tensor:
        ctx.layer_state.shared_expert_output = None
        return real(self, ctx, out)

    monkeypatch.setattr(_mc_layers.McMoELayer, "combine", without_shared)
    with pytest.raises(ConfigError, match=r"decoder\.layers\.1 .*differs from its own forward"):
        MegatronMoEAdapter(build("mixed"))
    MegatronMoEAdapter(build("mixed"), self_check=False)  # trains it anyway, unverified


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"hidden_dropout": 0.1}, r"config\.hidden_dropout: expected 0\.0 or 0 .*received 0\.1"),
        ({"mlp_chunks_for_training": 2}, r"mlp_chunks_for_training: expected 1 "),
        (
            {
                "recompute_granularity": "full",
                "recompute_method": "uniform",
                "recompute_num_layers": 1,
            },
            r"recompute_granularity: expected None",
        ),
    ],
)
def test_configurations_it_cannot_follow_are_refused(config: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        MegatronMoEAdapter(build(**config))


def test_other_models_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"expected a Megatron-Core GPTModel .*received Linear"):
        MegatronMoEAdapter(nn.Linear(2, 2))
    hybrid = type("HybridModel", (nn.Module,), {})()  # named as Megatron-Core's, not it
    with pytest.raises(ConfigError, match=r"GPTModel .*or HybridModel .*received HybridModel$"):
        MegatronMoEAdapter(hybrid)
    with pytest.raises(ConfigError, match=r"expected MoE layers"):
        MegatronMoEAdapter(build(num_moe_experts=None, moe_ffn_hidden_size=None))


def test_a_model_changed_after_construction_is_refused() -> None:
    model = build()
    adapter = MegatronMoEAdapter(model)
    moe: Any = model.get_submodule("decoder.layers.1.mlp")
    moe.router = (
        type(moe.router)(config=moe.config, pg_collection=moe.router.pg_collection)
        if hasattr(moe.router, "pg_collection")
        else nn.Identity()
    )
    with pytest.raises(ConfigError, match=r"decoder\.layers\.1\.mlp: expected the modules the"):
        combined_1f1b(adapter, microbatches(2), options=adapter.schedule_options())
    layers: Any = model.get_submodule("decoder.layers")
    layers.append(nn.Identity())
    with pytest.raises(ConfigError, match=r"blocks added \['decoder\.layers\.2'\]"):
        combined_1f1b(adapter, microbatches(2), options=adapter.schedule_options())


def test_releasing_inputs_on_one_expert_rank_is_refused_by_the_schedule() -> None:
    """On one rank Megatron-Core's all-to-all hands its input on as its output: releasing
    the dispatch input (free_input=True) would free the experts' input; the schedule
    refuses it, naming the slot (schedule_options() keeps every input)."""
    from moe_overlap import ScheduleError

    adapter = MegatronMoEAdapter(build())
    assert not adapter.schedule_options().free_input
    with pytest.raises(ScheduleError, match=r"'moe_dispatch': output 0 .*shares storage"):
        combined_1f1b(adapter, microbatches(2), options=ScheduleOptions(free_input=True))


def test_a_stage_holds_the_model_s_modules_under_their_own_names() -> None:
    from moe_overlap.adapters.megatron import MegatronMoEStage

    model, ref = build(), build()
    stage = MegatronMoEStage(MegatronMoEAdapter(model))
    assert [n for n, _ in stage.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert stage.decoder.layers[0].name == "decoder.layers.0"  # the adapted layers
    (mb,) = microbatches(1)
    assert mb.input_ids is not None
    logits = stage(mb.input_ids, mb.position_ids, mb.attention_mask)
    assert torch.equal(logits, ref(mb.input_ids, mb.position_ids, mb.attention_mask))
