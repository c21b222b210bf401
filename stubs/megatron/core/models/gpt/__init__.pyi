"""Megatron-Core 0.19 GPT models (partial stub; see stubs/README.md)."""

from megatron.core.models.gpt.gpt_model import GPTModel as GPTModel
