"""Building blocks for integrations: the parts a schedulable MoE model needs.

- transformer parts: :class:`RMSNorm`, rotary tables (:func:`rotary_tables`,
  :func:`apply_rotary`), causal :class:`SelfAttention`, :class:`SwiGLUMLP` and the routed
  :class:`GroupedExperts`, their projections delayed-wgrad linears;
- delayed weight gradients: :class:`DelayedWgradLinear`, :class:`DelayedWgradGroupedLinear`
  (rows per group as :class:`GroupSizes`, or capacity-padded; their base
  :class:`DelayedWgradModule`), and the model-wide :func:`finish_wgrad` and
  :func:`discard_wgrad` (what a model still owes: :func:`moe_overlap.wgrad.owed_wgrad`,
  :func:`moe_overlap.wgrad.check_wgrad_done`);
- routing: :class:`TopKRouter` (softmax or sigmoid scores, a selection bias, group-limited
  top-k, renormalization, the load-balancing loss through :func:`attach_aux_loss`);
- token movement: :class:`TokenDispatcher` permutes copies by expert (:class:`PermuteMeta`,
  frozen, handed from pre-dispatch to combine), plans the exchange there (:class:`DispatchMeta`;
  the counts' copy to the host queued as :class:`HostCounts`, awaited in the dispatch slot at
  EP>1 only), moves them over the expert-parallel group or a one-device
  :class:`HostLoopback` (:func:`loopback` as an autograd op), and back; with ``chunks=K``
  in ``K`` token groups (:func:`chunk_sizes`), the next group's all-to-all under this
  group's experts;
- masks: :func:`check_attention_mask` / :func:`check_padding_mask` (Megatron-Core's
  conventions: a bool ``[B or 1, 1, S or 1, S]`` attention mask, ``True`` = not attended; a
  bool ``[B, S]`` padding mask, ``True`` = padding), :func:`blocked_keys` (both with
  causality: what :class:`SelfAttention` masks out, :class:`BlockedKeys`),
  :func:`token_padding` (the padding per token, for :class:`TopKRouter`);
- slots: :class:`SlotContext` (what a slot sees of its node) and :class:`PlainContext`, its
  stand-in on the plain path, so one function serves both; :meth:`TokenDispatcher.slot_permute`
  and its three siblings are the dispatcher's steps as slots call them; :func:`add_residual`
  ends a combine; :class:`DenseSlots` gives a dense layer its pass-through dispatch/combine and :class:`MoESlots`
  a MoE layer its four slots and plain path from four steps;
- CUDA graphs: :class:`GraphedBlock` runs a static-shape part (attention, router, a dense
  MLP) as captured forward, backward and weight-gradient graphs, one copy per microbatch in
  flight, bit-identical to eager;
- the model's hooks: :class:`MegatronHooks` implements ``_preprocess`` / ``_postprocess``
  with Megatron-Core's names on top of ``embed`` / ``rotary`` / ``output``;
- pipeline stages: :class:`StageRange` (a stage's place in the model) and
  :class:`StageLayers`, a layer list named by the layers' global indices, so a stage's
  ``state_dict`` keys are the full model's.

The reference model (:mod:`moe_overlap.models`) and the transformers adapter are built on
them.
"""

