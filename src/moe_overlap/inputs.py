"""Which microbatch inputs a model reads: an input it does not read is refused, never ignored."""

from moe_overlap.engine import DEFAULT_INPUTS as DEFAULT_INPUTS
from moe_overlap.engine import OPTIONAL_INPUTS as OPTIONAL_INPUTS
from moe_overlap.engine import DeclaresInputs as DeclaresInputs
from moe_overlap.engine import ValidatesInputs as ValidatesInputs
from moe_overlap.engine import check_inputs as check_inputs
from moe_overlap.engine import read_inputs as read_inputs

__all__ = [
    "DEFAULT_INPUTS",
    "OPTIONAL_INPUTS",
    "DeclaresInputs",
    "ValidatesInputs",
    "check_inputs",
    "read_inputs",
]
