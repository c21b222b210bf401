"""The transformers modules whose ``forward`` the adapter does not call as the model does.

Torch wrappers, ``compile`` and hooks on them would be skipped, so the adapter lists them
(:func:`bypassed`) for the check made at construction and at every plan build:

- the causal LM and its decoder stack (``base_model``): their ``forward`` runs only around
  stand-ins for the decoder layers (the embedding, the layers' arguments; the final norm,
  LM head and loss), never as a whole;
- a MoE decoder layer: the slots call the modules inside it, never its ``forward``;
- its MoE block: its ``forward`` runs with the routed experts stood in for (forward
  pre-hooks see its real input and run; nothing that sees its output would);
- the routed experts and the modules inside them: the mlp slot runs them on the
  dispatched rows (or their weights directly), not as the block calls them;
- a module outside the layers that those runs of the model's ``forward`` call more than
  once per microbatch (the rotary embedding: :func:`repeated_outside`);
- a dense decoder layer: called whole, so hooks and ``compile()`` on it run; a wrapper put
  around or in place of it would not (the adapter calls the layer it was built on).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook

from moe_overlap import ConfigError
from moe_overlap.adapters._hf_calls import causal_lm_output, decoder_input, layer_calls
from moe_overlap.adapters._hf_structure import block_of
from moe_overlap.engine import Bypass, BypassedModule

__all__ = ["Bypassed", "bypassed", "check_layers_unchanged", "repeated_outside"]

_OUTSIDE = (
    "the adapter runs its forward only around stand-ins for the decoder layers (embedding, "
    "layer arguments, final norm, LM head, loss), several times per microbatch and never as "
    "a whole"
)
_MOE_LAYER = "the adapter's slots call the modules inside this decoder layer, never its forward"
_BLOCK = "the adapter's slots call its forward with its routed experts stood in for"
_EXPERTS = (
    "the adapter's mlp slot runs the experts on the dispatched rows (or their weights "
    "directly), not as the MoE block calls them"
)
_DENSE = "the adapter calls the decoder layer it was built on, not a wrapper around it"
_REPLACED = "the adapter runs the decoder layer it was built on, never one put in its place"


@dataclass(frozen=True, slots=True)
class Bypassed:
    """The modules :func:`bypassed` lists: outside the layers, and per decoder layer."""

    outside: tuple[BypassedModule, ...]
    layers: tuple[tuple[BypassedModule, ...], ...]

    def all(self) -> Iterator[BypassedModule]:
        yield from self.outside
        for items in self.layers:
            yield from items

    def with_outside(self, more: Sequence[BypassedModule]) -> Bypassed:
        return Bypassed((*self.outside, *more), self.layers)


def bypassed(model: nn.Module, base: nn.Module, layers: Sequence[nn.Module]) -> Bypassed:
    """What :mod:`this module <moe_overlap.adapters._hf_bypass>` lists, named after ``model``."""
    cls = type(model).__name__
    named = cast("Iterator[tuple[str, nn.Module]]", model.named_modules())
    names = {id(m): n for n, m in named}

    def name(module: nn.Module) -> str:
        return f"{cls}.{names.get(id(module), type(module).__name__)}"

    outside = (
        BypassedModule(cls, model, Bypass.CALLS, _OUTSIDE),
        BypassedModule(name(base), base, Bypass.CALLS, _OUTSIDE),
    )
    per_layer: list[tuple[BypassedModule, ...]] = []
    for layer in layers:
        found = block_of(layer)
        if found is None:
            per_layer.append((BypassedModule(name(layer), layer, Bypass.WRAPPER, _DENSE),))
            continue
        block = found[1]
        experts = block.get_submodule("experts").modules()
        per_layer.append(
            (
                BypassedModule(name(layer), layer, Bypass.FORWARD, _MOE_LAYER),
                BypassedModule(name(block), block, Bypass.OUTPUT, _BLOCK),
                *(BypassedModule(name(m), m, Bypass.CALLS, _EXPERTS) for m in experts),
            )
        )
    return Bypassed(outside, tuple(per_layer))


def repeated_outside(
    model: nn.Module, base: nn.Module, *, accepts_router_flag: bool
) -> list[BypassedModule]:
    """The modules outside the decoder layers that one microbatch's runs of the model's own
    ``forward`` (embedding, layer arguments, output) call more than once, e.g. the rotary
    embedding: counted on a probe of four tokens."""
    p0 = next(model.parameters())
    counts: Counter[int] = Counter()

    def count(module: nn.Module, args: object) -> None:
        del args
        counts[id(module)] += 1

    handle = register_module_forward_pre_hook(count)
    try:
        with torch.no_grad():
            ids = torch.zeros(1, 4, dtype=torch.long, device=p0.device)
            hidden = decoder_input(base, input_ids=ids, position_ids=None)
            layer_calls(base, inputs_embeds=hidden, attention_mask=None, position_ids=None)
            causal_lm_output(
                model,
                base,
                hidden,
                labels=None,
                accepts_router_flag=accepts_router_flag,
            )
    finally:
        handle.remove()
    cls = type(model).__name__
    out: list[BypassedModule] = []
    for name, module in cast("Iterator[tuple[str, nn.Module]]", model.named_modules()):
        n = counts.get(id(module), 0)
        if n > 1 and module is not model and module is not base:
            reason = (
                f"the adapter runs the model's own forward around the decoder layers "
                f"{n} times per microbatch (embedding, layer arguments, output), each calling it"
            )
            out.append(BypassedModule(f"{cls}.{name}", module, Bypass.CALLS, reason))
    return out


def check_layers_unchanged(
    model: nn.Module, live: nn.ModuleList, built: Sequence[nn.Module], indices: range
) -> Iterator[BypassedModule]:
    """The model's decoder layers at ``indices`` are still those the adapter was built on.

    A module put in one's place is yielded first (a torch wrapper, e.g. from
    ``apply_activation_checkpointing``, is then refused by name); any other replacement is
    a :class:`~moe_overlap.ConfigError` here.
    """
    cls = type(model).__name__
    if len(live) != len(built):
        raise ConfigError(
            f"{cls}: expected the {len(built)} decoder layers the adapter was built on, "
            f"received {len(live)}; build a new adapter after changing the model's layers"
        )
    for i in indices:
        entry, layer = live[i], built[i]
        if entry is layer:
            continue
        where = f"{cls} decoder layer {i}"
        yield BypassedModule(where, entry, Bypass.FORWARD, _REPLACED)
        raise ConfigError(
            f"{where}: expected the {type(layer).__name__} the adapter was built on, received "
            f"a {type(entry).__name__} in its place; {_REPLACED}: build a new adapter after "
            "changing the model's layers"
        )
