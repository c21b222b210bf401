"""Train Megatron-Core's MoE models with the combined-1F1B overlap schedule.

This module (and only it) needs Megatron-Core (``pip install 'moe-overlap[megatron]'``,
then ``pip install --no-deps --ignore-requires-python megatron-core==0.19.2``: see
``docs/megatron.md``)::

    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from moe_overlap import Microbatch, combined_1f1b
    from moe_overlap.adapters.megatron import MegatronMoEAdapter

    # Megatron-Core's parallel state initialised, as for any Megatron-Core model
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(
        num_experts=8, moe_grouped_gemm=False), vocab_size=..., max_sequence_length=...)
    adapter = MegatronMoEAdapter(model)
    losses = combined_1f1b(adapter, [Microbatch(input_ids=ids, position_ids=pos,
                                                attention_mask=mask, labels=labels), ...],
                           options=adapter.schedule_options())
    optimizer.step()  # over model.parameters()

``HybridModel`` (``GPTModel``'s successor) is taken the same way: attention (``'*'``,
``'+'``), MLP (``'-'``) and MoE (``'E'``) layers of its ``hybrid_layer_pattern``, built
with Megatron-Core's local modules (or Transformer Engine's where it is installed).

How: nothing is re-implemented. The embedding and rotary tables are the model's own
``_preprocess``; the final norm, output layer and per-token loss its own ``_postprocess``
(the adapter's ``loss_fn`` reduces the per-token loss: by default the mean over the
tokens ``loss_mask`` keeps). ``HybridModel`` has no such methods: the adapter takes the
steps its ``forward`` takes around its decoder, on its own modules and methods (embedding,
``rotary_pos_emb``, the decoder's ``final_norm``, ``output_layer``, ``_scale_logits``,
``compute_language_model_loss``). A MoE layer is cut into the schedule's four slots where
Megatron-Core's own fine-grained schedule cuts it, on the layer's and its ``MoELayer``'s
own methods: attention, pre-MLP norm, shared experts, router and the dispatcher's
preprocess (pre-dispatch); the dispatcher's all-to-all (dispatch: expert parallelism
through the model's own token dispatcher); the routed experts (mlp); the all-to-all back,
unpermute, shared experts' sum and residual add (combine). Other layers run whole. The
dispatcher's per-call routing state is kept per layer and microbatch, so any number of
microbatches may be in flight.

Self-check (``self_check=True``, the default): at construction each distinct layer
structure is split on a copy and compared with the layer's own forward and backward on a
probe; a mismatch is a :class:`~moe_overlap.ConfigError` naming the layer and the
difference. For a ``HybridModel`` the steps around the decoder are compared with the
model's own ``forward`` too (on a probe sharing its weights, with a copy of one layer), so
a Megatron-Core release whose ``forward`` takes other steps is refused, not followed. At every plan build a changed model (a layer, MoE, router or experts added,
removed or replaced) is refused.

Numerics: losses and gradients are bit-identical to the model's own forward and backward
wherever the kernels are deterministic (CPU; CUDA with deterministic algorithms), serial,
overlapped, with fill and drain, with recomputed slots and under any exact node schedule.

Pipelines: :class:`MegatronMoEStage` takes a ``GPTModel`` built for one pipeline stage
(``pre_process`` / ``post_process`` as Megatron-Core builds them) as the module of torch's
``PipelineStage``; prepare the schedule with
:func:`~moe_overlap.integrations.pipelining.prepare_schedule`.

Not supported (refused at construction, naming the setting): tensor, sequence and context
parallelism; dropout; Megatron-Core's own recomputation, CUDA graphs, FP8/FP4, shared
expert overlap, delayed weight gradients and activation offloading; the flex dispatcher;
multi-token prediction; layers other than ``TransformerLayer``; a ``HybridModel``'s
Mamba (``'M'``), gated delta net (``'G'``) and sparse attention (``'D'``) layers.
"""

from __future__ import annotations

from moe_overlap.adapters._mc_layers import McDenseLayer as McDenseLayer
from moe_overlap.adapters._mc_layers import McLayer as McLayer
from moe_overlap.adapters._mc_layers import McMoELayer as McMoELayer
from moe_overlap.adapters._mc_model import LossFn as LossFn
from moe_overlap.adapters._mc_model import MegatronMoEAdapter as MegatronMoEAdapter
from moe_overlap.adapters._mc_model import SelfCheckReport as SelfCheckReport
from moe_overlap.adapters._mc_model import masked_mean as masked_mean
from moe_overlap.adapters._mc_stage import MegatronMoEStage as MegatronMoEStage

__all__ = [
    "LossFn",
    "McDenseLayer",
    "McLayer",
    "McMoELayer",
    "MegatronMoEAdapter",
    "MegatronMoEStage",
    "SelfCheckReport",
    "masked_mean",
]
