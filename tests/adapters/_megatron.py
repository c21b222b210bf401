"""What the Megatron-Core tests share: the tiny ``GPTModel`` (its sizes, its configuration,
built on Megatron-Core's local layer spec), causally masked microbatches, the model's own
training step on them (the reference) and the bit-for-bit comparison of the gradients."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from moe_overlap import Microbatch

SEQ, BATCH, VOCAB, MICROBATCHES = 8, 2, 64, 3

TINY: dict[str, Any] = {
    "num_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "ffn_hidden_size": 48,
    "num_moe_experts": 4,
    "moe_router_topk": 2,
    "moe_ffn_hidden_size": 40,
    "moe_token_dispatcher_type": "alltoall",
    "use_cpu_initialization": True,
    "add_bias_linear": False,
    "hidden_dropout": 0.0,
    "attention_dropout": 0.0,
}
"""The tiny model's ``TransformerConfig`` arguments: two MoE layers (4 experts, top 2,
all-to-all dispatcher), no biases, no dropout."""


def tiny_config(**changes: Any) -> Any:
    """Megatron-Core's ``TransformerConfig`` of :data:`TINY` with ``changes``."""
    tc: Any = importlib.import_module("megatron.core.transformer.transformer_config")
    return tc.TransformerConfig(**(TINY | changes))


def local_gpt(config: Any, **kwargs: Any) -> nn.Module:
    """A ``GPTModel`` of ``config`` on Megatron-Core's local layer spec (no grouped GEMM),
    :data:`VOCAB` tokens, :data:`SEQ` positions, rotary embeddings; ``kwargs`` to the
    model (``pre_process``, ``share_embeddings_and_output_weights``, another
    ``transformer_layer_spec``, ...)."""
    specs: Any = importlib.import_module("megatron.core.models.gpt.gpt_layer_specs")
    gpt: Any = importlib.import_module("megatron.core.models.gpt.gpt_model")
    spec = kwargs.pop("transformer_layer_spec", None) or specs.get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts, moe_grouped_gemm=False
    )
    model: nn.Module = gpt.GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
        **kwargs,
    )
    return model


def microbatches(
    n: int = MICROBATCHES, *, loss_mask: bool = False, padding: bool = False
) -> list[Microbatch]:
    """``n`` microbatches, causally masked; with ``loss_mask`` random token weights, with
    ``padding`` each sequence's last two tokens marked as padding (left out of routing)."""
    g = torch.Generator().manual_seed(1)
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1).expand(BATCH, 1, SEQ, SEQ)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        mask = (torch.rand(BATCH, SEQ, generator=g) > 0.3).float() if loss_mask else None
        pad = torch.arange(SEQ).expand(BATCH, SEQ) >= SEQ - 2 if padding else None
        out.append(
            Microbatch(
                input_ids=ids,
                position_ids=torch.arange(SEQ).expand(BATCH, SEQ),
                attention_mask=causal,
                labels=ids.roll(-1, 1),
                loss_mask=mask,
                padding_mask=pad,
            )
        )
    return out


def megatron_step(model: nn.Module, mbs: Sequence[Microbatch]) -> list[Tensor]:
    """The model's own forward (per-token loss) and backward, per microbatch, with the
    adapter's default loss (the mean over the tokens the loss mask keeps)."""
    losses = []
    for mb in mbs:
        per_token = model(
            mb.input_ids,
            mb.position_ids,
            mb.attention_mask,
            labels=mb.labels,
            padding_mask=mb.padding_mask,
        )
        mask = torch.ones_like(per_token) if mb.loss_mask is None else mb.loss_mask
        loss = (per_token.float() * mask.float()).sum() / mask.float().sum()
        loss.backward()
        losses.append(loss.detach())
    return losses


def assert_bit_identical(got: nn.Module, want: nn.Module) -> None:
    """Every gradient, and the routers' expert-bias token counts, bit for bit."""
    want_buffers = dict(want.named_buffers())
    for name, b in got.named_buffers():
        if name.endswith("local_tokens_per_expert"):
            assert torch.equal(b, want_buffers[name]), f"{name}: {b} vs {want_buffers[name]}"
    want_grads = dict(want.named_parameters())
    differ = []
    for name, p in got.named_parameters():
        q = want_grads[name]
        assert p.grad is not None and q.grad is not None, f"{name}: no gradient"
        if not torch.equal(p.grad, q.grad):
            differ.append(f"{name} ({float((p.grad - q.grad).abs().max()):.3g})")
    assert not differ, f"gradients not bit-identical: {', '.join(differ)}"


def node_schedule(kinds: str) -> Any:
    """A random exact node schedule for layers of ``kinds`` (``d`` dense, ``m`` MoE)."""
    from tests.engine.test_node_schedule import _shape, random_order

    return random_order(_shape(kinds), MICROBATCHES, seed=3, in_flight=3)
