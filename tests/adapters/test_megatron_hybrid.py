"""The Megatron-Core adapter on a ``HybridModel`` (GPTModel's successor) on one CPU process:
attention ('*'), MLP ('-') and MoE ('E') layers from Megatron-Core's own local modules, every
schedule bit-identical to the model's own forward and backward; the self-check of the steps
around the decoder, and the refusals.

Megatron-Core's ``HybridStack`` builds its final norm as Transformer Engine's ``TENorm``
(not installable here): the stock stack is built without it (``post_layer_norm=False``, a
constructor argument of its own, given through the stack spec's ``params``), and
``LocalNormStack`` (test-only) gives it Megatron-Core's local norm instead.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("megatron.core", reason="Megatron-Core is not installed")

from moe_overlap import ConfigError, Microbatch, ScheduleOptions, combined_1f1b
from moe_overlap.adapters.megatron import MegatronMoEAdapter
from tests.adapters._megatron import (
    BATCH,
    MICROBATCHES,
    SEQ,
    TINY,
    VOCAB,
    assert_bit_identical,
    megatron_step,
    node_schedule,
)
from tests.adapters._megatron import microbatches as megatron_microbatches
from tests.adapters._megatron_cpu import megatron_on_cpu

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
    pytest.mark.filterwarnings("ignore::FutureWarning:megatron"),
]

PATTERN = "*E-E"
"""Attention, MoE, MLP, MoE: the MoE layers have no attention of their own."""


@pytest.fixture(autouse=True)
def _megatron() -> Iterator[None]:
    """Megatron-Core on this CPU process (its MoE metrics tracker fresh before and after)."""
    with megatron_on_cpu():
        yield


def _local_norm() -> Any:
    specs: Any = importlib.import_module("megatron.core.models.gpt.gpt_layer_specs")
    return specs.get_gpt_layer_local_submodules().input_layernorm


def _local_norm_stack() -> type[nn.Module]:
    block: Any = importlib.import_module("megatron.core.models.hybrid.hybrid_block")

    class LocalNormStack(block.HybridStack):  # type: ignore[misc]
        """``HybridStack`` with Megatron-Core's local final norm in place of ``TENorm``."""

        def __init__(self, config: Any, submodules: Any, **kwargs: Any) -> None:
            post_layer_norm = kwargs.pop("post_layer_norm", True)
            super().__init__(config, submodules, post_layer_norm=False, **kwargs)
            self.post_layer_norm = post_layer_norm
            if self.post_process and post_layer_norm:
                self.final_norm = _local_norm()(
                    config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon
                )

    return LocalNormStack


def stack_spec(*, final_norm: bool = True, mamba: bool = False) -> Any:
    """A hybrid stack spec from Megatron-Core's local modules (the layer specs
    ``get_gpt_layer_local_submodules`` gives, each layer kind keeping its part)."""
    specs: Any = importlib.import_module("megatron.core.models.gpt.gpt_layer_specs")
    block: Any = importlib.import_module("megatron.core.models.hybrid.hybrid_block")
    spec_utils: Any = importlib.import_module("megatron.core.transformer.spec_utils")
    tl: Any = importlib.import_module("megatron.core.transformer.transformer_layer")
    mlp_layer: Any = importlib.import_module("megatron.core.ssm.mlp_layer")
    ModuleSpec, Submodules = spec_utils.ModuleSpec, tl.TransformerLayerSubmodules
    moe = specs.get_gpt_layer_local_submodules(num_experts=4, moe_grouped_gemm=False)
    dense = specs.get_gpt_layer_local_submodules()
    attention = Submodules(
        input_layernorm=moe.input_layernorm,
        self_attention=moe.self_attention,
        self_attn_bda=moe.self_attn_bda,
    )
    moe_part = Submodules(pre_mlp_layernorm=moe.pre_mlp_layernorm, mlp=moe.mlp, mlp_bda=moe.mlp_bda)
    mlp_part = Submodules(
        pre_mlp_layernorm=dense.pre_mlp_layernorm, mlp=dense.mlp, mlp_bda=dense.mlp_bda
    )
    layers: dict[str, Any] = {
        "attention_layer": ModuleSpec(module=tl.TransformerLayer, submodules=attention),
        "moe_layer": ModuleSpec(module=tl.TransformerLayer, submodules=moe_part),
        "mlp_layer": ModuleSpec(module=mlp_layer.MLPLayer, submodules=mlp_part),
    }
    if mamba:  # its MambaMixer needs mamba_ssm (CUDA): an identity mixer stands in
        ml: Any = importlib.import_module("megatron.core.ssm.mamba_layer")
        identity: Any = importlib.import_module("megatron.core.transformer.identity_op")
        layers["mamba_layer"] = ModuleSpec(
            module=ml.MambaLayer,
            submodules=ml.MambaLayerSubmodules(norm=_local_norm(), mixer=identity.IdentityOp),
        )
    if final_norm:
        return ModuleSpec(
            module=_local_norm_stack(), submodules=block.HybridStackSubmodules(**layers)
        )
    return ModuleSpec(
        module=block.HybridStack,
        params={"post_layer_norm": False},
        submodules=block.HybridStackSubmodules(**layers),
    )


