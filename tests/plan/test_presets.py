"""The planner's presets, field by field: every model and machine preset has the values
(and value types) it had when the presets were built in code, and the same refusals."""

from __future__ import annotations

import dataclasses
import re

import pytest

from moe_overlap.plan._machine import MACHINES, Machine
from moe_overlap.plan._model import PRESETS, ModelSpec
from tests.debug_mode import refusal

_MODEL_FIELDS = (
    "name",
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_kv_heads",
    "head_dim",
    "ffn_hidden_size",
    "moe_ffn_hidden_size",
    "num_experts",
    "top_k",
    "shared_experts",
    "first_k_dense",
    "moe_layer_freq",
    "vocab_size",
    "seq_len",
    "micro_batch_size",
    "dtype_bytes",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
)

# Each preset at seq_len=4096, micro_batch_size=1, in _MODEL_FIELDS' order.
# fmt: off
_MODELS = {
    "deepseek-v3-671b": ("deepseek-v3-671b", 61, 7168, 128, None, None, 18432, 2048, 256, 8,
                         1, 3, 1, 129280, 4096, 1, 2, 1536, 512, 64, 128, 128),
    "deepseek-v2-lite": ("deepseek-v2-lite", 27, 2048, 16, None, None, 10944, 1408, 64, 6,
                         2, 1, 1, 102400, 4096, 1, 2, None, 512, 64, 128, 128),
    "qwen3-235b-a22b": ("qwen3-235b-a22b", 94, 4096, 64, 4, 128, 12288, 1536, 128, 8,
                        0, 0, 1, 151936, 4096, 1, 2, None, None, None, None, None),
    "qwen3-30b-a3b": ("qwen3-30b-a3b", 48, 2048, 32, 4, 128, 6144, 768, 128, 8,
                      0, 0, 1, 151936, 4096, 1, 2, None, None, None, None, None),
    "mixtral-8x7b": ("mixtral-8x7b", 32, 4096, 32, 8, None, 14336, 14336, 8, 2,
                     0, 0, 1, 32000, 4096, 1, 2, None, None, None, None, None),
}
# fmt: on

_NVLINK = {"name": "nvlink", "alpha_us": 3.0, "beta_GBps": 450.0}
_IB = {"name": "infiniband-400g", "alpha_us": 8.0, "beta_GBps": 50.0}
_MACHINES = {
    "h100": {
        "name": "h100",
        "peak_tflops": 989.0,
        "mfu": 0.6,
        "hbm_GBps": 3350.0,
        "hbm_GB": 80.0,
        "gpus_per_node": 8,
        "nvlink": _NVLINK,
        "network": _IB,
    },
    "h200": {
        "name": "h200",
        "peak_tflops": 989.0,
        "mfu": 0.6,
        "hbm_GBps": 4800.0,
        "hbm_GB": 141.0,
        "gpus_per_node": 8,
        "nvlink": _NVLINK,
        "network": _IB,
    },
    "h800": {
        "name": "h800",
        "peak_tflops": 989.0,
        "mfu": 0.6,
        "hbm_GBps": 3350.0,
        "hbm_GB": 80.0,
        "gpus_per_node": 8,
        "nvlink": {**_NVLINK, "beta_GBps": 200.0},
        "network": _IB,
    },
}


def _typed(value: object) -> object:
    """``value`` with the type of each leaf beside it (``989`` and ``989.0`` differ)."""
    if isinstance(value, dict):
        return {k: _typed(v) for k, v in value.items()}
    return (type(value).__name__, value)


def test_model_presets_keep_their_names_order_and_every_field() -> None:
    assert tuple(_MODELS) == PRESETS
    assert tuple(f.name for f in dataclasses.fields(ModelSpec)) == _MODEL_FIELDS
    for name, values in _MODELS.items():
        got = dataclasses.asdict(ModelSpec.preset(name))
        assert _typed(got) == _typed(dict(zip(_MODEL_FIELDS, values, strict=True))), name


def test_model_presets_take_the_microbatch_shape() -> None:
    spec = ModelSpec.preset("qwen3-30b-a3b", seq_len=128, micro_batch_size=3)
    assert (spec.seq_len, spec.micro_batch_size) == (128, 3)
    assert dataclasses.replace(spec, seq_len=4096, micro_batch_size=1) == ModelSpec.preset(
        "qwen3-30b-a3b"
    )


def test_machine_presets_keep_their_names_order_and_every_field() -> None:
    assert tuple(_MACHINES) == MACHINES
    for name, fields in _MACHINES.items():
        assert _typed(dataclasses.asdict(Machine.preset(name))) == _typed(fields), name


@pytest.mark.parametrize(
    ("make", "message", "hinted"),
    [
        (
            lambda: ModelSpec.preset("gpt-5"),
            "ModelSpec.preset: name must be one of ['deepseek-v3-671b', 'deepseek-v2-lite', "
            "'qwen3-235b-a22b', 'qwen3-30b-a3b', 'mixtral-8x7b'], received str 'gpt-5'; "
            "or build a ModelSpec",
            None,
        ),
        (
            lambda: ModelSpec.preset(3),  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
            "ModelSpec.preset: name must be one of ['deepseek-v3-671b', 'deepseek-v2-lite', "
            "'qwen3-235b-a22b', 'qwen3-30b-a3b', 'mixtral-8x7b'], received int 3; "
            "or build a ModelSpec",
            "name",
        ),
        (
            lambda: ModelSpec.preset("mixtral-8x7b", seq_len=0),
            "ModelSpec.seq_len: expected an int >= 1, received int 0",
            None,
        ),
        (
            lambda: ModelSpec.preset("mixtral-8x7b", micro_batch_size="2"),  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
            "ModelSpec.micro_batch_size: expected an int >= 1, received str '2'",
            "micro_batch_size",
        ),
        (
            lambda: Machine.preset("b200"),
            "Machine.preset: name must be one of ['h100', 'h200', 'h800'], received str "
            "'b200'; or build a Machine",
            None,
        ),
    ],
)
def test_presets_refuse_as_before(make: object, message: str, hinted: str | None) -> None:
    """The exact message; in debug mode a value of the wrong type meets beartype first."""
    assert callable(make)
    with refusal(rf"\A{re.escape(message)}\Z", hinted=hinted):
        make()
