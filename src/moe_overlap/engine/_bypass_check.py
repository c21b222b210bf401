"""Torch wrappers, compilation and hooks the schedule would bypass: refused at plan build.

The schedule calls ``_preprocess`` / ``_postprocess`` and the layers' slots, which call the
modules inside each layer; it never calls the model's ``forward``, the decoder's, nor a
decoder layer's. Whatever torch runs only through such a module's own call (an
activation-checkpoint wrapper, ``torch.compile``, a data-parallel wrapper, FSDP, a
``forward`` set on the instance, forward and backward hooks) would silently do nothing, so
:func:`check_bypassed` refuses it, every time a plan is built (a hook added after the first
step is found too). Hooks on the modules the slots call, and global module hooks
(``register_module_forward_hook``, which see every module the slots call), run as in plain
training and are accepted.

A model whose slots run third-party modules without calling their ``forward`` (the
transformers adapter) lists them with a ``bypassed_modules()`` method returning
:class:`BypassedModule` s; they are checked the same way.
"""

# No ``from __future__ import annotations`` here: the NamedTuple's field types must be real
# objects at run time for debug mode's checks (beartype resolves them).

import enum
from collections.abc import Callable, Iterable
from typing import NamedTuple, NoReturn, cast

from torch import nn

from moe_overlap.errors import ConfigError

from ._conformance import named
from ._fsdp_check import check_fsdp, refuse_fsdp
from ._torch_wrappers import Finding, Kind, find_wrapping

__all__ = ["Bypass", "BypassedModule", "check_bypassed", "check_module"]


class Bypass(enum.Enum):
    """How the schedule runs a module it does not call as a whole."""

    FORWARD = "forward"
    """Its ``forward`` is never called: nothing torch attaches to it runs."""
    CALLS = "calls"
    """Its ``forward`` is called, but not as the model calls it (other inputs, or more
    often): nothing torch attaches to it runs as in plain training."""
    OUTPUT = "output"
    """Its ``forward`` is called with part of its work stood in for (a split MoE block):
    forward pre-hooks see its real input and run; nothing that sees its output does."""
    WRAPPER = "wrapper"
    """It is called as a whole, but through the object the integration holds: a torch
    wrapper object put around it is skipped; hooks and ``compile()`` on it run."""


class BypassedModule(NamedTuple):
    """A module the schedule does not call as a whole, listed by ``bypassed_modules()``."""

    name: str
    """How errors name it (e.g. ``MixtralForCausalLM.model.layers.0``)."""
    module: object
    bypass: Bypass
    reason: str
    """Why, for the message: what the schedule does with it instead."""
    honoured: object = None
    """The module itself (a torch wrapper object) or the ``forward`` set on it, when the
    integration runs what it does itself (and checked that it can): not refused; hooks,
    ``compile`` and anything else on the module still are."""


_MODEL = "the schedule never calls the model's forward (it calls _preprocess / _postprocess and the layers' slots)"
_DECODER = "the schedule never calls the decoder's forward (it runs the layers' slots)"
_LAYER = (
    "the schedule never calls a decoder layer's forward (it calls the layer's slots, which "
    "call the modules inside the layer)"
)

_EXPECTED = {
    Kind.CHECKPOINT: "no activation checkpointing of it",
    Kind.COMPILE: "no torch.compile of it",
    Kind.DATA_PARALLEL: "no data-parallel wrapper around it",
    Kind.FORWARD: "the class's own forward",
    Kind.HOOKS: "no forward or backward hooks on it",
}
_SO = {
    Kind.CHECKPOINT: "it would never recompute anything",
    Kind.COMPILE: "the compiled code would never run",
    Kind.DATA_PARALLEL: "its gradient synchronization would never run",
    Kind.FORWARD: "that forward would never run",
    Kind.HOOKS: "they would never run",
}
_SO_CALLS = {
    Kind.CHECKPOINT: "it would not recompute as in plain training",
    Kind.COMPILE: "the compiled code would not run as in plain training",
    Kind.DATA_PARALLEL: "its gradient synchronization would not run as in plain training",
    Kind.FORWARD: "that forward would not run as in plain training",
    Kind.HOOKS: "they would not run as in plain training",
}
_INSTEAD = {
    Kind.CHECKPOINT: (
        "recompute inside the slots instead: GPTMoEConfig.recompute (the reference model), "
        "TransformersMoEAdapter(recompute=...), moe_overlap.blocks.recompute_module or "
        "apply_activation_checkpointing with a check_fn selecting the modules the slots "
        "call (docs/recompute.md)"
    ),
    Kind.COMPILE: (
        "compile the modules the slots call instead (module.compile() on each layer's "
        "attention, norms, router, MLP: docs/compile.md)"
    ),
    Kind.DATA_PARALLEL: (
        "pass the model itself and average the gradients after the step (all_reduce each "
        "replicated .grad), or shard the modules the slots call with "
        "moe_overlap.integrations.fsdp.fully_shard_slots (docs/fsdp.md)"
    ),
    Kind.FORWARD: (
        "change the slots, or the modules they call (e.g. moe_overlap.blocks.recompute_module "
        "on a layer's attention), instead"
    ),
    Kind.HOOKS: (
        "register them on the modules the slots call (e.g. a layer's attention or MLP) instead"
    ),
}


