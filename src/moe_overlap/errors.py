"""The library's errors: one hierarchy under :class:`MoeOverlapError` (``docs/errors.md``)."""

from moe_overlap.engine.core._errors import ConfigError as ConfigError
from moe_overlap.engine.core._errors import IntegrationError as IntegrationError
from moe_overlap.engine.core._errors import LayerStateAttributeError as LayerStateAttributeError
from moe_overlap.engine.core._errors import MoeOverlapError as MoeOverlapError
from moe_overlap.engine.core._errors import NodeStateError as NodeStateError
from moe_overlap.engine.core._errors import PlanReleasedError as PlanReleasedError
from moe_overlap.engine.core._errors import ScheduleError as ScheduleError
from moe_overlap.engine.core._errors import StreamError as StreamError
from moe_overlap.engine.core._errors import TypeHintError as TypeHintError
from moe_overlap.engine.core._errors import WgradError as WgradError

__all__ = [
    "ConfigError",
    "IntegrationError",
    "LayerStateAttributeError",
    "MoeOverlapError",
    "NodeStateError",
    "PlanReleasedError",
    "ScheduleError",
    "StreamError",
    "TypeHintError",
    "WgradError",
]
