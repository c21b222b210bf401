"""The decoder block: a stack of transformer layers and an optional final norm."""

import torch
from megatron.core.transformer.module import MegatronModule
from torch import Tensor

class TransformerBlock(MegatronModule):
    """The layers this pipeline stage holds, its pipeline input and its final norm."""

    layers: torch.nn.ModuleList
    """This stage's layers; empty on a stage that holds none."""
    input_tensor: Tensor | None
    """The activation received from the previous pipeline stage (``set_input_tensor``)."""
    final_layernorm: torch.nn.Module | None
    """The final norm, or ``None`` on stages without one."""
    pre_process: bool
    post_process: bool
    def set_input_tensor(self, input_tensor: Tensor) -> None: ...