def build(
    pattern: str = PATTERN,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    tied: bool = False,
    final_norm: bool = True,
    model_class: Any = None,
    pre_process: bool = True,
    post_process: bool = True,
    **config: Any,
) -> nn.Module:
    """A tiny ``HybridModel`` (4 experts, top 2, all-to-all, rope, shared experts and the
    load-balancing loss)."""
    hm: Any = importlib.import_module("megatron.core.models.hybrid.hybrid_model")
    tc: Any = importlib.import_module("megatron.core.transformer.transformer_config")
    args: dict[str, Any] = (
        TINY
        | {
            "num_layers": len(pattern.replace("|", "").split("/")[0]),
            "moe_shared_expert_intermediate_size": 24,
            "moe_aux_loss_coeff": 0.01,
            "params_dtype": dtype,
            "bf16": dtype == torch.bfloat16,
        }
        | config
    )
    torch.manual_seed(seed)
    cls = hm.HybridModel if model_class is None else model_class
    model: nn.Module = cls(
        config=tc.TransformerConfig(**args),
        hybrid_stack_spec=stack_spec(final_norm=final_norm, mamba="M" in pattern),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        hybrid_layer_pattern=pattern,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=tied,
        pre_process=pre_process,
        post_process=post_process,
    )
    return model.to(dtype)


def microbatches(n: int = MICROBATCHES, *, padding: bool = False) -> list[Microbatch]:
    """``n`` causally masked microbatches with random token weights; with ``padding`` each
    sequence's last two tokens are padding (left out of routing)."""
    return megatron_microbatches(n, loss_mask=True, padding=padding)


