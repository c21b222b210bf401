"""Megatron-Core's call forms: for code ported from Megatron-Core.

The engine works on its own typed shapes: a plan is built from ``(model, Microbatch)`` and
keywords, a layer node takes a :class:`~moe_overlap.LayerArgs`, the layer nodes consume a
:class:`~moe_overlap.PreprocessOutput` through the :class:`~moe_overlap.ChunkState`.
This module accepts Megatron-Core's shapes and converts them:

- :func:`build_schedule_plan`: ``build_schedule_plan(model, input_ids, position_ids,
  attention_mask, decoder_input=None, labels=None, packed_seq_params=None,
  extra_block_kwargs=None, runtime_gather_output=None, loss_mask=None, padding_mask=None,
  ...)``, a :class:`~moe_overlap.ModelChunkSchedulePlan`;
- :func:`microbatch`: the same positional inputs as a :class:`~moe_overlap.Microbatch`;
- :func:`layer_args`: a dict-shaped ``extra_args`` as a :class:`~moe_overlap.LayerArgs`
  (an unknown key is a :class:`~moe_overlap.ConfigError`);
  :class:`~moe_overlap.TransformerLayerNode` takes either;
- :func:`layer_schedule_plan`: ``TransformerLayerSchedulePlan(layer, event, chunk_state,
  comp_stream, comm_stream, extra_args)``.

Megatron-Core's ``ModelChunkState`` attribute bag has no counterpart: the typed
:class:`~moe_overlap.ChunkState` reads the same names.
"""

from moe_overlap.engine._megatron import build_schedule_plan as build_schedule_plan
from moe_overlap.engine._megatron import layer_args as layer_args
from moe_overlap.engine._megatron import layer_schedule_plan as layer_schedule_plan
from moe_overlap.engine._megatron import microbatch as microbatch

__all__ = ["build_schedule_plan", "layer_args", "layer_schedule_plan", "microbatch"]
