"""Every Protocol of the library, and the value types they hand through.

Each runtime Protocol has one rule table (:mod:`moe_overlap.engine.contracts`):
``contract_of(P).error(obj)`` says what ``obj`` lacks, in the words plans use.
"""

from moe_overlap import MtpSchedulableLayer as MtpSchedulableLayer
from moe_overlap import PendingWgrad as PendingWgrad
from moe_overlap import PreprocessableModel as PreprocessableModel
from moe_overlap import SchedulableLayer as SchedulableLayer
from moe_overlap import SlotContext as SlotContext
from moe_overlap import StreamProvider as StreamProvider
from moe_overlap import WgradLayer as WgradLayer
from moe_overlap import WgradScope as WgradScope
from moe_overlap.engine.contracts import Contract as Contract
from moe_overlap.engine.contracts import contract_of as contract_of
from moe_overlap.engine.core._protocols import DeclaresInputs as DeclaresInputs
from moe_overlap.engine.core._protocols import DecoderLike as DecoderLike
from moe_overlap.engine.core._protocols import FreeInputConfig as FreeInputConfig
from moe_overlap.engine.core._protocols import GraphedWgradLayer as GraphedWgradLayer
from moe_overlap.engine.core._protocols import HoldsDelayedModules as HoldsDelayedModules
from moe_overlap.engine.core._protocols import LayerListLike as LayerListLike
from moe_overlap.engine.core._protocols import ModelConfigLike as ModelConfigLike
from moe_overlap.engine.core._protocols import NodeTimer as NodeTimer
from moe_overlap.engine.core._protocols import SlotFn as SlotFn
from moe_overlap.engine.core._protocols import StepObserver as StepObserver
from moe_overlap.engine.core._protocols import ValidatesInputs as ValidatesInputs

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
