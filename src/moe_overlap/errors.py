"""The library's errors: one hierarchy under :class:`MoeOverlapError` (``docs/errors.md``)."""

from moe_overlap.engine import ConfigError as ConfigError
from moe_overlap.engine import IntegrationError as IntegrationError
from moe_overlap.engine import LayerStateAttributeError as LayerStateAttributeError
from moe_overlap.engine import MoeOverlapError as MoeOverlapError
from moe_overlap.engine import NodeStateError as NodeStateError
from moe_overlap.engine import PlanReleasedError as PlanReleasedError
from moe_overlap.engine import ScheduleError as ScheduleError
from moe_overlap.engine import StreamError as StreamError
from moe_overlap.engine import TypeHintError as TypeHintError
from moe_overlap.engine import WgradError as WgradError

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
