"""Megatron-Core 0.19 transformer package (partial stub; see stubs/README.md)."""

from megatron.core.transformer.module import MegatronModule as MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig as TransformerConfig
