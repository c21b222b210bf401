# pyright: reportMissingModuleSource=false
# (Megatron is not installed: only the stubs in stubs/ exist, which is the point.)
"""Megatron-Core 0.19 against the Protocols, through the stubs in ``stubs/megatron``.

``TransformerConfig`` is a ``FreeInputConfig`` and a model config, ``TransformerBlock`` a
decoder, and Megatron's int-valued ``CudaGraphModule`` works with ``should_free_input``.

``GPTModel`` is a ``PreprocessableModel``: its ``_preprocess`` / ``_postprocess`` keyword
names and types fit the Protocol (``packed_seq_params`` is ``Any`` there, since the schedule
only passes it through; ``sequence_len_offset`` is ``Tensor | None`` as in Megatron).
"""

from __future__ import annotations

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import CudaGraphModule as MegatronCudaGraphModule
from megatron.core.transformer.transformer_block import TransformerBlock

from moe_overlap import PreprocessableModel, should_free_input
from moe_overlap.protocols import DecoderLike, FreeInputConfig, ModelConfigLike


def megatron_config(config: TransformerConfig) -> tuple[FreeInputConfig, ModelConfigLike]:
    """``TransformerConfig`` is both configs the library reads."""
    return config, config


def megatron_graph_modules(config: TransformerConfig) -> bool:
    """Megatron's own (int-valued) enum members are judged by name."""
    config.cuda_graph_modules = [MegatronCudaGraphModule.moe_preprocess]
    return should_free_input("moe_dispatch", True, config, 4)


def megatron_decoder(decoder: TransformerBlock) -> DecoderLike:
    """``TransformerBlock``: layers, pipeline input tensor, optional final norm."""
    return decoder


def megatron_model(model: GPTModel) -> PreprocessableModel:
    """A Megatron ``GPTModel`` is structurally a ``PreprocessableModel``."""
    return model
