"""Adapters that make third-party models schedulable by :func:`~moe_overlap.combined_1f1b`.

Each adapter lives in its own submodule and imports its library only there, so
``import moe_overlap`` (and ``import moe_overlap.adapters``) never imports it:

- :mod:`moe_overlap.adapters.transformers`: Hugging Face transformers 5 MoE causal LMs
  (Mixtral, Qwen2-MoE and the families sharing their structure).
"""

__all__: list[str] = []
