"""Which microbatch inputs a model reads: an input it does not read is refused, never ignored."""

from moe_overlap.engine._inputs import DEFAULT_INPUTS as DEFAULT_INPUTS
from moe_overlap.engine._inputs import OPTIONAL_INPUTS as OPTIONAL_INPUTS
from moe_overlap.engine._inputs import check_inputs as check_inputs
from moe_overlap.engine._inputs import read_inputs as read_inputs
from moe_overlap.protocols import DeclaresInputs as DeclaresInputs
from moe_overlap.protocols import ValidatesInputs as ValidatesInputs

__all__ = [
    "DEFAULT_INPUTS",
    "OPTIONAL_INPUTS",
    "DeclaresInputs",
    "ValidatesInputs",
    "check_inputs",
    "read_inputs",
]
