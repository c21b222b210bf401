"""Every Protocol of the library, and the value types they hand through.

What a model, a layer and their parts implement. Keyword names mirror Megatron-Core 0.19's
``GPTModel`` so a Megatron model is structurally a :class:`PreprocessableModel`;
``typing_tests/`` proves it against the stubs in ``stubs/``.

A layer is cut into four slots that run, in forward order::

    pre_dispatch (compute) -> dispatch (comm) -> mlp (compute) -> combine (comm)

Each slot is a method ``slot_*(node, inputs) -> outputs``: ``node`` is a
:class:`SlotContext` (the :class:`~moe_overlap.TransformerLayerNode` running it on the
schedule; read ``node.chunk_state`` for the attention mask and rotary embeddings, keep
per-microbatch values in ``node.layer_state``, and pass a tensor to a later slot with
``node.detach(t)``); ``inputs`` are the previous slot's outputs. Dense layers (``is_moe``
false) have no dispatch/combine: their pre-dispatch output goes straight to ``slot_mlp``,
whose output is the layer's output.

Each runtime Protocol has one rule table (:mod:`moe_overlap.engine.contracts`):
``contract_of(P).error(obj)`` says what ``obj`` lacks, in the words plans use.

The Protocols are defined here. At import this module loads nothing of the package (its
other names are for annotations only), so the schedule core (``engine/core``) imports it,
and debug mode loads it before installing beartype and tells beartype to leave Protocol
checks to plan construction (see ``moe_overlap/engine/_debug.py``). ``Contract`` and
``contract_of`` stand on the core: they are read from :mod:`moe_overlap.engine.contracts`
on first use, and documented there.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

from torch import Tensor
from torch.nn import Parameter

if TYPE_CHECKING:  # annotations only; loading them would import the schedule core
    from moe_overlap.engine.contracts import Contract as Contract
    from moe_overlap.engine.contracts import contract_of as contract_of
    from moe_overlap.engine.core._state import ChunkState, LayerState
    from moe_overlap.engine.core._steps import Step
    from moe_overlap.engine.core._streams import AnyStream

__all__ = [
    "CudaGraphModule",
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
]

_RULE_TABLES = frozenset({"Contract", "contract_of"})


def __getattr__(name: str) -> object:
    """``Contract`` and ``contract_of``, read from :mod:`moe_overlap.engine.contracts` when
    first asked for: the rule tables import the schedule core, which imports this module."""
    if name not in _RULE_TABLES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from moe_overlap.engine.contracts import Contract, contract_of

    value: object = {"Contract": Contract, "contract_of": contract_of}[name]
    globals()[name] = value
    return value


class CudaGraphModule(str, enum.Enum):
    """Scopes of a layer that CUDA graphs can capture (Megatron-Core's member names)."""

    attn = "attn"
    mlp = "mlp"
    moe = "moe"
    moe_router = "moe_router"
    moe_preprocess = "moe_preprocess"
    mamba = "mamba"


@runtime_checkable
class WgradLayer(Protocol):
    """A module whose weight gradients are computed late, by ``backward_dw()``.

    :meth:`TransformerLayerNode.backward_dw <moe_overlap.TransformerLayerNode.backward_dw>`
    calls ``backward_dw()`` and then the ``post_wgrad_grad_acc_hook`` of each parameter
    that has one (collected once from ``parameters()``).
    """

    def backward_dw(self) -> None: ...
    def parameters(self) -> Iterator[Parameter]: ...


@runtime_checkable
class HoldsDelayedModules(Protocol):
    """A :class:`WgradLayer` that computes the delayed weight gradients of modules it holds
    without being an ``nn.Module`` that contains them (a group of linears, an experts'
    weights): ``delayed_modules()`` names them.

    A schedule claims what its layers list, and the submodules of what is an
    ``nn.Module``; a delayed module claimed by nothing computes its weight gradient in
    backward (:mod:`moe_overlap.wgrad`). A listed part that is neither must name its
    modules here, or they would compute at once and its ``backward_dw()`` find nothing.
    """

    def delayed_modules(self) -> Sequence[object]: ...


class WgradScope(NamedTuple):
    """A pre-dispatch wgrad module and the CUDA-graph scope that covers it."""

    scope: CudaGraphModule
    module: WgradLayer


@runtime_checkable
class PendingWgrad(Protocol):
    """A delayed-wgrad module that can say how many weight gradients it still owes.

    Optional beside :class:`WgradLayer`: :func:`~moe_overlap.combined_1f1b` (and
    :func:`~moe_overlap.wgrad.check_wgrad_done`) read ``pending_wgrad`` of every module of the
    model (and every part its layers list) that has it, and raise
    :class:`~moe_overlap.WgradError` when one is owed at the start or the end of a step —
    e.g. a module that delays but is not listed by its layer's ``pre_dispatch_wgrad()`` /
    ``mlp_wgrad()``, whose gradient would otherwise be silently missing.

    One definition: a read-only ``int`` property (``>= 0``), on modules, layers and models
    alike (an aggregate's count is the sum of its parts'). A member of that name that is
    not an ``int`` (a method, ``None``, a bool) is an
    :class:`~moe_overlap.IntegrationError` naming the module, not a count of zero.
    """

    @property
    def pending_wgrad(self) -> int: ...


@runtime_checkable
class ModelConfigLike(Protocol):
    """The model configuration fields the pre/post-process nodes read."""

    @property
    def mtp_num_layers(self) -> int | None: ...


@runtime_checkable
class LayerListLike(Protocol):
    """``decoder.layers``: a sized iterable of layers (``torch.nn.ModuleList`` is one)."""

    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[object]: ...


@runtime_checkable
class DecoderLike(Protocol):
    """The decoder block: its layers, its pipeline input and its optional final norm."""

    @property
    def layers(self) -> LayerListLike: ...
    @property
    def input_tensor(self) -> Tensor | None: ...
    @property
    def final_layernorm(self) -> Callable[[Tensor], Tensor] | None: ...


@runtime_checkable
class PreprocessableModel(Protocol):
    """What :class:`~moe_overlap.PreProcessNode` and :class:`~moe_overlap.PostProcessNode` use.

    ``packed_seq_params`` is typed ``Any``: the schedule only passes it through, and a
    narrower type would reject Megatron-Core's ``PackedSeqParams``.

    ``_preprocess`` returns the 6-tuple described by :class:`~moe_overlap.PreprocessOutput`
    (a plain tuple is accepted and checked). ``_postprocess`` returns the scalar loss when
    ``labels`` are given; the schedule calls it with ``mtp_in_postprocess=False``.
    """

    @property
    def pre_process(self) -> bool: ...
    @property
    def post_process(self) -> bool: ...
    @property
    def config(self) -> ModelConfigLike: ...
    @property
    def decoder(self) -> DecoderLike: ...

    def _preprocess(
        self,
        input_ids: Tensor | None,
        position_ids: Tensor | None,
        *,
        decoder_input: Tensor | None = None,
        packed_seq_params: Any = None,
        padding_mask: Tensor | None = None,
    ) -> tuple[object, ...]: ...

    def _postprocess(
        self,
        hidden_states: Tensor,
        input_ids: Tensor | None,
        position_ids: Tensor | None,
        labels: Tensor | None,
        rotary_pos_emb: Tensor | None,
        rotary_pos_cos: Tensor | None,
        rotary_pos_sin: Tensor | None,
        *,
        mtp_in_postprocess: bool | None = None,
        loss_mask: Tensor | None = None,
        decoder_input: Tensor | None = None,
        attention_mask: Tensor | None = None,
        packed_seq_params: Any = None,
        sequence_len_offset: Tensor | None = None,
        runtime_gather_output: bool | None = None,
        extra_block_kwargs: Mapping[str, object] | None = None,
        output_processor: Callable[..., object] | None = None,
        output_processor_context: object | None = None,
    ) -> Tensor: ...


@runtime_checkable
class DeclaresInputs(Protocol):
    """A model that says which optional microbatch inputs it reads (an optional member).

    ``microbatch_inputs`` names the fields of :class:`~moe_overlap.Microbatch` (and the
    plan's ``output_processor`` / ``output_processor_context``) that the model honours, e.g.
    ``frozenset({"position_ids", "labels", "loss_mask"})``. Every plan refuses, when it is
    built, an input that is set (not ``None``; a non-empty mapping for
    ``extra_block_kwargs``) but not listed: :class:`~moe_overlap.ConfigError` naming the
    field and the model. ``input_ids`` and ``decoder_input`` (the chunk's input) are always
    read. A model without the member is taken to read
    :data:`~moe_overlap.inputs.DEFAULT_INPUTS` (``position_ids``, ``labels``): what every
    ``PreprocessableModel``'s hooks take positionally. See :func:`~moe_overlap.inputs.check_inputs`.
    """

    @property
    def microbatch_inputs(self) -> Collection[str]: ...


@runtime_checkable
class ValidatesInputs(Protocol):
    """A model that checks a microbatch's inputs when a plan is built (an optional member).

    ``validate_inputs(state)`` gets the plan's :class:`~moe_overlap.ChunkState`, holding the
    microbatch's inputs (nothing computed yet), after the :class:`DeclaresInputs` check:
    raise :class:`~moe_overlap.ConfigError` naming the field for a wrong shape, dtype or
    combination. It must not change the state and should not wait for the device.
    """

    def validate_inputs(self, state: ChunkState, /) -> None: ...


@runtime_checkable
class FreeInputConfig(Protocol):
    """The configuration fields :func:`~moe_overlap.should_free_input` reads.

    Megatron-Core's ``TransformerConfig`` satisfies it, and so does any object with these
    attributes. ``cuda_graph_modules`` members are judged by name, so
    :class:`~moe_overlap.CudaGraphModule`, plain strings and Megatron's own int-valued enum all work.
    """

    @property
    def moe_token_dispatcher_type(self) -> str: ...
    @property
    def moe_flex_dispatcher_backend(self) -> str | None: ...
    @property
    def fp8(self) -> object: ...
    @property
    def fp4(self) -> object: ...
    @property
    def cuda_graph_modules(self) -> Iterable[object]: ...


@runtime_checkable
class StreamProvider(Protocol):
    """A zero-argument callable returning the stream a node runs on."""

    def __call__(self) -> AnyStream: ...


@runtime_checkable
class SlotContext(Protocol):
    """What a slot reads from its node; :class:`~moe_overlap.TransformerLayerNode` is one.

    Writing a layer's math against this (not the node) lets the plain path run the very
    same code with a :class:`~moe_overlap.blocks.PlainContext`.
    """

    @property
    def layer_state(self) -> LayerState: ...
    @property
    def chunk_state(self) -> ChunkState: ...
    def detach(self, t: Tensor) -> Tensor: ...
    def mark_non_differentiable(self, *tensors: Tensor) -> None: ...


@runtime_checkable
class SlotFn(Protocol):
    """A slot's forward: gets its node (state, ``detach``) and its inputs, returns outputs."""

    def __call__(
        self, node: SlotContext, inputs: tuple[Tensor, ...], /
    ) -> Tensor | tuple[Tensor, ...]: ...


@runtime_checkable
class SchedulableLayer(Protocol):
    """A layer the schedule can split into slots.

    The four slots run, in forward order, ``pre_dispatch`` (compute stream), ``dispatch``
    (comm stream), ``mlp`` (compute), ``combine`` (comm). Each ``slot_*(node, inputs)``
    gets a :class:`SlotContext` (the :class:`~moe_overlap.TransformerLayerNode` running it; read
    ``node.chunk_state`` for the attention mask and rotary embeddings, keep per-microbatch
    values in ``node.layer_state``, hand a tensor to a later slot with ``node.detach(t)``)
    and the previous slot's outputs. Dense layers (``is_moe`` false) skip dispatch and
    combine: their pre-dispatch output goes to ``slot_mlp``, whose output is the layer's.

    Members:
        config: the layer's free-input configuration.
        is_moe: true for MoE layers (dispatch/combine run on the comm stream).
        num_local_experts: experts held on this rank; ``None`` for dense layers.
        slot_*: the four slot functions.
        pre_dispatch_wgrad: modules whose weight gradients the pre-dispatch slot delays,
            each tagged with the CUDA-graph scope that covers it (attention first, then
            anything else, e.g. a shared expert); empty when nothing is delayed.
        mlp_wgrad: modules whose weight gradients the mlp slot delays (routed experts).
    """

    @property
    def config(self) -> FreeInputConfig: ...
    @property
    def is_moe(self) -> bool: ...
    @property
    def num_local_experts(self) -> int | None: ...

    def slot_pre_dispatch(
        self, node: SlotContext, inputs: tuple[Tensor, ...], /
    ) -> Tensor | tuple[Tensor, ...]: ...
    def slot_dispatch(
        self, node: SlotContext, inputs: tuple[Tensor, ...], /
    ) -> Tensor | tuple[Tensor, ...]: ...
    def slot_mlp(
        self, node: SlotContext, inputs: tuple[Tensor, ...], /
    ) -> Tensor | tuple[Tensor, ...]: ...
    def slot_combine(
        self, node: SlotContext, inputs: tuple[Tensor, ...], /
    ) -> Tensor | tuple[Tensor, ...]: ...
    def pre_dispatch_wgrad(self) -> Sequence[WgradScope]: ...
    def mlp_wgrad(self) -> Sequence[WgradLayer]: ...


@runtime_checkable
class GraphedWgradLayer(Protocol):
    """A layer whose CUDA-graphed scopes replay their own delayed weight gradients.

    ``graphed_backward_dw_callable()`` returns the replay (or ``None``: nothing graphed
    and delayed); each layer plan plugs it into its
    :class:`~moe_overlap.BackwardDWWrapper`, which then skips the eager ``backward_dw`` of
    the :class:`~moe_overlap.WgradScope` s whose scope is in ``config.cuda_graph_modules``.
    The replay must cover exactly those parts.
    """

    def graphed_backward_dw_callable(self) -> Callable[[], None] | None: ...


@runtime_checkable
class MtpSchedulableLayer(SchedulableLayer, Protocol):
    """A multi-token-prediction layer: a schedulable layer with a post-process slot."""

    def slot_mtp_post_process(
        self, node: SlotContext, inputs: tuple[Tensor, ...], /
    ) -> Tensor | tuple[Tensor, ...]: ...


@runtime_checkable
class NodeTimer(Protocol):
    """Marks the start and the end of one node's work on the stream it runs on.

    ``start`` is called once the node's wait on its microbatch's event is queued (so the
    wait is not timed) and ``stop`` right after its body is issued, before the event is
    recorded; both receive the node's stream (a :class:`~moe_overlap.streams.CpuStream` on CPU).
    A node whose step does no work (a no-op node, wgrad not delayed) calls neither; a body
    that raises leaves ``stop`` uncalled.
    """

    def start(self, stream: AnyStream) -> None: ...
    def stop(self, stream: AnyStream) -> None: ...


@runtime_checkable
class StepObserver(Protocol):
    """Watches the steps a plan runs: ``combined_1f1b(..., observer=...)``.

    Before each non-hook :class:`~moe_overlap.steps.Step` the runner asks ``timer(step,
    microbatch)`` (``microbatch`` as given to the plan running the step) for a
    :class:`~moe_overlap.steps.NodeTimer` to hand the node, or ``None`` not to time it. An
    observer sees the very step lists of :func:`~moe_overlap.steps.chunk_steps`, in order; it
    must not touch the tensors, so observed runs compute exactly what unobserved ones do.
    """

    def timer(self, step: Step, microbatch: int | None) -> NodeTimer | None: ...
