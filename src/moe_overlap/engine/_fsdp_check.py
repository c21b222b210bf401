"""FSDP2 modules where the schedule would never run their hooks: refused at plan time."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from ._errors import ConfigError

__all__ = ["check_fsdp"]

_HELP = (
    "the schedule calls _preprocess / _postprocess and the layers' slots, never the "
    "model's or a layer's forward, so FSDP's hooks on it would never all-gather or "
    "reduce-scatter; fully_shard the modules the slots call instead "
    "(moe_overlap.integrations.fsdp.fully_shard_slots)"
)


def check_fsdp(model: object, layers: Iterable[object], *, delayed: bool) -> None:
    """Raise :class:`~moe_overlap.ConfigError` for FSDP placed where it cannot work.

    Refused: the model chunk or a decoder layer that is itself an ``FSDPModule``, and
    delayed weight gradients in a model holding ``FSDPModule`` s (FSDP reduce-scatters in
    its post-backward hook, before the schedule's delayed weight-gradient step).
    """
    if not isinstance(model, nn.Module):
        inner: object = getattr(model, "model", None)  # an adapter's wrapped model
        if not isinstance(inner, nn.Module):
            return
        model = inner
    from torch.distributed.fsdp import FSDPModule

    name = type(model).__name__
    if isinstance(model, FSDPModule):
        raise ConfigError(
            f"{name}: expected a model that is not an FSDPModule, received one; {_HELP}"
        )
    for i, layer in enumerate(layers):
        if isinstance(layer, FSDPModule):
            raise ConfigError(
                f"{name}.decoder.layers[{i}] ({type(layer).__name__}): expected a layer that "
                f"is not an FSDPModule, received one; {_HELP}"
            )
    if delayed and any(isinstance(m, FSDPModule) for m in model.modules()):
        raise ConfigError(
            f"{name}: delayed weight gradients with FSDP2 modules are not composed: FSDP "
            "reduce-scatters each module's gradients in its post-backward hook, before the "
            "schedule's delayed weight-gradient step computes them; expected "
            "delay_wgrad_compute off, received it on"
        )
