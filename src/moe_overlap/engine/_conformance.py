"""Checking an integration once, at plan construction, member by member.

Everything the schedule will touch is looked up here, before any tensor runs, so a missing
or wrongly typed member fails with the member's name instead of an ``AttributeError`` deep
inside a slot.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Iterable, Sequence
from typing import NoReturn, cast

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
    "Indexed",
    "already_checked",
    "as_mtp_layer",
    "check_free_input_config",
    "check_layer",
    "check_model",
    "check_wgrad_layers",
    "checks_memoized",
    "missing_members",
    "named",
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


_MISSING = object()

# While a combined_1f1b call runs, an object that passed its check is not checked again for
# the next microbatch's plan: {id: the object} (held, so its id cannot be reused).
_memo: dict[int, object] | None = None
_depth = 0


@contextlib.contextmanager
def checks_memoized() -> Generator[None, None, None]:
    """Check each model, layer and wgrad module once for all the plans built inside."""
    global _memo, _depth
    if _depth == 0:
        _memo = {}
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            _memo = None


def already_checked(obj: object) -> bool:
    memo = _memo
    return memo is not None and memo.get(id(obj)) is obj


def _remember(obj: object) -> None:
    memo = _memo
    if memo is not None:
        memo[id(obj)] = obj


def _kind(value: object) -> str:
    if isinstance(value, (int, float, str)):
        return f"{type(value).__name__} {value!r}"
    return type(value).__name__


def _is_count(value: object, low: int) -> bool:
    return type(value) is int and value >= low  # bool is not an int here


def check_model(model: object) -> PreprocessableModel:
    """Return ``model`` as a :class:`~moe_overlap.PreprocessableModel` or raise, naming what is wrong.

    Checks the members and, where the schedule reads them, their values: the two stage
    flags are bools, the hooks callable, ``config.mtp_num_layers`` ``None`` or an int, and
    the decoder has ``layers``, ``input_tensor`` and ``final_layernorm`` (which may be
    ``None`` but must exist). The fast path formats no message; runs once per plan, or
    once per :func:`checks_memoized` block.
    """
    if already_checked(model):
        return cast(PreprocessableModel, model)
    pre, post, config, decoder, prep, postp = (getattr(model, m, _MISSING) for m in MODEL_MEMBERS)
    layers = getattr(decoder, "layers", _MISSING)
    tensor = getattr(decoder, "input_tensor", _MISSING)
    norm = getattr(decoder, "final_layernorm", _MISSING)
    mtp = getattr(config, "mtp_num_layers", _MISSING)
    if not (
        type(pre) is bool
        and type(post) is bool
        and callable(prep)
        and callable(postp)
        and (mtp is None or _is_count(mtp, 0))
        and hasattr(layers, "__len__")
        and hasattr(layers, "__iter__")
        and (tensor is None or isinstance(tensor, Tensor))
        and (norm is None or (norm is not _MISSING and callable(norm)))
    ):
        _model_error(model)
    _remember(model)
    return cast(PreprocessableModel, model)


def _model_error(model: object) -> NoReturn:
    """Raise the :class:`~moe_overlap.IntegrationError` that names what ``model`` gets wrong."""
    name = type(model).__name__
    missing = missing_members(model, MODEL_MEMBERS)
    if missing:
        raise IntegrationError(f"{name} is not a PreprocessableModel; missing members: {missing}")
    for flag in ("pre_process", "post_process"):
        value: object = getattr(model, flag)
        if type(value) is not bool:
            raise IntegrationError(f"{name}.{flag}: expected a bool, received {_kind(value)}")
    for hook in ("_preprocess", "_postprocess"):
        value = getattr(model, hook)
        if not callable(value):
            raise IntegrationError(f"{name}.{hook}: expected a callable, received {_kind(value)}")
    config: object = getattr(model, "config")  # noqa: B009 - typed object, checked above
    if not hasattr(config, "mtp_num_layers"):
        raise IntegrationError(
            f"{name}.config ({type(config).__name__}): expected a member mtp_num_layers "
            "(None or the number of MTP layers), received a config without it"
        )
    mtp: object = getattr(config, "mtp_num_layers")  # noqa: B009
    if not (mtp is None or _is_count(mtp, 0)):
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
    tensor: object = getattr(decoder, "input_tensor")  # noqa: B009
    if tensor is not None and not isinstance(tensor, Tensor):
        raise IntegrationError(
            f"{name}.decoder.input_tensor: expected None or a Tensor (the previous stage's "
            f"output), received {type(tensor).__name__}"
        )
    norm: object = getattr(decoder, "final_layernorm")  # noqa: B009
    raise IntegrationError(
        f"{name}.decoder.final_layernorm: expected None or a callable norm, "
        f"received {type(norm).__name__}"
    )


def _config_ok(config: object) -> bool:
    kind = getattr(config, "moe_token_dispatcher_type", _MISSING)
    backend = getattr(config, "moe_flex_dispatcher_backend", _MISSING)
    graphed = getattr(config, "cuda_graph_modules", _MISSING)
    return (
        kind in DISPATCHER_TYPES
        and (kind != "flex" or backend in DISPATCHER_BACKENDS)
        and backend is not _MISSING
        and hasattr(config, "fp8")
        and hasattr(config, "fp4")
        and isinstance(graphed, (tuple, list, frozenset, set, Iterable))
        and not isinstance(graphed, (str, bytes))
    )


def check_free_input_config(config: object, where: str) -> FreeInputConfig:
    """Return ``config`` as a :class:`~moe_overlap.FreeInputConfig` or raise, naming the field."""
    if _config_ok(config):
        return cast(FreeInputConfig, config)
    kind = getattr(config, "moe_token_dispatcher_type", _MISSING)
    backend = getattr(config, "moe_flex_dispatcher_backend", _MISSING)
    graphed = getattr(config, "cuda_graph_modules", _MISSING)
    missing = missing_members(config, FREE_INPUT_FIELDS)
    if missing:
        raise IntegrationError(
            f"{where} ({type(config).__name__}): expected the free-input fields "
            f"{list(FREE_INPUT_FIELDS)}; missing: {missing}"
        )
    if kind not in DISPATCHER_TYPES:
        raise ConfigError(
            f"{where}.moe_token_dispatcher_type: expected one of {list(DISPATCHER_TYPES)}, "
            f"received {_kind(kind)}"
        )
    if kind == "flex" and backend not in DISPATCHER_BACKENDS:
        raise ConfigError(
            f"{where}.moe_flex_dispatcher_backend: expected one of {list(DISPATCHER_BACKENDS)} "
            f"with the flex dispatcher, received {_kind(backend)}"
        )
    raise ConfigError(
        f"{where}.cuda_graph_modules: expected a collection of scope names "
        f"(CudaGraphModule members or strings), received {_kind(graphed)}"
    )


def check_layer(layer: object, where: str | Callable[[], str]) -> SchedulableLayer:
    """Return ``layer`` as a :class:`~moe_overlap.SchedulableLayer` or raise, naming what is wrong.

    ``config`` must carry the free-input fields (:func:`check_free_input_config`),
    ``is_moe`` be a bool, ``num_local_experts`` ``None`` or an int >= 1, and the slots the
    schedule will call (all four for MoE layers, pre-dispatch and mlp for dense ones)
    callable. ``where`` names the layer in errors (a callable is called only then).
    """
    if already_checked(layer):
        return cast(SchedulableLayer, layer)
    values = [getattr(layer, m, _MISSING) for m in LAYER_MEMBERS]
    config, is_moe, nle, pre, dispatch, mlp, combine = values[:7]
    if not (
        all(v is not _MISSING for v in values)
        and type(is_moe) is bool
        and (nle is None or _is_count(nle, 1))
        and callable(pre)
        and callable(mlp)
        and (not is_moe or (callable(dispatch) and callable(combine)))
    ):
        _layer_error(layer, named(where))
    if not _config_ok(config):
        check_free_input_config(config, f"{named(where)}: {type(layer).__name__}.config")
    _remember(layer)
    return cast(SchedulableLayer, layer)


def _layer_error(layer: object, where: str) -> NoReturn:
    """Raise the :class:`~moe_overlap.IntegrationError` that names what ``layer`` gets wrong."""
    missing = missing_members(layer, LAYER_MEMBERS)
    if missing:
        raise IntegrationError(
            f"{where}: {type(layer).__name__} is not a SchedulableLayer; missing members: {missing}"
        )
    cls = type(layer).__name__
    is_moe: object = getattr(layer, "is_moe")  # noqa: B009 - checked above
    if type(is_moe) is not bool:
        raise IntegrationError(f"{where}: {cls}.is_moe: expected a bool, received {_kind(is_moe)}")
    nle: object = getattr(layer, "num_local_experts")  # noqa: B009
    if not (nle is None or _is_count(nle, 1)):
        raise IntegrationError(
            f"{where}: {cls}.num_local_experts: expected None or an int >= 1, received {_kind(nle)}"
        )
    for slot in SLOTS if is_moe else SLOTS[::2]:
        value: object = getattr(layer, slot)
        if not callable(value):
            raise IntegrationError(
                f"{where}: {cls}.{slot}: expected a callable, received {_kind(value)}"
            )
    raise AssertionError("unreachable: _layer_error found nothing wrong")


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
        if not already_checked(module):
            check_wgrad_layer(module, Indexed(name, i, ""))
    return cast("list[WgradLayer]", items)


def named(where: str | Callable[[], str]) -> str:
    """The name an error message gives: ``where`` itself, or what the callable formats."""
    return where if isinstance(where, str) else where()


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
    missing = missing_members(module, ("backward_dw", "parameters"))
    if missing:
        raise IntegrationError(
            f"{named(where)}: {type(module).__name__} is not a WgradLayer (a module whose weight "
            f"gradients backward_dw() computes); missing members: {missing}"
        )
    _remember(module)
    return cast(WgradLayer, module)


def as_mtp_layer(layer: SchedulableLayer) -> MtpSchedulableLayer | None:
    """``layer`` as an MTP layer when it has the MTP post-process slot, else ``None``."""
    if missing_members(layer, ("slot_mtp_post_process",)):
        return None
    return cast(MtpSchedulableLayer, layer)
