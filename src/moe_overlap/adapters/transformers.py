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

How: nothing is re-implemented. Outside the decoder layers the adapter runs the model's
own ``forward`` with the layers stood in for (embedding and its scaling, masks per attention
kind, rotary tables of any form; final norm, LM head, logit scaling, the model's loss). A
MoE layer is cut into slots from one traced run of its own ``forward``: its own attention,
norms (pre, post and sandwich), residual multiplier or parallel residual, the MoE block's
own ``forward`` (router, correction bias, group-limited top-k, routed scaling, shared
experts and their gates, as the family defines them) with the routed experts stood in
for, and the experts module itself on the dispatched rows (any activation, biases,
transposed or interleaved weights). Dense layers run their own ``forward`` whole.

Self-check (``self_check=True``, the default): at construction, each distinct layer
structure is split on a float32 copy and compared with the layer's own ``forward`` on a
probe (outputs, input and parameter gradients); a mismatch beyond float32 rounding is a
:class:`~moe_overlap.ConfigError` naming the layer class and the difference, so a family
the adapter cannot split is refused, never silently mistrained. ``docs/families.md`` lists
every MoE family of the pinned transformers and what the adapter does with it.

Numerics: losses and gradients match the model's ``forward`` to float32 rounding (the
routed experts' outputs are summed in another order), and
:func:`~moe_overlap.combined_1f1b` with and without overlap are bit-identical.

What the split hands on is decided by structure (the autograd graph of the block's output,
which child's output another takes), never by weight values: zero-initialised shared
experts or routers train. Modules whose forward draws random numbers that change their
output (dropout, router jitter, sampling) are accepted in eval mode and refused in
training mode (at construction and at every plan build). The load-balancing loss is found
by running the model's forward, not by reading its source.

Not supported (refused at construction): layers that are not softmax attention (linear
attention, Mamba, convolutions), layers that hand state to the next layer or several
residual streams per token, random modules in training mode, blocks whose routed output
is not a constant multiple of the experts' plus the rest (a gate after the experts). Also
not: KV caches / generation (use the model itself), packed sequences.
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
from moe_overlap.adapters._hf_stage import ModelScope as ModelScope
from moe_overlap.adapters._hf_stage import TransformersMoEStage as TransformersMoEStage

__all__ = [
    "AdapterConfig",
    "DelayedLinear",
    "HFDenseLayer",
    "HFLayer",
    "HFMoELayer",
    "ModelScope",
    "TransformersMoEAdapter",
    "TransformersMoEStage",
    "expert_parameter_names",
    "gather_experts",
    "shard_experts",
]
