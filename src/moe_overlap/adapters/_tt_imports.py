"""Every torchtitan name the adapter uses, imported here (torchtitan is optional and
untyped: each name is looked up once and given a type)."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import cast

from torch import Tensor, nn

from moe_overlap import ConfigError

__all__ = ["TESTED_TORCHTITAN", "Titan", "titan"]

TESTED_TORCHTITAN = "0.3.0"
"""The torchtitan release the adapter is tested against."""


@dataclass(frozen=True, slots=True)
class Titan:
    """torchtitan's classes and functions the adapter calls."""

    decoder: type[nn.Module]
    """``torchtitan.models.common.decoder.Decoder``: every torchtitan language model."""
    moe: type[nn.Module]
    """``torchtitan.models.common.moe.MoE``."""
    masked_attention: tuple[type, ...]
    """The inner-attention configs for which torchtitan's trainer builds masks (flex, varlen)."""
    cross_entropy_loss: Callable[[Tensor, Tensor], Tensor]
    """``torchtitan.components.loss.cross_entropy_loss`` (sum reduction, ``-100`` ignored)."""
    sparse_mesh: Callable[[], AbstractContextManager[None]]
    """``torchtitan.distributed.spmd_types.maybe_set_sparse_mesh`` (around the experts)."""
    version: str


def _attr(obj: object, name: str) -> object:
    return cast("object", getattr(obj, name))


def _get(module: str, name: str) -> object:
    return _attr(importlib.import_module(module), name)


@functools.cache
def titan() -> Titan:
    """torchtitan's names, or a :class:`~moe_overlap.ConfigError` when it does not import."""
    try:
        attention = "torchtitan.models.common.attention"
        configs = tuple(
            cast("type", _attr(_get(attention, name), "Config"))
            for name in ("FlexAttention", "VarlenAttention")
        )
        version: object = getattr(importlib.import_module("torchtitan"), "__version__", "?")
        return Titan(
            decoder=cast("type[nn.Module]", _get("torchtitan.models.common.decoder", "Decoder")),
            moe=cast("type[nn.Module]", _get("torchtitan.models.common.moe", "MoE")),
            masked_attention=configs,
            cross_entropy_loss=cast(
                "Callable[[Tensor, Tensor], Tensor]",
                _get("torchtitan.components.loss", "cross_entropy_loss"),
            ),
            sparse_mesh=cast(
                "Callable[[], AbstractContextManager[None]]",
                _get("torchtitan.distributed.spmd_types", "maybe_set_sparse_mesh"),
            ),
            version=str(version),
        )
    except ImportError as exc:
        raise ConfigError(
            "TorchtitanMoEAdapter: expected torchtitan to be importable (pip install "
            f"'moe-overlap[torchtitan]', then pip install --no-deps "
            f"torchtitan=={TESTED_TORCHTITAN}), received {type(exc).__name__}: {exc}"
        ) from exc
