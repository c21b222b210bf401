"""One microbatch's inputs: the value a chunk plan is built from.

:class:`Microbatch` is defined here (pickles name ``moe_overlap.microbatch.Microbatch``)
and is also at the top level, :class:`moe_overlap.Microbatch`. At import this module loads
nothing of the package but :mod:`moe_overlap.args` and :mod:`moe_overlap.errors`, so the
schedule core (``engine/core``) imports it.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from moe_overlap.args import ANY, BOOL, TENSOR, Instance, Opt, Spec, check_fields
from moe_overlap.errors import ConfigError

__all__ = ["Microbatch"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Microbatch:
    """One microbatch's inputs, by the names of Megatron-Core's ``build_schedule_plan``.

    ``B`` batch, ``S`` sequence. A field is *set* when it is not ``None``. Each model reads
    the fields it declares in ``microbatch_inputs`` (:class:`~moe_overlap.inputs.DeclaresInputs`;
    :data:`~moe_overlap.inputs.DEFAULT_INPUTS` without a declaration): a set field it does not
    read is a :class:`~moe_overlap.ConfigError` naming the field and the model when the
    plan is built (:func:`~moe_overlap.inputs.check_inputs`), never silently ignored. What a field
    means is the model's; Megatron-Core's conventions, which the reference model
    (:mod:`moe_overlap.models`) follows and checks (dtype and shape, ``ConfigError``
    naming the field), are:

    Attributes:
        input_ids: token ids ``[B, S]`` (int64); the first pipeline stage's input.
        position_ids: positions ``[B, S]`` (int64); ``None``: ``0 .. S-1`` per row.
        attention_mask: bool ``[B or 1, 1, S or 1, S]``, ``True`` where a query (dim 2)
            must not attend a key (dim 3); applied on top of the causal mask. The
            transformers adapter takes transformers' own instead (``[B, S]``, ``1`` at
            tokens to attend).
        labels: target ids ``[B, S]`` (int64); with them ``_postprocess`` returns the loss.
        loss_mask: ``[B, S]`` weights of each position in the language-model loss (float
            or bool; ``0`` drops a position); ``None``: every position counts.
        decoder_input: the first layer's input ``[B, S, D]``, instead of embedding
            ``input_ids``.
        padding_mask: bool ``[B, S]``, ``True`` at padding tokens. The reference model
            keeps them out of attention (as keys) and of the router's aux loss; they are
            routed like any token. The loss is still ``loss_mask``'s: with ``labels``, a
            ``padding_mask`` needs a ``loss_mask`` (``0`` at padding).
        packed_seq_params: Megatron-Core's ``PackedSeqParams`` (no shipped model reads it).
        extra_block_kwargs: keywords for the decoder block (an empty mapping is unset).
        runtime_gather_output: Megatron-Core's output gather flag.
    """

    input_ids: Tensor | None = None
    position_ids: Tensor | None = None
    attention_mask: Tensor | None = None
    labels: Tensor | None = None
    loss_mask: Tensor | None = None
    decoder_input: Tensor | None = None
    padding_mask: Tensor | None = None
    packed_seq_params: Any = None
    extra_block_kwargs: Mapping[str, object] | None = None
    runtime_gather_output: bool | None = None

    def __new__(cls, *args: object, **fields: object) -> Microbatch:
        # Python's own TypeError for a wrong keyword names neither the field meant nor,
        # for another library's name (torchtitan's positions), this library's.
        _check_names(args, fields)
        return object.__new__(cls)

    def __post_init__(self) -> None:
        check_fields(self, _MICROBATCH)


_TENSOR = Opt(TENSOR)
_MICROBATCH: dict[str, Spec[object]] = {
    "input_ids": _TENSOR,
    "position_ids": _TENSOR,
    "attention_mask": _TENSOR,
    "labels": _TENSOR,
    "loss_mask": _TENSOR,
    "decoder_input": _TENSOR,
    "padding_mask": _TENSOR,
    "packed_seq_params": ANY,
    "extra_block_kwargs": Opt(Instance(Mapping, "a mapping")),
    "runtime_gather_output": Opt(BOOL),
}

_OTHER_NAMES = {
    "positions": "torchtitan's name for position_ids: pass position_ids=positions",
    "attention_masks": (
        "torchtitan's attention masks: the torchtitan adapter builds them from "
        "position_ids (the model's own get_attention_masks), so pass position_ids only; "
        "attention_mask is a mask for the models that read one"
    ),
    "tokens": "torchtitan's name for input_ids: pass input_ids=tokens",
}
"""Other libraries' names for the fields, and what to pass instead."""


def _check_names(args: tuple[object, ...], fields: Mapping[str, object]) -> None:
    if args:
        raise ConfigError(
            f"Microbatch: expected its fields by keyword (Microbatch(input_ids=..., "
            f"position_ids=..., labels=...)), received {len(args)} positional argument(s)"
        )
    unknown = [name for name in fields if name not in _MICROBATCH]
    if not unknown:
        return
    name = unknown[0]
    hint = _OTHER_NAMES.get(name)
    if hint is None:
        close = difflib.get_close_matches(name, list(_MICROBATCH), n=1)
        hint = f"did you mean {close[0]}?" if close else "leave it out"
    raise ConfigError(
        f"Microbatch: {name}: expected one of its fields {list(_MICROBATCH)}, received "
        f"{name}=...; {hint}"
    )