VARIANTS: dict[str, dict[str, Any]] = {
    "serial": {"overlap": False},
    "overlapped": {},
    "fill_drain": {"fill_drain": True},
    "recompute": {"recompute": ("pre_dispatch", "mlp")},
    "node_schedule": {"schedule": "random"},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_schedules_are_bit_identical_to_the_hybrid_model_s_own_forward_backward(
    variant: str,
) -> None:
    model, ref = build(), build()
    adapter = MegatronMoEAdapter(model)
    assert [type(layer).__name__ for layer in adapter.decoder.layers] == [
        "McDenseLayer",
        "McMoELayer",
        "McDenseLayer",
        "McMoELayer",
    ]
    kwargs = dict(VARIANTS[variant])
    recompute = kwargs.pop("recompute", ())
    if kwargs.get("schedule") == "random":
        kwargs["schedule"] = node_schedule("dmdm")
    mbs = microbatches(padding=True)
    options = ScheduleOptions(free_input=adapter.schedule_options().free_input, recompute=recompute)
    got = combined_1f1b(adapter, mbs, options=options, **kwargs)
    want = megatron_step(ref, mbs)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert_bit_identical(model, ref)


@pytest.mark.parametrize(
    ("dtype", "tied", "final_norm"),
    [
        (torch.bfloat16, True, True),
        (torch.float32, False, False),  # the stock HybridStack, without a final norm
    ],
    ids=["bf16_tied", "stock_stack"],
)
def test_bfloat16_tied_and_the_stock_stack_are_bit_identical(
    dtype: torch.dtype, tied: bool, final_norm: bool
) -> None:
    model = build(dtype=dtype, tied=tied, final_norm=final_norm)
    ref = build(dtype=dtype, tied=tied, final_norm=final_norm)
    adapter = MegatronMoEAdapter(model)
    mbs = microbatches(4)
    got = combined_1f1b(adapter, mbs, options=adapter.schedule_options(), fill_drain=True)
    want = megatron_step(ref, mbs)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert_bit_identical(model, ref)


def test_the_plain_path_is_the_model_s_own_and_the_self_check_reports_the_glue() -> None:
    model, ref = build(), build()
    adapter = MegatronMoEAdapter(model)
    report = adapter.self_check_report
    assert report.glue == 0.0
    assert [names for _, names, _, _ in report.structures] == [
        ["decoder.layers.1", "decoder.layers.3"]
    ]
    assert all(p.grad is None for p in model.parameters())  # the self-check left .grad alone
    (mb,) = microbatches(1)
    assert mb.input_ids is not None
    logits = adapter.forward(mb.input_ids, mb.position_ids, mb.attention_mask)
    assert torch.equal(logits, ref(mb.input_ids, mb.position_ids, mb.attention_mask))
    assert MegatronMoEAdapter(build(), self_check=False).self_check_report.glue is None


@pytest.mark.parametrize("wrong", ["no_rotary", "no_final_norm"])
def test_the_self_check_catches_wrong_steps_around_the_decoder(
    monkeypatch: pytest.MonkeyPatch, wrong: str
) -> None:
    """Steps that leave out the rotary table or the final norm (probes of the check)."""
    from moe_overlap.adapters import _mc_hybrid

    where = "moe_overlap.adapters._mc_model."
    if wrong == "no_rotary":
        real = _mc_hybrid.preprocess
        monkeypatch.setattr(where + "preprocess", lambda *a, **k: (real(*a, **k)[0], None))
    else:
        monkeypatch.setattr(where + "final_norm", lambda decoder: None)
    with pytest.raises(ConfigError, match=r"HybridModel: the adapter's steps around the decoder"):
        MegatronMoEAdapter(build())
    MegatronMoEAdapter(build(), self_check=False)  # trains it anyway, unverified


def test_a_hybrid_model_whose_forward_changed_is_refused() -> None:
    """A release whose ``forward`` does more than the steps the adapter takes (here: scales
    the loss) is caught by the self-check, not followed silently."""
    hm: Any = importlib.import_module("megatron.core.models.hybrid.hybrid_model")

    class ChangedHybridModel(hm.HybridModel):  # type: ignore[misc]
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return super().forward(*args, **kwargs) * 1.5

    with pytest.raises(ConfigError, match=r"differs by .*HybridModel\.forward as in Megatron-Core"):
        MegatronMoEAdapter(build(model_class=ChangedHybridModel))


def test_layers_it_cannot_run_are_refused() -> None:
    with pytest.raises(
        ConfigError,
        match=r"HybridModel\.decoder\.layers\.0 \(MambaLayer, 'M' in hybrid_layer_pattern "
        r"'M\*E'\): expected an attention .*received a Mamba layer: .*mamba_ssm",
    ):
        MegatronMoEAdapter(build("M*E"))
    with pytest.raises(ConfigError, match=r"mtp_num_layers: expected None or 0"):
        MegatronMoEAdapter(build(mtp_num_layers=1))
    with pytest.raises(ConfigError, match=r"expected MoE layers .*received none"):
        MegatronMoEAdapter(build("*-", num_moe_experts=None, moe_ffn_hidden_size=None))


def test_a_changed_hybrid_model_is_refused_at_plan_build() -> None:
    model = build()
    adapter = MegatronMoEAdapter(model)
    layers: Any = model.get_submodule("decoder.layers")
    layers[2] = nn.Identity()
    with pytest.raises(ConfigError, match=r"decoder\.layers\.2: expected the layer the adapter"):
        combined_1f1b(adapter, microbatches(2), options=adapter.schedule_options())


def test_without_transformer_engine_the_stock_stack_builds_only_without_its_final_norm() -> None:
    """What the docs say of the stock ``HybridStack``: its final norm is Transformer Engine's
    ``TENorm``, so without Transformer Engine it builds only with ``post_layer_norm=False``."""
    te: Any = importlib.import_module("megatron.core.extensions.transformer_engine")
    if te.HAVE_TE:
        pytest.skip("Transformer Engine is installed")
    spec = stack_spec(final_norm=False)
    spec.params = {}
    hm: Any = importlib.import_module("megatron.core.models.hybrid.hybrid_model")
    tc: Any = importlib.import_module("megatron.core.transformer.transformer_config")
    config = tc.TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True
    )
    with pytest.raises(ImportError, match=r"Transformer Engine is not installed"):
        hm.HybridModel(
            config=config,
            hybrid_stack_spec=spec,
            vocab_size=VOCAB,
            max_sequence_length=SEQ,
            hybrid_layer_pattern="**",
        )


def test_a_chunk_without_pre_and_post_process_is_the_model_s_own() -> None:
    """A pipeline stage's chunk (hidden states in and out): the self-check of the steps
    around the decoder passes, and the plain path is the chunk's own forward."""
    model = build(pre_process=False, post_process=False)
    ref = build(pre_process=False, post_process=False)
    adapter = MegatronMoEAdapter(model)
    assert adapter.self_check_report.glue == 0.0
    g = torch.Generator().manual_seed(2)
    x = torch.randn(SEQ, BATCH, 32, generator=g)
    (mb,) = microbatches(1)
    got = adapter.plain_forward(x, mb.position_ids, attention_mask=mb.attention_mask)
    ref_any: Any = ref
    ref_any.set_input_tensor(x)
    want = ref(None, mb.position_ids, mb.attention_mask)
    assert torch.equal(got, want)
