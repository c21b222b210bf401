"""torchtitan models for the tests: built by torchtitan's own registries, tiny, on CPU.

PyTorch's FlexAttention has no backward on CPU, so :func:`causal_stand_in` replaces each
block's ``inner_attention`` by :class:`CausalAttention`, a test-only stand-in that
``test_torchtitan.py`` compares with flex in forward on the same inputs. On the GPU the
tests keep torchtitan's real flex attention.

The registry's debug flavours are cut to three layers and, where their experts are large
for a CPU test (Qwen3's 64 experts, gpt-oss's 2880-wide ones), to fewer and narrower
experts (:data:`TINY_MOE`): the same modules and code paths, smaller tensors.

A model with the stand-in still builds its masks (``get_attention_masks``), which the
stand-in does not read; it builds them without ``torch.compile`` (:func:`eager_block_masks`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
from torch import Tensor, nn

titan = __import__("pytest").importorskip("torchtitan")

# torchtitan's model registries and the small flavours the tests build.
FAMILIES: dict[str, tuple[str, str]] = {
    "deepseek_v3": ("torchtitan.models.deepseek_v3", "debugmodel"),
    "qwen3": ("torchtitan.models.qwen3", "debugmodel_moe"),
    "gpt_oss": ("torchtitan.models.gpt_oss", "debugmodel"),
    "kimi_k2_7": ("torchtitan.models.kimi_k2_7", "debugmodel"),
}


# Per family: the MoE config fields rewritten for a small CPU test (every ``num_experts``
# and ``top_k`` in the MoE's config, the router gate's width, the experts' ``hidden_dim``).
TINY_MOE: dict[str, dict[str, int]] = {
    "qwen3": {"num_experts": 8, "top_k": 2, "hidden_dim": 64},
    "gpt_oss": {"hidden_dim": 64},
}


def _rewrite_moe(config: Any, fields: dict[str, int]) -> Any:
    """``config`` (a MoE config or one of its parts) with ``fields`` replaced at every
    depth; the router gate's ``out_features`` follows ``num_experts``."""
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        return config
    changes: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        if not f.init:
            continue
        value = getattr(config, f.name)
        if f.name in fields:
            changes[f.name] = fields[f.name]
        elif f.name == "gate" and "num_experts" in fields:
            changes[f.name] = dataclasses.replace(value, out_features=fields["num_experts"])
        elif dataclasses.is_dataclass(value):
            changes[f.name] = _rewrite_moe(value, fields)
    return dataclasses.replace(config, **changes)


def shrink(config: Any, *, layers: int = 3, moe: dict[str, int] | None = None) -> Any:
    """The registry's config with fewer layers (the first dense one kept where it is) and
    the MoE fields in ``moe`` rewritten (:func:`_rewrite_moe`)."""
    kept = list(config.layers[:layers])
    if moe:
        kept = [
            layer
            if layer.moe is None
            else dataclasses.replace(layer, moe=_rewrite_moe(layer.moe, moe))
            for layer in kept
        ]
    return dataclasses.replace(config, layers=kept)


def build(
    family: str, *, layers: int = 3, seed: int = 0, tiny: bool = True, **registry: object
) -> nn.Module:
    """``family``'s test flavour from torchtitan's registry (with ``tiny``, its experts cut
    as :data:`TINY_MOE` says), states initialised, float32."""
    import importlib

    module, flavor = FAMILIES[family]
    if family == "gpt_oss":  # its registry defaults to varlen attention (CUDA only)
        registry = {"attn_backend": "flex", **registry}
    spec = importlib.import_module(module).model_registry(flavor, **registry)
    config = shrink(spec.model, layers=layers, moe=TINY_MOE.get(family) if tiny else None)
    torch.manual_seed(seed)
    model: Any = config.build()
    model.init_states(buffer_device=torch.device("cpu"))
    return cast(nn.Module, model)


class CausalAttention(nn.Module):
    """Test-only stand-in for torchtitan's ``FlexAttention`` on CPU (which has no flex
    backward): causal softmax attention in plain torch ops, with flex's call signature,
    GQA and its ``out_transform(out, lse)`` hook. Equal to flex for one document per row
    (positions ``0..L-1``), which is what the tests feed; :func:`check_stand_in` compares."""

    def forward(
        self,
        q_BLNH: Tensor,
        k_BLNH: Tensor,
        v_BLNH: Tensor,
        *,
        attention_masks: object = None,
        scale: float | None = None,
        enable_gqa: bool = False,
        out_transform: Callable[[Tensor, Tensor], Tensor] | None = None,
        **kwargs: object,
    ) -> Tensor:
        del attention_masks, kwargs
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        if enable_gqa and k.shape[1] != q.shape[1]:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        s = scale if scale is not None else q.shape[-1] ** -0.5
        scores = (q @ k.transpose(-2, -1)) * s
        L = q.shape[2]
        causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        lse = torch.logsumexp(scores.float(), dim=-1)
        out = (torch.softmax(scores.float(), dim=-1).to(v.dtype) @ v).transpose(1, 2)
        if out_transform is None:
            return out
        return out_transform(out, lse.transpose(1, 2))


def causal_stand_in(model: nn.Module) -> nn.Module:
    """Each FlexAttention in ``model`` replaced by :class:`CausalAttention`; the model's
    ``get_attention_masks`` (its own, called by the adapter and by the model's forward)
    builds the masks eagerly (:func:`eager_block_masks`: they are the same, and the
    stand-in reads none). That is an instance attribute: copies of the model keep it."""
    from torchtitan.models.common.attention import FlexAttention

    for name, module in list(model.named_modules()):
        if isinstance(module, FlexAttention):
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, CausalAttention())
    if callable(getattr(type(model), "get_attention_masks", None)):
        eager = types.MethodType(_eager_attention_masks, model)
        setattr(model, "get_attention_masks", eager)  # noqa: B010 - shadows the method
    return model


def _eager_attention_masks(self: nn.Module, positions: Tensor) -> object:
    """The model class's ``get_attention_masks``, inside :func:`eager_block_masks`."""
    with eager_block_masks():
        return cast(Any, type(self)).get_attention_masks(self, positions)


@contextlib.contextmanager
def eager_block_masks() -> Iterator[None]:
    """Inside, torchtitan's ``create_attention_mask`` (what ``get_attention_masks`` calls for
    flex attention) runs torch's ``create_block_mask`` as it is, not ``torch.compile``'d:
    the same ``BlockMask`` (``test_torchtitan.py`` compares), without a dynamo trace per
    process and per new batch shape (seconds of CPU each; more with a cold inductor
    cache). Put back after."""
    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.models.common import attention

    compiled = attention._compiled_create_block_mask
    attention._compiled_create_block_mask = create_block_mask
    try:
        yield
    finally:
        attention._compiled_create_block_mask = compiled


def batch(
    model: nn.Module, n: int, *, b: int = 2, s: int = 16, seed: int = 1
) -> list[dict[str, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    vocab = int(cast(Any, model).config.vocab_size)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (b, s + 1), generator=g)
        out.append(
            {
                "input_ids": ids[:, :-1].contiguous(),
                "labels": ids[:, 1:].contiguous(),
                "position_ids": torch.arange(s).expand(b, s).contiguous(),
            }
        )
    return out
