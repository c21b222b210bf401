"""Megatron-Core's dict-shaped ``extra_args`` converted to the engine's
:class:`~moe_overlap.LayerArgs`: the engine itself accepts one
(:class:`~moe_overlap.TransformerLayerNode`), so it lives in the engine's floor. Public, with
the plan builders, as :mod:`moe_overlap.megatron`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import cast

from moe_overlap.engine.contracts import FREE_INPUT_CONFIG

from ._errors import ConfigError
from ._layer_args import LayerArgs
from ._protocols import FreeInputConfig
from .args import BOOL, POSITIVE, Opt, check_arg

__all__ = ["layer_args"]

_LOCAL_EXPERTS = Opt(POSITIVE)
_FLAGS = ("is_moe", "delay_wgrad_compute", "is_mtp", "is_first_layer", "is_last_layer")
_KEYS = frozenset(f.name for f in fields(LayerArgs))


def layer_args(extra_args: Mapping[str, object] | None) -> LayerArgs:
    """Megatron's ``extra_args`` dict as a :class:`~moe_overlap.LayerArgs`.

    Keys are ``LayerArgs``' fields; ``config`` is required, the flags default to
    ``False``. An unknown key, a flag that is not a bool, a config without the free-input
    fields, or ``None`` is a :class:`~moe_overlap.ConfigError`.
    """
    if extra_args is None:
        raise ConfigError("LayerArgs: extra_args must give at least 'config', received None")
    unknown = sorted(set(extra_args) - _KEYS)
    if unknown:
        raise ConfigError(
            f"LayerArgs: unknown extra_args keys {unknown}; expected a subset of {sorted(_KEYS)}"
        )
    config = extra_args.get("config")
    if FREE_INPUT_CONFIG.missing(config):
        *names, last = FREE_INPUT_CONFIG.names
        raise ConfigError(
            f"LayerArgs: extra_args['config'] must have {', '.join(names)} and {last}; "
            f"received {type(config).__name__}"
        )
    flags = {
        key: check_arg("LayerArgs", f"extra_args[{key!r}]", extra_args.get(key, False), BOOL)
        for key in _FLAGS
    }
    nle = check_arg(
        "LayerArgs",
        "extra_args['num_local_experts']",
        extra_args.get("num_local_experts"),
        _LOCAL_EXPERTS,
    )
    return LayerArgs(config=cast(FreeInputConfig, config), num_local_experts=nle, **flags)
