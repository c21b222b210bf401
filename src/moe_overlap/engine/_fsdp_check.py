"""FSDP2 modules where the schedule would never run their hooks: refused at plan time."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial

from torch import nn

from moe_overlap.errors import ConfigError

from ._conformance import named

__all__ = ["check_fsdp", "refuse_fsdp"]

_HELP = (
    "the schedule calls _preprocess / _postprocess and the layers' slots, never the "
    "model's or a layer's forward, so FSDP's hooks on it would never all-gather or "
    "reduce-scatter; fully_shard the modules the slots call instead "
    "(moe_overlap.integrations.fsdp.fully_shard_slots)"
)


def refuse_fsdp(obj: object, where: str | Callable[[], str], what: str) -> None:
    """Raise :class:`~moe_overlap.ConfigError` when ``obj`` (``what``: "a model", "a layer", ...,
    named ``where``, a callable called only then) is FSDP2's ``FSDPModule`` or FSDP1's
    ``FullyShardedDataParallel``."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    if isinstance(obj, FSDPModule):
        raise ConfigError(
            f"{named(where)}: expected {what} that is not an FSDPModule, received one; {_HELP}"
        )
    if isinstance(obj, FullyShardedDataParallel):
        inner = type(obj.module).__name__
        raise ConfigError(
            f"{named(where)}: expected {what} not wrapped by FSDP, received a "
            f"FullyShardedDataParallel (FSDP1) around {inner}; {_HELP}"
        )


def check_fsdp(model: object, layers: Iterable[object], *, delayed: bool) -> None:
    """Raise :class:`~moe_overlap.ConfigError` for FSDP placed where it cannot work.

    Refused: the model chunk or a decoder layer that is itself an ``FSDPModule`` (or FSDP1's
    wrapper), and delayed weight gradients in a model holding ``FSDPModule`` s (FSDP
    reduce-scatters in its post-backward hook, before the schedule's delayed weight-gradient
    step).
    """
    if not isinstance(model, nn.Module):
        inner: object = getattr(model, "model", None)  # an adapter's wrapped model
        if not isinstance(inner, nn.Module):
            return
        model = inner
    from torch.distributed.fsdp import FSDPModule

    name = type(model).__name__
    refuse_fsdp(model, name, "a model")
    for i, layer in enumerate(layers):
        refuse_fsdp(layer, partial(_layer_name, name, i, layer), "a layer")
    if delayed and any(isinstance(m, FSDPModule) for m in model.modules()):
        raise ConfigError(
            f"{name}: delayed weight gradients with FSDP2 modules are not composed: FSDP "
            "reduce-scatters each module's gradients in its post-backward hook, before the "
            "schedule's delayed weight-gradient step computes them; expected "
            "delay_wgrad_compute off, received it on"
        )


def _layer_name(model: str, index: int, layer: object) -> str:
    return f"{model}.decoder.layers[{index}] ({type(layer).__name__})"
