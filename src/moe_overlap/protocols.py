"""Every Protocol of the library, and the value types they hand through.

Each runtime Protocol has one rule table (:mod:`moe_overlap.engine.contracts`):
``contract_of(P).error(obj)`` says what ``obj`` lacks, in the words plans use.
"""

from moe_overlap.engine import DeclaresInputs as DeclaresInputs
from moe_overlap.engine import DecoderLike as DecoderLike
from moe_overlap.engine import FreeInputConfig as FreeInputConfig
from moe_overlap.engine import GraphedWgradLayer as GraphedWgradLayer
from moe_overlap.engine import HoldsDelayedModules as HoldsDelayedModules
from moe_overlap.engine import LayerListLike as LayerListLike
from moe_overlap.engine import ModelConfigLike as ModelConfigLike
from moe_overlap.engine import MtpSchedulableLayer as MtpSchedulableLayer
from moe_overlap.engine import NodeTimer as NodeTimer
from moe_overlap.engine import PendingWgrad as PendingWgrad
from moe_overlap.engine import PreprocessableModel as PreprocessableModel
from moe_overlap.engine import SchedulableLayer as SchedulableLayer
from moe_overlap.engine import SlotContext as SlotContext
from moe_overlap.engine import SlotFn as SlotFn
from moe_overlap.engine import StepObserver as StepObserver
from moe_overlap.engine import StreamProvider as StreamProvider
from moe_overlap.engine import ValidatesInputs as ValidatesInputs
from moe_overlap.engine import WgradLayer as WgradLayer
from moe_overlap.engine import WgradScope as WgradScope
from moe_overlap.engine.contracts import Contract as Contract
from moe_overlap.engine.contracts import contract_of as contract_of

__all__ = [
    "Contract",
    "DeclaresInputs",
    "DecoderLike",
    "FreeInputConfig",
    "GraphedWgradLayer",
    "HoldsDelayedModules",
    "LayerListLike",
    "ModelConfigLike",
    "MtpSchedulableLayer",
    "NodeTimer",
    "PendingWgrad",
    "PreprocessableModel",
    "SchedulableLayer",
    "SlotContext",
    "SlotFn",
    "StepObserver",
    "StreamProvider",
    "ValidatesInputs",
    "WgradLayer",
    "WgradScope",
    "contract_of",
]
