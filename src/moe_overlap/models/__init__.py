"""A small GPT-style MoE reference model that integrates through the public Protocols only.

:class:`GPTMoEModel` is a :class:`~moe_overlap.PreprocessableModel` whose layers are
:class:`~moe_overlap.SchedulableLayer` s; its ``forward`` is the plain (unscheduled) path
used as the bit-exact reference for :func:`~moe_overlap.combined_1f1b`. Its delayed-wgrad
linears and model hooks are :mod:`moe_overlap.blocks`.
"""

from moe_overlap.models._config import GPTMoEConfig as GPTMoEConfig
from moe_overlap.models._gpt import Decoder as Decoder
from moe_overlap.models._gpt import GPTMoEModel as GPTMoEModel
from moe_overlap.models._gpt import masked_cross_entropy as masked_cross_entropy
from moe_overlap.models._layers import DenseLayer as DenseLayer
from moe_overlap.models._layers import GPTLayer as GPTLayer
from moe_overlap.models._layers import MoELayer as MoELayer
from moe_overlap.models._stage import GPTMoEStage as GPTMoEStage

__all__ = [
    "Decoder",
    "DenseLayer",
    "GPTLayer",
    "GPTMoEConfig",
    "GPTMoEModel",
    "GPTMoEStage",
    "MoELayer",
    "masked_cross_entropy",
]
