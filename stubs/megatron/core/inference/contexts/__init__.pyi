"""Inference contexts (only the base class, as a type)."""

class BaseInferenceContext:
    """State of one inference request batch; unused by training schedules."""

    def is_static_batching(self) -> bool: ...
