"""Typed state shared by the nodes of a chunk and of a layer.

Megatron-Core fills attribute bags at run time; here the fields are declared, so a typo is
a type error and every field has a type.
"""

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar, cast

from torch import Tensor

from moe_overlap.args import refuse
from moe_overlap.errors import IntegrationError, LayerStateAttributeError, NodeStateError
from moe_overlap.microbatch import Microbatch

__all__ = ["STATE_FIELDS", "ChunkState", "LayerState", "PreprocessOutput"]

_T = TypeVar("_T")


class PreprocessOutput(NamedTuple):
    """What a model's ``_preprocess`` returns; slots a model does not use are ``None``."""

    decoder_input: Tensor
    rotary_pos_emb: Tensor | None = None
    rotary_pos_cos: Tensor | None = None
    rotary_pos_sin: Tensor | None = None
    sequence_len_offset: Tensor | None = None
    padding_mask: Tensor | None = None


class ChunkState:
    """One microbatch's state in a chunk: its inputs, then what its pre-process made.

    Holds the frozen :class:`~moe_overlap.Microbatch`, the plan's ``output_processor`` /
    ``output_processor_context`` and, once :class:`~moe_overlap.PreProcessNode` has run,
    the :class:`~moe_overlap.PreprocessOutput` the layer nodes consume (written once: a
    second write is a :class:`~moe_overlap.NodeStateError`). Read-only properties give
    each value under Megatron-Core's ``ModelChunkState`` name: ``decoder_input`` and
    ``padding_mask`` are the preprocess output's once it exists, the microbatch's before;
    the rotary fields and ``sequence_len_offset`` are ``None`` until then. Slotted and
    weakref-able.
    """

    __slots__ = (
        "__weakref__",
        "microbatch",
        "output_processor",
        "output_processor_context",
        "preprocess_output",
    )

    microbatch: Microbatch
    output_processor: Callable[..., object] | None
    output_processor_context: object | None
    preprocess_output: PreprocessOutput | None
    """What the pre-process produced; ``None`` before it runs."""

    def __init__(
        self,
        microbatch: Microbatch,
        /,
        *,
        output_processor: Callable[..., object] | None = None,
        output_processor_context: object | None = None,
    ) -> None:
        if not isinstance(cast(object, microbatch), Microbatch):
            raise refuse(
                "ChunkState: microbatch",
                "a Microbatch (the microbatch's inputs)",
                microbatch,
                hint="build one with Microbatch(input_ids=..., labels=...)",
            )
        _set(self, "microbatch", microbatch)
        _set(self, "output_processor", output_processor)
        _set(self, "output_processor_context", output_processor_context)
        _set(self, "preprocess_output", None)

    if not TYPE_CHECKING:  # hidden from type checkers: assigning a field stays a type error

        def __setattr__(self, name: str, value: object) -> None:
            raise IntegrationError(
                f"ChunkState: cannot set {name!r}; the state is read-only (its inputs are "
                "the plan's Microbatch, its preprocess output the pre-process node's); keep "
                "per-layer values in node.layer_state"
            )

    def set_preprocess_output(self, output: PreprocessOutput) -> None:
        """Keep what the pre-process produced (once per microbatch)."""
        if self.preprocess_output is not None:
            raise NodeStateError(
                "ChunkState.set_preprocess_output: the preprocess output of this microbatch "
                "is already set; expected one pre-process per chunk state (build a new "
                "plan for every microbatch)"
            )
        _set(self, "preprocess_output", output)

    # --- the microbatch's inputs, by Megatron-Core's names --------------------------------
    @property
    def input_ids(self) -> Tensor | None:
        return self.microbatch.input_ids

    @property
    def position_ids(self) -> Tensor | None:
        return self.microbatch.position_ids

    @property
    def attention_mask(self) -> Tensor | None:
        return self.microbatch.attention_mask

    @property
    def labels(self) -> Tensor | None:
        return self.microbatch.labels

    @property
    def loss_mask(self) -> Tensor | None:
        return self.microbatch.loss_mask

    @property
    def packed_seq_params(self) -> Any:
        return self.microbatch.packed_seq_params

    @property
    def extra_block_kwargs(self) -> Mapping[str, object] | None:
        return self.microbatch.extra_block_kwargs

    @property
    def runtime_gather_output(self) -> bool | None:
        return self.microbatch.runtime_gather_output

    # --- the preprocess output (the microbatch's value before it) -------------------------
    @property
    def decoder_input(self) -> Tensor | None:
        out = self.preprocess_output
        return self.microbatch.decoder_input if out is None else out.decoder_input

    @property
    def padding_mask(self) -> Tensor | None:
        out = self.preprocess_output
        return self.microbatch.padding_mask if out is None else out.padding_mask

    @property
    def rotary_pos_emb(self) -> Tensor | None:
        out = self.preprocess_output
        return None if out is None else out.rotary_pos_emb

    @property
    def rotary_pos_cos(self) -> Tensor | None:
        out = self.preprocess_output
        return None if out is None else out.rotary_pos_cos

    @property
    def rotary_pos_sin(self) -> Tensor | None:
        out = self.preprocess_output
        return None if out is None else out.rotary_pos_sin

    @property
    def sequence_len_offset(self) -> Tensor | None:
        out = self.preprocess_output
        return None if out is None else out.sequence_len_offset

    def __repr__(self) -> str:
        done = "preprocessed" if self.preprocess_output is not None else "not preprocessed"
        return f"ChunkState({self.microbatch!r}, {done})"


