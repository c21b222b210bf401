"""Megatron's module base class."""

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

class MegatronModule(torch.nn.Module):
    """A ``torch.nn.Module`` that carries its ``TransformerConfig``."""

    config: TransformerConfig
    def __init__(self, config: TransformerConfig) -> None: ...
