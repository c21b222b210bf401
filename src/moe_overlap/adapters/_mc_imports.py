"""Every Megatron-Core name the adapter uses, imported here (Megatron-Core is optional and
untyped for the library: each name is looked up once and given a type)."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from torch import Tensor, nn

from moe_overlap import ConfigError

__all__ = ["TESTED_MEGATRON_CORE", "Mcore", "mcore"]

TESTED_MEGATRON_CORE = "0.19.2"
"""The Megatron-Core release the adapter is tested against."""


@dataclass(frozen=True, slots=True)
class Mcore:
    """Megatron-Core's classes and functions the adapter calls."""

    gpt_model: type[nn.Module]
    """``megatron.core.models.gpt.GPTModel``."""
    hybrid_model: type[nn.Module] | None
    """``megatron.core.models.hybrid.hybrid_model.HybridModel`` (``None`` in a release
    without it)."""
    transformer_layer: type[nn.Module]
    """``megatron.core.transformer.transformer_layer.TransformerLayer``."""
    moe_layer: type[nn.Module]
    """``megatron.core.transformer.moe.moe_layer.MoELayer``."""
    dispatchers: tuple[type, ...]
    """The token dispatchers the adapter runs: all-to-all and all-gather."""
    wrapped_tensor: type
    """``megatron.core.utils.WrappedTensor`` (``GPTModel._preprocess`` wraps the decoder input)."""
    make_viewless: Callable[..., Tensor]
    """``megatron.core.utils.make_viewless_tensor``."""
    version: str


def _get(module: str, name: str) -> object:
    return cast("object", getattr(importlib.import_module(module), name))


def _hybrid_model() -> type[nn.Module] | None:
    """``HybridModel``, or ``None`` where this Megatron-Core release has none."""
    try:
        return cast(
            "type[nn.Module]", _get("megatron.core.models.hybrid.hybrid_model", "HybridModel")
        )
    except (ImportError, AttributeError):
        return None


@functools.cache
def mcore() -> Mcore:
    """Megatron-Core's names, or a :class:`~moe_overlap.ConfigError` when it does not import."""
    try:
        dispatch = "megatron.core.transformer.moe.token_dispatcher"
        version: object = _get("megatron.core.package_info", "__version__")
        return Mcore(
            gpt_model=cast("type[nn.Module]", _get("megatron.core.models.gpt", "GPTModel")),
            hybrid_model=_hybrid_model(),
            transformer_layer=cast(
                "type[nn.Module]",
                _get("megatron.core.transformer.transformer_layer", "TransformerLayer"),
            ),
            moe_layer=cast(
                "type[nn.Module]", _get("megatron.core.transformer.moe.moe_layer", "MoELayer")
            ),
            dispatchers=(
                cast("type", _get(dispatch, "MoEAlltoAllTokenDispatcher")),
                cast("type", _get(dispatch, "MoEAllGatherTokenDispatcher")),
            ),
            wrapped_tensor=cast("type", _get("megatron.core.utils", "WrappedTensor")),
            make_viewless=cast(
                "Callable[..., Tensor]", _get("megatron.core.utils", "make_viewless_tensor")
            ),
            version=str(version),
        )
    except ImportError as exc:
        raise ConfigError(
            "MegatronMoEAdapter: expected Megatron-Core to be importable (pip install "
            f"'moe-overlap[megatron]', then pip install --no-deps "
            f"megatron-core=={TESTED_MEGATRON_CORE}), received {type(exc).__name__}: {exc}"
        ) from exc
