"""Attention and padding masks, by Megatron-Core's conventions; checked, then combined.

Legend: ``B`` batch, ``S`` sequence, ``T = B*S`` tokens.

- ``attention_mask``: a bool tensor ``[B or 1, 1, S or 1, S]``, ``True`` where a query
  (dim 2) must *not* attend a key (dim 3), as Megatron-Core's ``get_ltor_masks_and_position_ids``
  makes it. The causal mask always applies on top: a query attends a key when the key is
  not later, not masked, and not padding.
- ``padding_mask``: a bool tensor ``[B, S]``, ``True`` at padding tokens (Megatron-Core's
  MoE router convention).

:func:`blocked_keys` combines both with causality into what attention masks out; a query
left with no key to attend (a left-padded position, say) gets a zero attention output.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor

from moe_overlap import ChunkState, ConfigError, IntegrationError
from moe_overlap.args import Instance, check_arg, refuse

__all__ = [
    "BlockedKeys",
    "blocked_keys",
    "check_attention_mask",
    "check_masks",
    "check_padding_mask",
    "token_padding",
]


_STATE = Instance(ChunkState, "a ChunkState (the chunk's inputs)", error=IntegrationError)


def _describe(t: Tensor) -> str:
    return f"a {str(t.dtype).removeprefix('torch.')} tensor of shape {list(t.shape)}"


def check_padding_mask(mask: Tensor | None, batch: int, seq: int, where: str) -> Tensor | None:
    """``mask`` if it is ``None`` or a bool ``[batch, seq]`` tensor, else a
    :class:`~moe_overlap.ConfigError` naming ``where`` and the field."""
    if mask is None:
        return None
    if not isinstance(cast(object, mask), Tensor):
        raise refuse(f"{where}: padding_mask", "a bool tensor [B, S] or None", mask)
    if mask.dtype != torch.bool or tuple(mask.shape) != (batch, seq):
        raise ConfigError(
            f"{where}: padding_mask: expected a bool tensor of shape [B, S] = "
            f"[{batch}, {seq}] (True at padding tokens), received {_describe(mask)}"
        )
    return mask


def check_attention_mask(mask: Tensor | None, batch: int, seq: int, where: str) -> Tensor | None:
    """``mask`` if it is ``None`` or a bool ``[B or 1, 1, S or 1, S]`` tensor, else a
    :class:`~moe_overlap.ConfigError` naming ``where`` and the field."""
    if mask is None:
        return None
    if not isinstance(cast(object, mask), Tensor):
        raise refuse(
            f"{where}: attention_mask", "a bool tensor [B or 1, 1, S or 1, S] or None", mask
        )
    shape = tuple(mask.shape)
    if not (
        mask.dtype == torch.bool
        and len(shape) == 4
        and shape[0] in (1, batch)
        and shape[1] == 1
        and shape[2] in (1, seq)
        and shape[3] == seq
    ):
        raise ConfigError(
            f"{where}: attention_mask: expected a bool tensor of shape [B or 1, 1, S or 1, S] "
            f"= [{batch} or 1, 1, {seq} or 1, {seq}] (True where a query must not attend a "
            f"key, Megatron-Core's convention; for padding pass padding_mask [B, S]), "
            f"received {_describe(mask)}"
        )
    return mask


def check_masks(state: ChunkState, batch: int, seq: int, where: str) -> None:
    """Both masks of ``state`` (see :func:`check_attention_mask`, :func:`check_padding_mask`)."""
    if not isinstance(cast(object, state), ChunkState):  # per layer and microbatch: inline
        check_arg("check_masks", "state", state, _STATE)
    check_attention_mask(state.attention_mask, batch, seq, where)
    check_padding_mask(state.padding_mask, batch, seq, where)


class BlockedKeys:
    """What a layer's attention masks out: ``blocked`` ``[B or 1, 1, S, S]`` (``True``: the
    query does not attend the key; causality included) and ``dead`` ``[B or 1, 1, S, 1]``
    (queries with no key left, whose attention output is zero).

    ``blocked`` lets a dead query attend itself, so no softmax row is empty (no NaN in
    either direction); its output is then zeroed, which also stops its gradient.
    """

    __slots__ = ("blocked", "dead")

    def __init__(self, blocked: Tensor, dead: Tensor) -> None:
        self.blocked = blocked
        self.dead = dead


def blocked_keys(
    attention_mask: Tensor | None, padding_mask: Tensor | None, seq: int, device: torch.device
) -> BlockedKeys | None:
    """The causal mask with ``attention_mask`` and the padded keys on top; ``None`` when
    neither mask is given (causal attention only)."""
    if attention_mask is None and padding_mask is None:
        return None
    causal = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
    blocked = ~causal.view(1, 1, seq, seq)
    if attention_mask is not None:
        blocked = blocked | attention_mask
    if padding_mask is not None:
        blocked = blocked | padding_mask[:, None, None, :]
    dead = blocked.all(dim=-1, keepdim=True)
    eye = torch.eye(seq, dtype=torch.bool, device=device).view(1, 1, seq, seq)
    return BlockedKeys(blocked & ~(dead & eye), dead)


def token_padding(state: ChunkState) -> Tensor | None:
    """The padding mask flattened to tokens, ``[T]`` (``True`` at padding), or ``None``."""
    if not isinstance(cast(object, state), ChunkState):  # per layer and microbatch: inline
        check_arg("token_padding", "state", state, _STATE)
    mask = state.padding_mask
    return None if mask is None else mask.reshape(-1)
