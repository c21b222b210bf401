"""Checking an integration once, at plan construction, member by member."""

from __future__ import annotations

from typing import cast

from ._errors import IntegrationError
from ._protocols import MtpSchedulableLayer, PreprocessableModel, SchedulableLayer

__all__ = ["as_mtp_layer", "check_layer", "check_model", "missing_members"]

MODEL_MEMBERS = ("pre_process", "post_process", "config", "decoder", "_preprocess", "_postprocess")
LAYER_MEMBERS = (
    "config",
    "is_moe",
    "num_local_experts",
    "slot_pre_dispatch",
    "slot_dispatch",
    "slot_mlp",
    "slot_combine",
    "pre_dispatch_wgrad",
    "mlp_wgrad",
)


def missing_members(obj: object, members: tuple[str, ...]) -> list[str]:
    """The ``members`` that ``obj`` lacks, looked up dynamically.

    ``isinstance`` against a runtime-checkable Protocol looks attributes up statically on
    Python 3.12+, so it misses ``torch.nn.Module`` submodules (kept in ``_modules`` and
    served by ``__getattr__``); integrations are checked with this instead, once per plan.
    """
    return [m for m in members if not hasattr(obj, m)]


def check_model(model: object) -> PreprocessableModel:
    """Return ``model`` as a :class:`~moe_overlap.PreprocessableModel` or raise, naming what is missing."""
    missing = missing_members(model, MODEL_MEMBERS)
    if missing:
        raise IntegrationError(
            f"{type(model).__name__} is not a PreprocessableModel; missing members: {missing}"
        )
    return cast(PreprocessableModel, model)


def check_layer(layer: object, where: str) -> SchedulableLayer:
    """Return ``layer`` as a :class:`~moe_overlap.SchedulableLayer` or raise, naming what is missing."""
    missing = missing_members(layer, LAYER_MEMBERS)
    if missing:
        raise IntegrationError(
            f"{where}: {type(layer).__name__} is not a SchedulableLayer; missing members: {missing}"
        )
    return cast(SchedulableLayer, layer)


def as_mtp_layer(layer: SchedulableLayer) -> MtpSchedulableLayer | None:
    """``layer`` as an MTP layer when it has the MTP post-process slot, else ``None``."""
    if missing_members(layer, ("slot_mtp_post_process",)):
        return None
    return cast(MtpSchedulableLayer, layer)
