"""torchtitan's keyword names (``positions``, ``attention_masks``) on the adapter's entry
points: the library's error, naming what to pass instead, not Python's bare ``TypeError``.

The names are keyword-only parameters whose default, :data:`NOT_GIVEN`, is the only value
accepted: the signature still lists exactly what a caller may pass (debug mode's
first-step check reads it to call ``forward`` with a microbatch's fields).
"""

from __future__ import annotations

import enum

from torch import Tensor

from moe_overlap import ConfigError
from moe_overlap.blocks import MegatronHooks

__all__ = ["NOT_GIVEN", "TitanHooks", "refuse_titan_names"]


class _NotGiven(enum.Enum):
    NOT_GIVEN = "not given"

    def __repr__(self) -> str:
        return "<not given>"


NOT_GIVEN = _NotGiven.NOT_GIVEN
"""The default of torchtitan's keyword names: any value passed for them is refused."""


def _shown(value: object) -> str:
    if isinstance(value, Tensor):
        return f"a tensor {list(value.shape)}"
    return "None" if value is None else type(value).__name__


def refuse_titan_names(where: str, *, positions: object, attention_masks: object) -> None:
    """A :class:`~moe_overlap.ConfigError` for a value given under torchtitan's name."""
    if positions is not NOT_GIVEN:
        raise ConfigError(
            f"{where}: positions: torchtitan's name for the token positions; expected "
            f"position_ids (the adapter reads RoPE's positions and, for flex or varlen "
            f"attention, the per-document masks from them), received positions="
            f"{_shown(positions)}; pass position_ids=positions"
        )
    if attention_masks is not NOT_GIVEN:
        raise ConfigError(
            f"{where}: attention_masks: expected none (the adapter builds the attention masks "
            f"itself, per microbatch, with the model's own get_attention_masks(position_ids), "
            f"as torchtitan's trainer does), received attention_masks="
            f"{_shown(attention_masks)}; leave it out and pass position_ids (the positions "
            "the masks are built from: 0 at each document's first token)"
        )


class TitanHooks(MegatronHooks):
    """:class:`~moe_overlap.blocks.MegatronHooks` whose ``plain_forward`` refuses
    torchtitan's names with :func:`refuse_titan_names`."""

    def plain_forward(
        self,
        x: Tensor,
        position_ids: Tensor | None = None,
        *,
        labels: Tensor | None = None,
        loss_mask: Tensor | None = None,
        attention_mask: Tensor | None = None,
        padding_mask: Tensor | None = None,
        positions: object = NOT_GIVEN,
        attention_masks: object = NOT_GIVEN,
    ) -> Tensor:
        """:meth:`MegatronHooks.plain_forward`; ``positions`` and ``attention_masks``
        (torchtitan's names) are refused, naming what to pass instead."""
        refuse_titan_names(
            f"{type(self).__name__}.plain_forward",
            positions=positions,
            attention_masks=attention_masks,
        )
        return super().plain_forward(
            x,
            position_ids,
            labels=labels,
            loss_mask=loss_mask,
            attention_mask=attention_mask,
            padding_mask=padding_mask,
        )
