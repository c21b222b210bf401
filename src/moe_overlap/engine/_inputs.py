"""Which microbatch inputs a model reads: an input it does not read is refused at plan build.

A model lists the optional inputs it honours in ``microbatch_inputs``
(:class:`~moe_overlap.inputs.DeclaresInputs`); one that does not is taken to read
:data:`DEFAULT_INPUTS`. :func:`check_inputs` refuses a set input outside that list, then
runs the model's own ``validate_inputs`` (:class:`~moe_overlap.inputs.ValidatesInputs`) when it
has one. The check looks at attributes only (no tensor is read), so it is always on.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import cast

from moe_overlap.errors import ConfigError, IntegrationError

from .core._state import ChunkState

__all__ = ["ALWAYS_READ", "DEFAULT_INPUTS", "OPTIONAL_INPUTS", "check_inputs", "read_inputs"]

ALWAYS_READ = frozenset({"input_ids", "decoder_input"})
"""The chunk's input itself (token ids, or the hidden states of a later pipeline stage):
read by every model, never checked."""

OPTIONAL_INPUTS = (
    "position_ids",
    "attention_mask",
    "labels",
    "loss_mask",
    "padding_mask",
    "packed_seq_params",
    "extra_block_kwargs",
    "runtime_gather_output",
    "output_processor",
    "output_processor_context",
)
"""The inputs a model may or may not read: the other fields of
:class:`~moe_overlap.Microbatch`, and the plan's ``output_processor`` /
``output_processor_context``."""

DEFAULT_INPUTS = frozenset({"position_ids", "labels"})
"""What a model that declares no ``microbatch_inputs`` is taken to read: the positions and
the labels, which every :class:`~moe_overlap.PreprocessableModel`'s hooks take positionally.
Anything else it is given is refused; declare ``microbatch_inputs`` to accept more (or to
refuse ``position_ids`` too)."""

_KNOWN = frozenset(OPTIONAL_INPUTS) | ALWAYS_READ
_MISSING = object()


def read_inputs(model: object) -> frozenset[str]:
    """The optional inputs ``model`` reads: its ``microbatch_inputs``, else
    :data:`DEFAULT_INPUTS`. A declaration that is not a collection of input names is an
    :class:`~moe_overlap.IntegrationError` naming the model."""
    declared: object = getattr(model, "microbatch_inputs", _MISSING)
    if declared is _MISSING:
        return DEFAULT_INPUTS
    if isinstance(declared, frozenset):  # the fast path
        names = cast("frozenset[str]", declared)
        if names <= _KNOWN:
            return names
    return _as_names(model, declared)  # pyright: ignore[reportUnknownArgumentType]


def _as_names(model: object, declared: object) -> frozenset[str]:
    where = f"{type(model).__name__}.microbatch_inputs"
    if isinstance(declared, (str, bytes)) or not isinstance(declared, Collection):
        raise IntegrationError(
            f"{where}: expected a collection of input names (e.g. frozenset({{'labels'}})), "
            f"received {type(declared).__name__} {declared!r}"
        )
    items = list(cast("Collection[object]", declared))
    unknown = [n for n in items if not (isinstance(n, str) and n in _KNOWN)]
    if unknown:
        raise IntegrationError(
            f"{where}: expected names among {sorted(_KNOWN)}, received also {unknown}"
        )
    return frozenset(cast("list[str]", items))


def _is_set(name: str, value: object) -> bool:
    if value is None:
        return False
    if name == "extra_block_kwargs" and isinstance(value, Mapping):
        return len(cast("Mapping[object, object]", value)) > 0
    return True


def check_inputs(
    model: object,
    inputs: ChunkState | Mapping[str, object],
    *,
    where: str = "ModelChunkSchedulePlan",
    what: str = "input",
) -> None:
    """Refuse a set input that ``model`` does not read; then the model's own check.

    ``inputs`` is a plan's :class:`~moe_overlap.ChunkState` (its input fields) or a mapping
    from input names to values. An input is *set* when it is not ``None`` (an empty
    ``extra_block_kwargs`` is not set). A set input outside :func:`read_inputs` is a
    :class:`~moe_overlap.ConfigError` naming ``where``, the input (``what`` says what kind:
    a Microbatch field, a stage keyword) and the model. With a ``ChunkState``, the model's
    ``validate_inputs(state)`` runs after (:class:`~moe_overlap.inputs.ValidatesInputs`).
    """
    if isinstance(inputs, ChunkState):
        given = {name: getattr(inputs, name) for name in OPTIONAL_INPUTS}
    else:
        given = dict(inputs)
    reads = read_inputs(model)
    unread = [
        name
        for name, value in given.items()
        if name not in reads and name not in ALWAYS_READ and _is_set(name, value)
    ]
    if unread:
        name = type(model).__name__
        how = (
            "as its microbatch_inputs declare"
            if hasattr(model, "microbatch_inputs")
            else "by default: it declares no microbatch_inputs"
        )
        raise ConfigError(
            f"{where}: {what} {unread[0]} is set, but {name} does not read it ({name} reads "
            f"{sorted(reads)}, {how}); it would be silently ignored. Leave it None, or make "
            f"the model honour it and list it in {name}.microbatch_inputs"
            + (f" (also set and unread: {unread[1:]})" if len(unread) > 1 else "")
        )
    if isinstance(inputs, ChunkState):
        validate: object = getattr(model, "validate_inputs", None)
        if callable(validate):
            validate(inputs)
