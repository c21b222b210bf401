"""Checking an integration once, at plan construction, member by member.

Everything the schedule will touch is looked up here, before any tensor runs, so a missing
or wrongly typed member fails with the member's name instead of an ``AttributeError`` deep
inside a slot.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import cast

from torch import Tensor

from ._errors import ConfigError, IntegrationError
from ._protocols import (
    FreeInputConfig,
    MtpSchedulableLayer,
    PreprocessableModel,
    SchedulableLayer,
    WgradLayer,
)

__all__ = [
    "DISPATCHER_BACKENDS",
    "DISPATCHER_TYPES",
    "as_mtp_layer",
    "check_free_input_config",
    "check_layer",
    "check_model",
    "check_wgrad_layers",
    "missing_members",
]

MODEL_MEMBERS = ("pre_process", "post_process", "config", "decoder", "_preprocess", "_postprocess")
DECODER_MEMBERS = ("layers", "input_tensor", "final_layernorm")
SLOTS = ("slot_pre_dispatch", "slot_dispatch", "slot_mlp", "slot_combine")
LAYER_MEMBERS = (
    "config",
    "is_moe",
    "num_local_experts",
    *SLOTS,
    "pre_dispatch_wgrad",
    "mlp_wgrad",
)
FREE_INPUT_FIELDS = (
    "moe_token_dispatcher_type",
    "moe_flex_dispatcher_backend",
    "fp8",
    "fp4",
    "cuda_graph_modules",
)
DISPATCHER_TYPES = ("alltoall", "allgather", "flex")
"""The token dispatchers whose free-input behaviour Megatron-Core 0.19 defines."""
DISPATCHER_BACKENDS = (None, "deepep", "hybridep", "ncclep")
"""The flex dispatcher backends whose free-input behaviour Megatron-Core 0.19 defines."""

_DECODER_HELP = (
    "a decoder is an object with `layers` (the SchedulableLayers, e.g. an nn.ModuleList), "
    "`input_tensor` (the previous pipeline stage's output, None on the first stage) and "
    "`final_layernorm` (None, or the norm PostProcessNode applies when this rank's decoder "
    "has no layers)"
)


def missing_members(obj: object, members: tuple[str, ...]) -> list[str]:
    """The ``members`` that ``obj`` lacks, looked up dynamically.

    ``isinstance`` against a runtime-checkable Protocol looks attributes up statically on
    Python 3.12+, so it misses ``torch.nn.Module`` submodules (kept in ``_modules`` and
    served by ``__getattr__``); integrations are checked with this instead, once per plan.
    """
    return [m for m in members if not hasattr(obj, m)]


def _kind(value: object) -> str:
    return f"{type(value).__name__} {value!r}" if isinstance(value, (int, float, str)) else (
        type(value).__name__
    )


def _expect_bool(where: str, value: object) -> None:
    if not isinstance(value, bool):
        raise IntegrationError(f"{where}: expected a bool, received {_kind(value)}")


def _expect_callable(where: str, value: object) -> None:
    if not callable(value):
        raise IntegrationError(f"{where}: expected a callable, received {_kind(value)}")


def check_model(model: object) -> PreprocessableModel:
    """Return ``model`` as a :class:`~moe_overlap.PreprocessableModel` or raise, naming what is wrong.

    Checks the members and, where the schedule reads them, their values: the two stage
    flags are bools, the hooks callable, ``config.mtp_num_layers`` ``None`` or an int, and
    the decoder has ``layers``, ``input_tensor`` and ``final_layernorm`` (which may be
    ``None`` but must exist).
    """
    name = type(model).__name__
    missing = missing_members(model, MODEL_MEMBERS)
    if missing:
        raise IntegrationError(
            f"{name} is not a PreprocessableModel; missing members: {missing}"
        )
    _expect_bool(f"{name}.pre_process", getattr(model, "pre_process"))  # noqa: B009 - checked above
    _expect_bool(f"{name}.post_process", getattr(model, "post_process"))  # noqa: B009
    _expect_callable(f"{name}._preprocess", getattr(model, "_preprocess"))  # noqa: B009
    _expect_callable(f"{name}._postprocess", getattr(model, "_postprocess"))  # noqa: B009
    config: object = getattr(model, "config")  # noqa: B009
    if not hasattr(config, "mtp_num_layers"):
        raise IntegrationError(
            f"{name}.config ({type(config).__name__}): expected a member mtp_num_layers "
            "(None or the number of MTP layers), received a config without it"
        )
    mtp: object = getattr(config, "mtp_num_layers")  # noqa: B009
    if mtp is not None and (not isinstance(mtp, int) or isinstance(mtp, bool) or mtp < 0):
        raise IntegrationError(
            f"{name}.config.mtp_num_layers: expected None or an int >= 0, received {_kind(mtp)}"
        )
    decoder: object = getattr(model, "decoder")  # noqa: B009
    missing = missing_members(decoder, DECODER_MEMBERS)
    if missing:
        raise IntegrationError(
            f"{name}.decoder ({type(decoder).__name__}) is not a decoder; missing members: "
            f"{missing}; {_DECODER_HELP}"
        )
    layers: object = getattr(decoder, "layers")  # noqa: B009
    if not (hasattr(layers, "__len__") and hasattr(layers, "__iter__")):
        raise IntegrationError(
            f"{name}.decoder.layers: expected a sized iterable of layers (e.g. an "
            f"nn.ModuleList), received {type(layers).__name__}"
        )
    input_tensor: object = getattr(decoder, "input_tensor")  # noqa: B009
    if input_tensor is not None and not isinstance(input_tensor, Tensor):
        raise IntegrationError(
            f"{name}.decoder.input_tensor: expected None or a Tensor (the previous stage's "
            f"output), received {type(input_tensor).__name__}"
        )
    norm: object = getattr(decoder, "final_layernorm")  # noqa: B009
    if norm is not None and not callable(norm):
        raise IntegrationError(
            f"{name}.decoder.final_layernorm: expected None or a callable norm, "
            f"received {type(norm).__name__}"
        )
    return cast(PreprocessableModel, model)


def check_free_input_config(config: object, where: str) -> FreeInputConfig:
    """Return ``config`` as a :class:`~moe_overlap.FreeInputConfig` or raise, naming the field."""
    missing = missing_members(config, FREE_INPUT_FIELDS)
    if missing:
        raise IntegrationError(
            f"{where} ({type(config).__name__}): expected the free-input fields "
            f"{list(FREE_INPUT_FIELDS)}; missing: {missing}"
        )
    kind: object = getattr(config, "moe_token_dispatcher_type")  # noqa: B009
    if kind not in DISPATCHER_TYPES:
        raise ConfigError(
            f"{where}.moe_token_dispatcher_type: expected one of {list(DISPATCHER_TYPES)}, "
            f"received {_kind(kind)}"
        )
    backend: object = getattr(config, "moe_flex_dispatcher_backend")  # noqa: B009
    if kind == "flex" and backend not in DISPATCHER_BACKENDS:
        raise ConfigError(
            f"{where}.moe_flex_dispatcher_backend: expected one of {list(DISPATCHER_BACKENDS)} "
            f"with the flex dispatcher, received {_kind(backend)}"
        )
    graphed: object = getattr(config, "cuda_graph_modules")  # noqa: B009
    if not isinstance(graphed, Iterable) or isinstance(graphed, (str, bytes)):
        raise ConfigError(
            f"{where}.cuda_graph_modules: expected a collection of scope names "
            f"(CudaGraphModule members or strings), received {_kind(graphed)}"
        )
    return cast(FreeInputConfig, config)


def check_layer(layer: object, where: str) -> SchedulableLayer:
    """Return ``layer`` as a :class:`~moe_overlap.SchedulableLayer` or raise, naming what is wrong."""
    missing = missing_members(layer, LAYER_MEMBERS)
    if missing:
        raise IntegrationError(
            f"{where}: {type(layer).__name__} is not a SchedulableLayer; missing members: {missing}"
        )
    cls = type(layer).__name__
    is_moe: object = getattr(layer, "is_moe")  # noqa: B009 - checked above
    _expect_bool(f"{where}: {cls}.is_moe", is_moe)
    nle: object = getattr(layer, "num_local_experts")  # noqa: B009
    if nle is not None and (not isinstance(nle, int) or isinstance(nle, bool) or nle < 1):
        raise IntegrationError(
            f"{where}: {cls}.num_local_experts: expected None or an int >= 1, "
            f"received {_kind(nle)}"
        )
    for slot in SLOTS if is_moe else SLOTS[::2]:
        _expect_callable(f"{where}: {cls}.{slot}", getattr(layer, slot))
    check_free_input_config(getattr(layer, "config"), f"{where}: {cls}.config")  # noqa: B009
    return cast(SchedulableLayer, layer)


def check_wgrad_layers(modules: object, where: str) -> list[WgradLayer]:
    """``modules`` as a list of :class:`~moe_overlap.WgradLayer` s, or raise naming the first bad one."""
    if not isinstance(modules, Sequence) or isinstance(modules, (str, bytes)):
        raise IntegrationError(
            f"{where}: expected a sequence of WgradLayers, received {type(modules).__name__}"
        )
    items = cast("Sequence[object]", modules)
    for i, module in enumerate(items):
        check_wgrad_layer(module, f"{where}[{i}]")
    return cast("list[WgradLayer]", list(items))


def check_wgrad_layer(module: object, where: str) -> WgradLayer:
    """``module`` as a :class:`~moe_overlap.WgradLayer` (``backward_dw()`` and ``parameters()``)."""
    missing = missing_members(module, ("backward_dw", "parameters"))
    if missing:
        raise IntegrationError(
            f"{where}: {type(module).__name__} is not a WgradLayer (a module whose weight "
            f"gradients backward_dw() computes); missing members: {missing}"
        )
    return cast(WgradLayer, module)


def as_mtp_layer(layer: SchedulableLayer) -> MtpSchedulableLayer | None:
    """``layer`` as an MTP layer when it has the MTP post-process slot, else ``None``."""
    if missing_members(layer, ("slot_mtp_post_process",)):
        return None
    return cast(MtpSchedulableLayer, layer)