def _refuse(where: str, finding: Finding, reason: str, bypass: Bypass) -> NoReturn:
    expected, so = _EXPECTED[finding.kind], _SO[finding.kind]
    if bypass is Bypass.CALLS:
        so = _SO_CALLS[finding.kind]
    elif bypass is Bypass.OUTPUT and finding.kind is Kind.HOOKS:
        expected = "no forward or backward hooks on it but forward pre-hooks (which run)"
        so = "they would not see its real output"
    raise ConfigError(
        f"{where}: expected {expected}, received {finding.what}; {reason}, so {so}; "
        f"{_INSTEAD[finding.kind]}"
    )


def check_module(
    module: object,
    where: str | Callable[[], str],
    reason: str,
    bypass: Bypass,
    honoured: object = None,
) -> None:
    """Raise :class:`~moe_overlap.ConfigError` for what torch would run only through
    ``module``'s own call, as :class:`Bypass` says the schedule runs it.

    ``where`` names the module (a callable is called only for the message); ``reason``
    says what the schedule does instead of calling it; ``honoured`` as
    :attr:`BypassedModule.honoured`.
    """
    if not isinstance(module, nn.Module):
        return
    refuse_fsdp(module, where, "a module")
    finding = find_wrapping(module, pre_hooks=bypass is not Bypass.OUTPUT, honoured=honoured)
    if finding is None or (bypass is Bypass.WRAPPER and not finding.wrapper):
        return
    _refuse(named(where), finding, reason, bypass)


def _layers(model: object) -> Iterable[object]:
    decoder: object = getattr(model, "decoder", None)
    layers: object = getattr(decoder, "layers", None)
    if isinstance(layers, (list, tuple, nn.ModuleList)):
        return cast("Iterable[object]", layers)
    return ()


def check_bypassed(model: object, where: str | None = None) -> None:
    """Refuse what torch put on the model, its decoder, a decoder layer or a module the model
    lists in ``bypassed_modules()``, that the schedule would skip (:class:`~moe_overlap.ConfigError`).

    Cheap (a few dictionary lookups per layer) and run for every plan. ``where`` prefixes
    the model's name in messages (e.g. the pipeline stage). Members the model lacks are
    left to the Protocol checks.
    """
    owner = type(model).__name__
    prefix = f"{where}: " if where else ""  # e.g. "pipeline stage 2: "
    layers = _layers(model)
    check_fsdp(model, layers, delayed=False)
    check_module(model, f"{prefix}{owner}", _MODEL, Bypass.FORWARD)
    decoder: object = getattr(model, "decoder", None)
    check_module(decoder, lambda: f"{prefix}{owner}.decoder", _DECODER, Bypass.FORWARD)
    for i, layer in enumerate(layers):
        if isinstance(layer, nn.Module) and find_wrapping(layer) is not None:
            check_module(
                layer,
                f"{prefix}{owner}.decoder.layers[{i}] ({type(layer).__name__})",
                _LAYER,
                Bypass.FORWARD,
            )
    declared = getattr(type(model), "bypassed_modules", None)
    if callable(declared):
        listed = cast("Callable[[object], Iterable[BypassedModule]]", declared)(model)
        for item in listed:
            check_module(
                item.module, f"{prefix}{item.name}", item.reason, item.bypass, item.honoured
            )
