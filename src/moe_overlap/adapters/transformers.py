"""Train Hugging Face transformers 5 MoE causal LMs with the combined-1F1B overlap schedule.

This module (and only it) needs ``transformers`` (``pip install 'moe-overlap[transformers]'``)::

    from transformers import MixtralConfig, MixtralForCausalLM
    from moe_overlap import Microbatch, combined_1f1b
    from moe_overlap.adapters.transformers import TransformersMoEAdapter

    model = MixtralForCausalLM(MixtralConfig(...))
    adapter = TransformersMoEAdapter(model, ep_group=None, delay_wgrad_compute=True)
    losses = combined_1f1b(adapter, [Microbatch(input_ids=ids, labels=ids), ...],
                           options=adapter.schedule_options())
    optimizer.step()  # over model.parameters()

Supported: the structure Mixtral and Qwen2-MoE share in transformers 5 (and families built
like them, e.g. Qwen3-MoE, OLMoE): ``model.{embed_tokens, layers, norm, rotary_emb}``,
``lm_head``, ``loss_function``; layers with ``input_layernorm``, ``self_attn``,
``post_attention_layernorm`` and an ``mlp`` that is either dense or a sparse block with a
top-k ``gate`` and ``experts`` on fused 3-D ``gate_up_proj`` / ``down_proj`` weights,
optionally a gated ``shared_expert`` (Qwen2-MoE). Dense layers (``mlp_only_layers``,
``decoder_sparse_step``) are scheduled as dense slots. Attention runs through the model's
own ``self_attn`` (any ``attn_implementation``) with the masks transformers builds.

Numerics: the adapter computes the same operations as the model's ``forward`` except the
routed experts (grouped by expert, summed over top-k in a different order), so losses and
gradients match transformers to float32 rounding (about 1e-6 relative), and
:func:`~moe_overlap.combined_1f1b` with and without overlap are bit-identical.

Not supported: KV caches / generation (use the model itself), packed sequences,
``router_jitter_noise > 0``, experts with bias or transposed/interleaved weights.
"""

from __future__ import annotations

from moe_overlap.adapters._hf_ep import expert_parameter_names as expert_parameter_names
from moe_overlap.adapters._hf_ep import gather_experts as gather_experts
from moe_overlap.adapters._hf_ep import shard_experts as shard_experts
from moe_overlap.adapters._hf_experts import DelayedLinear as DelayedLinear
from moe_overlap.adapters._hf_layers import HFDenseLayer as HFDenseLayer
from moe_overlap.adapters._hf_layers import HFLayer as HFLayer
from moe_overlap.adapters._hf_layers import HFMoELayer as HFMoELayer
from moe_overlap.adapters._hf_model import AdapterConfig as AdapterConfig
from moe_overlap.adapters._hf_model import TransformersMoEAdapter as TransformersMoEAdapter

__all__ = [
    "AdapterConfig",
    "DelayedLinear",
    "HFDenseLayer",
    "HFLayer",
    "HFMoELayer",
    "TransformersMoEAdapter",
    "expert_parameter_names",
    "gather_experts",
    "shard_experts",
]
