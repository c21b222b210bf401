"""Train torchtitan's MoE models with the combined-1F1B overlap schedule.

This module (and only it) needs torchtitan (``pip install 'moe-overlap[torchtitan]'``, then
``pip install --no-deps torchtitan==0.3.0``: see ``docs/torchtitan.md``)::

    from torchtitan.models import deepseek_v3
    from moe_overlap import Microbatch, combined_1f1b
    from moe_overlap.adapters.torchtitan import TorchtitanMoEAdapter

    model = deepseek_v3.model_registry("debugmodel").model.build()
    model.init_states()
    adapter = TorchtitanMoEAdapter(model)
    losses = combined_1f1b(adapter, [Microbatch(input_ids=ids, position_ids=pos,
                                                labels=labels), ...],
                           options=adapter.schedule_options())
    optimizer.step()  # over model.parameters(); torchtitan's load-balancing hook as usual

How: nothing is re-implemented. The embedding, final norm and LM head are the model's
own ``forward`` run with its blocks stood in for; the attention masks are the model's own
``get_attention_masks(positions)`` (for flex and varlen attention, as torchtitan's trainer
builds them). A MoE block is cut into the schedule's four slots by running its own code:
the block's ``forward`` with its ``moe`` stood in for (attention, norms, residual), the
``MoE``'s ``forward`` with its ``routed_experts`` stood in for (router with expert bias,
score function and grouped routing; the load-balancing count ``tokens_per_expert_E``;
shared experts), then the block's own token dispatcher (``dispatch`` in the dispatch slot:
torchtitan's expert-parallel all-to-all when the model was parallelized with it), its
``inner_experts`` (mlp slot) and the dispatcher's ``combine``. Dense blocks run whole.

Self-check (``self_check=True``, the default): at construction each distinct block
structure is split on a float32 copy and compared with the block's own forward and
backward on a probe; a mismatch is a :class:`~moe_overlap.ConfigError` naming the block
and the difference.

Numerics: losses and gradients match the model's own forward and backward to float32
rounding (gradients meeting at a slot boundary are summed in another order), and
:func:`~moe_overlap.combined_1f1b` with and without overlap are bit-identical.

Pipelines: :class:`TorchtitanMoEStage` takes a chunk of torchtitan's own pipeline split
(``pipeline_llm``) as the module of its ``PipelineStage``; prepare the schedule with
:func:`~moe_overlap.integrations.pipelining.prepare_schedule`. DeepSeek-V3's
multi-token-prediction layers run whole in post-process (whole models only).

Not supported (refused at construction): models that are not torchtitan decoders,
wrappers, ``compile`` or hooks on the modules the slots split, FSDP, tensor and context
parallelism. Accepted: torchtitan's ``SelectiveAC`` / ``FullAC`` block wrappers (the slots
recompute with the wrapper's settings, per slot) and the forward wrappers torchtitan's
``parallelize`` sets where they do nothing (expert parallelism alone): see
``docs/torchtitan.md``.
"""

from __future__ import annotations

from moe_overlap.adapters._tt_layers import BlockCall as BlockCall
from moe_overlap.adapters._tt_layers import TitanDenseLayer as TitanDenseLayer
from moe_overlap.adapters._tt_layers import TitanLayer as TitanLayer
from moe_overlap.adapters._tt_layers import TitanMoELayer as TitanMoELayer
from moe_overlap.adapters._tt_model import LossFn as LossFn
from moe_overlap.adapters._tt_model import SelfCheckReport as SelfCheckReport
from moe_overlap.adapters._tt_model import TorchtitanMoEAdapter as TorchtitanMoEAdapter
from moe_overlap.adapters._tt_stage import TorchtitanMoEStage as TorchtitanMoEStage

__all__ = [
    "BlockCall",
    "LossFn",
    "SelfCheckReport",
    "TitanDenseLayer",
    "TitanLayer",
    "TitanMoELayer",
    "TorchtitanMoEAdapter",
    "TorchtitanMoEStage",
]
