"""Megatron-Core's input shapes converted to the engine's: what the engine itself accepts
(:class:`~moe_overlap.TransformerLayerNode` takes an ``extra_args`` mapping), so it lives in
the engine's floor. Public, with the plan builders, as :mod:`moe_overlap.megatron`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any, cast

from torch import Tensor

from ._errors import ConfigError
from ._layer_args import LayerArgs
from ._microbatch import Microbatch
from ._protocols import FreeInputConfig
from .args import BOOL, POSITIVE, Opt, check_arg
from .contracts import FREE_INPUT_CONFIG

__all__ = ["layer_args", "microbatch"]

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


def microbatch(
    input_ids: Tensor | None,
    position_ids: Tensor | None,
    attention_mask: Tensor | None,
    decoder_input: Tensor | None = None,
    labels: Tensor | None = None,
    packed_seq_params: Any = None,
    extra_block_kwargs: Mapping[str, object] | None = None,
    runtime_gather_output: bool | None = None,
    loss_mask: Tensor | None = None,
    padding_mask: Tensor | None = None,
) -> Microbatch:
    """Megatron's positional chunk inputs, in ``build_schedule_plan``'s order, as a
    :class:`~moe_overlap.Microbatch`."""
    return Microbatch(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        decoder_input=decoder_input,
        labels=labels,
        packed_seq_params=packed_seq_params,
        extra_block_kwargs=extra_block_kwargs,
        runtime_gather_output=runtime_gather_output,
        loss_mask=loss_mask,
        padding_mask=padding_mask,
    )
