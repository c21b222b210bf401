"""Protocols a model implements to be scheduled (the layer Protocol is in ``_layer_protocol``).

Keyword names mirror Megatron-Core 0.19's ``GPTModel`` so a Megatron model is
structurally a :class:`PreprocessableModel`; ``typing_tests/`` proves it against the stubs
in ``stubs/``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Protocol, runtime_checkable

from torch import Tensor
from torch.nn import Parameter

__all__ = [
    "DecoderLike",
    "LayerListLike",
    "ModelConfigLike",
    "PreprocessableModel",
    "WgradLayer",
    "missing_members",
]


@runtime_checkable
class WgradLayer(Protocol):
    """A module whose weight gradients are computed late, by :meth:`backward_dw`.

    :meth:`TransformerLayerNode.backward_dw <moe_overlap.TransformerLayerNode.backward_dw>`
    calls ``backward_dw()`` and then the ``post_wgrad_grad_acc_hook`` of each parameter
    that has one (collected once from ``parameters()``).
    """

    def backward_dw(self) -> None: ...
    def parameters(self) -> Iterator[Parameter]: ...


@runtime_checkable
class ModelConfigLike(Protocol):
    """The model configuration fields the pre/post-process nodes read."""

    @property
    def mtp_num_layers(self) -> int | None: ...


@runtime_checkable
class LayerListLike(Protocol):
    """``decoder.layers``: a sized iterable of layers (``torch.nn.ModuleList`` is one)."""

    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[object]: ...


@runtime_checkable
class DecoderLike(Protocol):
    """The decoder block: its layers, its pipeline input and its optional final norm."""

    @property
    def layers(self) -> LayerListLike: ...
    @property
    def input_tensor(self) -> Tensor | None: ...
    @property
    def final_layernorm(self) -> Callable[[Tensor], Tensor] | None: ...


@runtime_checkable
class PreprocessableModel(Protocol):
    """What :class:`~moe_overlap.PreProcessNode` and :class:`~moe_overlap.PostProcessNode` use.

    ``_preprocess`` returns the 6-tuple described by :class:`~moe_overlap.PreprocessOutput`
    (a plain tuple is accepted and checked). ``_postprocess`` returns the scalar loss when
    ``labels`` are given; the schedule calls it with ``mtp_in_postprocess=False``.
    """

    @property
    def pre_process(self) -> bool: ...
    @property
    def post_process(self) -> bool: ...
    @property
    def config(self) -> ModelConfigLike: ...
    @property
    def decoder(self) -> DecoderLike: ...

    def _preprocess(
        self,
        input_ids: Tensor | None,
        position_ids: Tensor | None,
        *,
        decoder_input: Tensor | None = None,
        packed_seq_params: object | None = None,
        padding_mask: Tensor | None = None,
    ) -> tuple[object, ...]: ...

    def _postprocess(
        self,
        hidden_states: Tensor,
        input_ids: Tensor | None,
        position_ids: Tensor | None,
        labels: Tensor | None,
        rotary_pos_emb: Tensor | None,
        rotary_pos_cos: Tensor | None,
        rotary_pos_sin: Tensor | None,
        *,
        mtp_in_postprocess: bool | None = None,
        loss_mask: Tensor | None = None,
        decoder_input: Tensor | None = None,
        attention_mask: Tensor | None = None,
        packed_seq_params: object | None = None,
        sequence_len_offset: Tensor | int | None = None,
        runtime_gather_output: bool | None = None,
        extra_block_kwargs: Mapping[str, object] | None = None,
        output_processor: Callable[..., object] | None = None,
        output_processor_context: object | None = None,
    ) -> Tensor: ...


def missing_members(obj: object, members: tuple[str, ...]) -> list[str]:
    """The ``members`` that ``obj`` lacks, looked up dynamically.

    ``isinstance`` against a runtime-checkable Protocol looks attributes up statically on
    Python 3.12+, so it misses ``torch.nn.Module`` submodules (kept in ``_modules`` and
    served by ``__getattr__``); integrations are checked with this instead.
    """
    return [m for m in members if not hasattr(obj, m)]