STATE_FIELDS = (
    "residual",
    "probs",
    "dispatched_probs",
    "shared_expert_output",
    "tokens_per_expert",
)
"""A layer state's named fields (a recompute snapshots and restores these)."""


_set = object.__setattr__


class LayerState:
    """State the nodes of one layer share within one microbatch.

    The declared fields are the ones the shipped layers use: ``residual`` (the
    pre-dispatch output that combine adds back), ``probs`` / ``dispatched_probs`` (routing
    probabilities before / after dispatch), ``shared_expert_output`` and
    ``tokens_per_expert``. A layer that needs more keeps it in ``extras`` through
    :meth:`~moe_overlap.LayerState.stash` and reads it back, type-checked, with
    :meth:`~moe_overlap.LayerState.take`; any other attribute is a
    :class:`~moe_overlap.LayerStateAttributeError`. Slotted and weakref-able, like
    Megatron-Core's.
    """

    __slots__ = (
        "__weakref__",
        "detached_leaves",
        "dispatched_probs",
        "extras",
        "fresh",
        "kept_as_is",
        "probs",
        "residual",
        "shared_expert_output",
        "tokens_per_expert",
        "undetached",
    )

    residual: Tensor | None
    probs: Tensor | None
    dispatched_probs: Tensor | None
    shared_expert_output: Tensor | None
    tokens_per_expert: Tensor | None
    extras: dict[str, object]
    detached_leaves: list[Tensor]
    """Debug mode: every tensor the layer's slots made with ``node.detach`` (legitimate
    leaves of a later slot's graph)."""
    fresh: list[tuple[str, Tensor, bool]]
    """Every tensor kept since the running slot began: the field name or stash key, the
    tensor, and whether it was stashed. The slot's node checks them after its forward, as
    it checks its outputs (still in the graph, not the slot's own input), and clears the
    list."""
    kept_as_is: list[Tensor]
    """Tensors kept as they are (the same object) that are also an input or an output of
    the slot that kept them: a slot that frees its inputs checks that none lives there."""
    undetached: list[tuple[str, Tensor, object, str]]
    """Tensors a slot kept computed from its own inputs, not through ``node.detach``: the
    field or stash label, the tensor, its ``grad_fn`` and the name of the node that kept it.
    Each later slot's node checks that its outputs do not depend on one."""

    def __init__(self) -> None:
        # Through object.__setattr__: these fields exist, and a plan builds one per layer.
        _set(self, "residual", None)
        _set(self, "probs", None)
        _set(self, "dispatched_probs", None)
        _set(self, "shared_expert_output", None)
        _set(self, "tokens_per_expert", None)
        _set(self, "extras", {})
        _set(self, "fresh", [])
        _set(self, "kept_as_is", [])
        _set(self, "detached_leaves", [])
        _set(self, "undetached", [])

    if not TYPE_CHECKING:  # hidden from type checkers: an unknown field stays a type error

        def __setattr__(self, name: str, value: object) -> None:
            try:
                object.__setattr__(self, name, value)
            except AttributeError:
                raise LayerStateAttributeError(
                    f"LayerState: cannot set {name!r}; expected one of its fields "
                    f"{list(STATE_FIELDS)}; keep anything else with "
                    f"layer_state.stash({name!r}, value) and read it with "
                    f"layer_state.take({name!r}, kind)"
                ) from None
            if isinstance(value, Tensor):
                self.fresh.append((name, value, False))

        def __getattr__(self, name: str) -> object:
            # Only reached for names that are not fields (slots raise for unset ones first).
            raise LayerStateAttributeError(
                f"LayerState has no attribute {name!r}; expected one of its fields "
                f"{list(STATE_FIELDS)}, or a value stashed with stash(key, value) and read with "
                f"take({name!r}, kind)"
            )

    def stash(self, key: str, value: object) -> None:
        """Keep ``value`` for a later slot of the same layer and microbatch."""
        if isinstance(value, Tensor):
            self.fresh.append((key, value, True))
        self.extras[key] = value

    def take(self, key: str, kind: type[_T]) -> _T:
        """Return the value stashed under ``key``, checked to be a ``kind``."""
        try:
            value = self.extras[key]
        except KeyError:
            raise IntegrationError(
                f"LayerState.take: nothing stashed under {key!r}; stashed keys: "
                f"{sorted(self.extras)}"
            ) from None
        if not isinstance(value, kind):
            raise IntegrationError(
                f"LayerState.take: {key!r} holds a {type(value).__name__}, "
                f"expected a {kind.__name__}"
            )
        return value

    def clear(self) -> None:
        """Drop every reference (end of the layer's backward)."""
        _set(self, "residual", None)
        _set(self, "probs", None)
        _set(self, "dispatched_probs", None)
        _set(self, "shared_expert_output", None)
        _set(self, "tokens_per_expert", None)
        self.extras.clear()
        self.fresh.clear()
        self.kept_as_is.clear()
        self.detached_leaves.clear()
        self.undetached.clear()