from moe_overlap.blocks._a2a_chunks import chunk_sizes as chunk_sizes
from moe_overlap.blocks._delayed_linear import (
    DelayedWgradGroupedLinear as DelayedWgradGroupedLinear,
)
from moe_overlap.blocks._delayed_linear import DelayedWgradLinear as DelayedWgradLinear
from moe_overlap.blocks._delayed_linear import DelayedWgradModule as DelayedWgradModule
from moe_overlap.blocks._delayed_linear import DenseKernel as DenseKernel
from moe_overlap.blocks._delayed_linear import GroupedKernel as GroupedKernel
from moe_overlap.blocks._delayed_linear import GroupSizes as GroupSizes
from moe_overlap.blocks._delayed_linear import MatmulKernel as MatmulKernel
from moe_overlap.blocks._delayed_linear import PendingItem as PendingItem
from moe_overlap.blocks._delayed_linear import accumulate_grad as accumulate_grad
from moe_overlap.blocks._delayed_linear import discard_wgrad as discard_wgrad
from moe_overlap.blocks._delayed_linear import finish_wgrad as finish_wgrad
from moe_overlap.blocks._dispatch_meta import Combine as Combine
from moe_overlap.blocks._dispatch_meta import CopyOrder as CopyOrder
from moe_overlap.blocks._dispatch_meta import DispatchMeta as DispatchMeta
from moe_overlap.blocks._dispatch_meta import Gathered as Gathered
from moe_overlap.blocks._dispatch_meta import HostCounts as HostCounts
from moe_overlap.blocks._dispatch_meta import PermuteMeta as PermuteMeta
from moe_overlap.blocks._dispatcher import DispatcherKind as DispatcherKind
from moe_overlap.blocks._dispatcher import TokenDispatcher as TokenDispatcher
from moe_overlap.blocks._experts import GroupedExperts as GroupedExperts
from moe_overlap.blocks._graphs import GraphedBlock as GraphedBlock
from moe_overlap.blocks._loopback import HostLoopback as HostLoopback
from moe_overlap.blocks._loopback import LoopbackMode as LoopbackMode
from moe_overlap.blocks._loopback import loopback as loopback
from moe_overlap.blocks._masks import BlockedKeys as BlockedKeys
from moe_overlap.blocks._masks import blocked_keys as blocked_keys
from moe_overlap.blocks._masks import check_attention_mask as check_attention_mask
from moe_overlap.blocks._masks import check_masks as check_masks
from moe_overlap.blocks._masks import check_padding_mask as check_padding_mask
from moe_overlap.blocks._masks import token_padding as token_padding
from moe_overlap.blocks._model import MegatronHooks as MegatronHooks
from moe_overlap.blocks._model import PlainLayer as PlainLayer
from moe_overlap.blocks._model import Rotary as Rotary
from moe_overlap.blocks._model import StageRange as StageRange
from moe_overlap.blocks._recompute import RecomputePart as RecomputePart
from moe_overlap.blocks._recompute import RecomputeParts as RecomputeParts
from moe_overlap.blocks._recompute import check_recompute as check_recompute
from moe_overlap.blocks._recompute import recompute as recompute
from moe_overlap.blocks._recompute import recompute_module as recompute_module
from moe_overlap.blocks._recompute import save_matmuls as save_matmuls
from moe_overlap.blocks._router import ScoreFunction as ScoreFunction
from moe_overlap.blocks._router import TopKRouter as TopKRouter
from moe_overlap.blocks._router import attach_aux_loss as attach_aux_loss
from moe_overlap.blocks._slots import DenseSlots as DenseSlots
from moe_overlap.blocks._slots import MoESlots as MoESlots
from moe_overlap.blocks._slots import PlainContext as PlainContext
from moe_overlap.blocks._slots import SlotContext as SlotContext
from moe_overlap.blocks._slots import add_residual as add_residual
from moe_overlap.blocks._slots import pair_input as pair_input
from moe_overlap.blocks._slots import single_input as single_input
from moe_overlap.blocks._stage_layers import StageLayers as StageLayers
from moe_overlap.blocks._transformer import RMSNorm as RMSNorm
from moe_overlap.blocks._transformer import RotaryTables as RotaryTables
from moe_overlap.blocks._transformer import SelfAttention as SelfAttention
from moe_overlap.blocks._transformer import SwiGLUMLP as SwiGLUMLP
from moe_overlap.blocks._transformer import apply_rotary as apply_rotary
from moe_overlap.blocks._transformer import rotary_tables as rotary_tables
from moe_overlap.blocks._transformer import swiglu as swiglu

__all__ = [
    "BlockedKeys",
    "Combine",
    "CopyOrder",
    "DelayedWgradGroupedLinear",
    "DelayedWgradLinear",
    "DelayedWgradModule",
    "DenseKernel",
    "DenseSlots",
    "DispatchMeta",
    "DispatcherKind",
    "Gathered",
    "GraphedBlock",
    "GroupSizes",
    "GroupedExperts",
    "GroupedKernel",
    "HostCounts",
    "HostLoopback",
    "LoopbackMode",
    "MatmulKernel",
    "MegatronHooks",
    "MoESlots",
    "PendingItem",
    "PermuteMeta",
    "PlainContext",
    "PlainLayer",
    "RMSNorm",
    "RecomputePart",
    "RecomputeParts",
    "Rotary",
    "RotaryTables",
    "ScoreFunction",
    "SelfAttention",
    "SlotContext",
    "StageLayers",
    "StageRange",
    "SwiGLUMLP",
    "TokenDispatcher",
    "TopKRouter",
    "accumulate_grad",
    "add_residual",
    "apply_rotary",
    "attach_aux_loss",
    "blocked_keys",
    "check_attention_mask",
    "check_masks",
    "check_padding_mask",
    "check_recompute",
    "chunk_sizes",
    "discard_wgrad",
    "finish_wgrad",
    "loopback",
    "pair_input",
    "recompute",
    "recompute_module",
    "rotary_tables",
    "save_matmuls",
    "single_input",
    "swiglu",
    "token_padding",
]
