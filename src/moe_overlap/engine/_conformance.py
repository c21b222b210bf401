"""Checking an integration once, at plan construction, member by member.

Everything the schedule will touch is looked up here, before any tensor runs, so a missing
or wrongly typed member fails with the member's name instead of an ``AttributeError`` deep
inside a slot. Each check is its Protocol's rule table (``engine/contracts.py``) applied to one
object; what is left here is how the schedule walks to the objects (a layer's wgrad lists).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NoReturn, cast

from torch import Tensor

from moe_overlap.errors import ConfigError, IntegrationError
from moe_overlap.protocols import (
    CudaGraphModule,
    FreeInputConfig,
    MtpSchedulableLayer,
    PreprocessableModel,
    SchedulableLayer,
    WgradLayer,
    WgradScope,
)

from .contracts import (
    DISPATCHER_BACKENDS,
    DISPATCHER_TYPES,
    FREE_INPUT_CONFIG,
    LAYER,
    MODEL,
    MTP_LAYER,
    WGRAD_LAYER,
    already_checked,
    checks_memoized,
    named,
)
from .core._state import PreprocessOutput

__all__ = [
    "DISPATCHER_BACKENDS",
    "DISPATCHER_TYPES",
    "Indexed",
    "already_checked",
    "as_mtp_layer",
    "check_free_input_config",
    "check_layer",
    "check_model",
    "check_preprocess_output",
    "check_wgrad_layer",
    "check_wgrad_layers",
    "check_wgrad_scopes",
    "checks_memoized",
    "delay_option_error",
    "named",
    "not_a_tensor",
]


def check_model(model: object) -> PreprocessableModel:
    """Return ``model`` as a :class:`~moe_overlap.PreprocessableModel` or raise, naming what is wrong.

    Checks the members and, where the schedule reads them, their values: the two stage
    flags are bools, the hooks callable, ``config.mtp_num_layers`` ``None`` or an int, and
    the decoder has ``layers``, ``input_tensor`` and ``final_layernorm`` (which may be
    ``None`` but must exist). The fast path formats no message; runs once per plan, or
    once per :func:`checks_memoized` block.
    """
    return MODEL.check(model)


def check_free_input_config(config: object, where: str) -> FreeInputConfig:
    """Return ``config`` as a :class:`~moe_overlap.protocols.FreeInputConfig` or raise, naming the field."""
    if FREE_INPUT_CONFIG.conforms(config):
        return cast(FreeInputConfig, config)
    raise FREE_INPUT_CONFIG.error(config, where)


def check_layer(layer: object, where: str | Callable[[], str]) -> SchedulableLayer:
    """Return ``layer`` as a :class:`~moe_overlap.SchedulableLayer` or raise, naming what is wrong.

    ``config`` must carry the free-input fields (:func:`check_free_input_config`),
    ``is_moe`` be a bool, ``num_local_experts`` ``None`` or an int >= 1, and the slots the
    schedule will call (all four for MoE layers, pre-dispatch and mlp for dense ones)
    callable. ``where`` names the layer in errors (a callable is called only then).
    """
    return LAYER.check(layer, where)


def check_wgrad_layers(
    modules: object, where: str | Callable[[], str], what: str = ""
) -> list[WgradLayer]:
    """``modules`` as a list of :class:`~moe_overlap.WgradLayer` s, or raise naming the first bad one.

    The error names ``where`` (a callable is called only then), then ``what`` and ``[i]``.
    """

    if isinstance(modules, (list, tuple)) and not modules:
        return []

    def name() -> str:
        base = named(where)
        return f"{base}: {what}" if what else base

    if not isinstance(modules, (list, tuple)) and (
        not isinstance(modules, Sequence) or isinstance(modules, (str, bytes))
    ):
        raise IntegrationError(
            f"{name()}: expected a sequence of WgradLayers, received {type(modules).__name__}"
        )
    items = list(cast("Sequence[object]", modules))
    for i, module in enumerate(items):
        if not already_checked(module, WGRAD_LAYER):
            check_wgrad_layer(module, Indexed(name, i, ""))
    return cast("list[WgradLayer]", items)


class Indexed:
    """``f"{where()}[{index}]{suffix}"``, built only when an error message needs it."""

    __slots__ = ("index", "suffix", "where")

    def __init__(self, where: Callable[[], str], index: int, suffix: str) -> None:
        self.where = where
        self.index = index
        self.suffix = suffix

    def __call__(self) -> str:
        return f"{self.where()}[{self.index}]{self.suffix}"


def check_wgrad_layer(module: object, where: str | Callable[[], str]) -> WgradLayer:
    """``module`` as a :class:`~moe_overlap.WgradLayer` (``backward_dw()`` and ``parameters()``)."""
    return WGRAD_LAYER.check(module, where)


def check_wgrad_scopes(parts: object, where: str | Callable[[], str]) -> tuple[WgradScope, ...]:
    """``parts`` as a tuple of :class:`~moe_overlap.WgradScope` s, or raise naming the bad one.

    ``where`` names the list in errors (a callable is called only then).
    """
    if isinstance(parts, (list, tuple)) or (
        isinstance(parts, Sequence) and not isinstance(parts, (str, bytes))
    ):
        items = tuple(cast("Sequence[object]", parts))
    else:
        raise IntegrationError(
            f"{named(where)}: expected a sequence of WgradScope(scope, module), "
            f"received {type(parts).__name__}"
        )
    for i, part in enumerate(items):
        if not isinstance(part, WgradScope):
            raise IntegrationError(
                f"{named(where)}[{i}]: expected a WgradScope(scope, module) naming the "
                f"CUDA-graph scope that covers the module, received {type(part).__name__}; "
                "wrap it: WgradScope(CudaGraphModule.attn, module)"
            )
        if not isinstance(part.scope, CudaGraphModule):  # pyright: ignore[reportUnnecessaryIsInstance]
            raise IntegrationError(
                f"{named(where)}[{i}].scope: expected a CudaGraphModule, "
                f"received {type(part.scope).__name__} {part.scope!r}"
            )
        if not already_checked(part.module, WGRAD_LAYER):
            check_wgrad_layer(part.module, Indexed(lambda: named(where), i, ".module"))
    return cast("tuple[WgradScope, ...]", items)


def as_mtp_layer(
    layer: SchedulableLayer, where: str | Callable[[], str] = ""
) -> MtpSchedulableLayer | None:
    """``layer`` as an MTP layer when it has the MTP post-process slot, else ``None``.

    The slot is the one member :class:`~moe_overlap.MtpSchedulableLayer` adds: optional on a
    layer, and callable when present.
    """
    slot = MTP_LAYER.member("slot_mtp_post_process")
    if not hasattr(layer, slot.name):
        return None
    if not slot.accepts(getattr(layer, slot.name)):
        raise MTP_LAYER.error(layer, named(where))
    return cast(MtpSchedulableLayer, layer)


def check_preprocess_output(model: object, value: object) -> None:
    """Raise unless what ``model._preprocess`` returned is a
    :class:`~moe_overlap.PreprocessOutput` or a tuple of its fields, each of its type."""
    where = f"{type(model).__name__}._preprocess"
    names = PreprocessOutput._fields
    if not isinstance(value, tuple):
        raise IntegrationError(
            f"{where}: expected a PreprocessOutput or a {len(names)}-tuple {names}, "
            f"received {type(value).__name__}"
        )
    items: tuple[object, ...] = value  # pyright: ignore[reportUnknownVariableType]
    if len(items) != len(names):
        raise IntegrationError(
            f"{where}: expected a {len(names)}-tuple {names}, "
            f"received a tuple of length {len(items)}"
        )
    decoder_input, emb, cos, sin, offset, padding_mask = items
    if not isinstance(decoder_input, Tensor):
        raise IntegrationError(
            f"{where}: decoder_input must be a Tensor, received {type(decoder_input).__name__}"
        )
    if offset is not None and not isinstance(offset, Tensor):
        raise IntegrationError(
            f"{where}: sequence_len_offset must be a Tensor or None, "
            f"received {type(offset).__name__}"
        )
    _optional_tensor(where, "rotary_pos_emb", emb)
    _optional_tensor(where, "rotary_pos_cos", cos)
    _optional_tensor(where, "rotary_pos_sin", sin)
    _optional_tensor(where, "padding_mask", padding_mask)


def _optional_tensor(where: str, name: str, value: object) -> None:
    if value is None or isinstance(value, Tensor):
        return
    raise IntegrationError(
        f"{where}: {name} must be a Tensor or None, received {type(value).__name__}"
    )


def not_a_tensor(model: object, method: str, value: object) -> IntegrationError:
    """The error for what ``model.<method>`` returned where a Tensor was expected."""
    where = f"{type(model).__name__}.{method}"
    return IntegrationError(f"{where}: expected a Tensor, received {type(value).__name__}")


def delay_option_error(
    where: str, option: bool, pre: Sequence[object], mlp: Sequence[object]
) -> NoReturn:
    """``ScheduleOptions.delay_wgrad_compute`` says otherwise than the layer does."""
    does = "does not delay" if option else "delays"
    fix = "with" if option else "without"
    raise ConfigError(
        f"{where}: ScheduleOptions(delay_wgrad_compute={option}) expected the layer to "
        f"{'delay its weight gradients' if option else 'compute its weight gradients at once'}"
        f", but it {does} them (pre_dispatch_wgrad() lists {len(pre)} modules, mlp_wgrad() "
        f"{len(mlp)}); "
        f"the layers decide: build the model {fix} delayed wgrad, or leave "
        "delay_wgrad_compute unset"
    )
