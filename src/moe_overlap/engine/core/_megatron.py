"""Megatron-Core's dict-shaped ``extra_args`` converted to the engine's
:class:`~moe_overlap.LayerArgs`: the engine itself accepts one
(:class:`~moe_overlap.TransformerLayerNode`), so it lives in the engine's floor. Public, with
the plan builders, as :mod:`moe_overlap.megatron`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import cast

from typing_extensions import get_protocol_members

from moe_overlap.args import BOOL, POSITIVE, Opt, check_arg
from moe_overlap.errors import ConfigError
from moe_overlap.protocols import FreeInputConfig

from ._layer_args import LayerArgs

__all__ = ["layer_args"]

_LOCAL_EXPERTS = Opt(POSITIVE)
_FLAGS = ("is_moe", "delay_wgrad_compute", "is_mtp", "is_first_layer", "is_last_layer")
_KEYS = frozenset(f.name for f in fields(LayerArgs))
_CONFIG_FIELDS = tuple(  # (a list first: asking for the members caches them on the class)
    name for name in list(vars(FreeInputConfig)) if name in get_protocol_members(FreeInputConfig)
)
"""The fields a config must have, in the Protocol's order (as its rule table lists them)."""


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
    if any(not hasattr(config, name) for name in _CONFIG_FIELDS):
        *names, last = _CONFIG_FIELDS
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
