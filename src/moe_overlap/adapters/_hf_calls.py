"""Run a transformers model's own code around its decoder layers, and replay child calls.

The adapter never re-implements what the model computes outside its layers. It runs the
model's own ``forward`` with the decoder layers swapped for stand-ins:

- :func:`decoder_input`: the embedding as the model computes it (scaling included), taken
  at the first layer's input;
- :func:`layer_calls`: the arguments the model passes each layer (masks per attention
  kind, rotary tables of any form, positions, ...);
- :func:`causal_lm_output`: the model's final norm, LM head, logit scaling and loss,
  applied to the last layer's output.

Each runs as the model's ``forward`` runs with the config's defaults (``use_cache``
included: transformers builds its masks differently without a cache, e.g. it reads
position ids that are not consecutive as packed sequences); any KV cache it creates is
dropped from the layers' arguments.

:class:`CallSpec` records how a layer calls one of its children (which argument is the
hidden input, which come from the layer's own arguments, which are constants), so the
slots can make the same call.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Generator, Mapping, Sequence, Sized
from contextlib import suppress
from dataclasses import dataclass
from enum import Enum
from typing import Any, cast

import torch
from torch import Tensor, nn

from moe_overlap import ConfigError
from moe_overlap.adapters._torch_private import children

__all__ = [
    "ArgFrom",
    "ArgSource",
    "CallSpec",
    "LayerCall",
    "base_model",
    "causal_lm_output",
    "decoder_input",
    "decoder_layers",
    "layer_calls",
    "router_flag",
    "swap_child",
]


@dataclass(frozen=True, slots=True)
class LayerCall:
    """What the model passed one decoder layer, besides its hidden states."""

    args: tuple[object, ...]
    kwargs: Mapping[str, object]

    def value(self, name: str) -> object:
        return self.kwargs.get(name)


class _Stop(Exception):
    """Ends the model's forward once the stand-ins have what they need."""


class _Stand(nn.Module):
    """A decoder layer's stand-in: records its call, returns a given or its own input."""

    def __init__(
        self,
        layer: nn.Module,
        index: int,
        calls: list[LayerCall | None],
        hiddens: list[object] | None = None,
    ) -> None:
        super().__init__()
        object.__setattr__(self, "_layer", layer)  # not a submodule: no double registration
        self.index = index
        self.calls = calls
        self.hiddens: list[object] = hiddens if hiddens is not None else [None] * len(calls)
        """The hidden states each layer received (for checks and diagnoses)."""
        self.feed: Tensor | None = None
        self.stop = False

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            layer = cast(nn.Module, object.__getattribute__(self, "_layer"))
            return getattr(layer, name)

    def forward(self, *args: object, **kwargs: object) -> object:
        hidden = args[0] if args else kwargs.pop("hidden_states", None)
        self.calls[self.index] = LayerCall(tuple(args[1:]), dict(kwargs))
        self.hiddens[self.index] = hidden
        if self.stop:
            raise _Stop(hidden)
        return self.feed if self.feed is not None else hidden


def base_model(model: nn.Module) -> nn.Module:
    """The causal LM's decoder stack (transformers' ``base_model``: ``model.model`` mostly)."""
    base: object = getattr(model, "base_model", None)
    if base is model:  # a prefix naming a wrapper the causal LM does not have (Llama 4)
        base = getattr(model, "model", None)
    if not isinstance(base, nn.Module) or base is model:
        raise ConfigError(
            f"{type(model).__name__}.base_model: expected the decoder stack (a transformers "
            f"*ForCausalLM), received {type(base).__name__}"
        )
    return base


def decoder_layers(base: nn.Module) -> nn.ModuleList:
    """The decoder stack's list of layers: its ``nn.ModuleList`` child of ``num_hidden_layers``."""
    config: object = getattr(base, "config", None)
    n: object = getattr(config, "num_hidden_layers", None)
    lists = [(k, m) for k, m in base.named_children() if isinstance(m, nn.ModuleList)]
    fits = [m for k, m in lists if k == "layers"] or [m for _, m in lists if len(m) == n]
    if len(fits) != 1:
        raise ConfigError(
            f"{type(base).__name__}: expected one nn.ModuleList of the {n} decoder layers, "
            f"received {[(k, len(m)) for k, m in lists]}"
        )
    return fits[0]


def _install_output_capture(base: nn.Module) -> None:
    """transformers' output-capturing hooks (router logits, hidden states, attentions) on
    the real modules, before any stand-in is put in: transformers installs them once, on
    the first forward that asks for an output, on the modules present then; installed
    while the layers are stood in for, the model's own forward would later find no router
    logits (an ``IndexError`` in its load-balancing loss) nor the layers' hidden states."""
    if not getattr(type(base), "_can_record_outputs", None) or getattr(
        base, "_output_capturing_hooks_installed", False
    ):
        return  # not a model that captures outputs, or installed already
    try:
        capture = importlib.import_module("transformers.utils.output_capturing")
    except ImportError:  # another transformers: nothing to install
        return
    install: object = getattr(capture, "maybe_install_capturing_hooks", None)
    if callable(install):
        install(base)


@contextlib.contextmanager
def _stand_ins(base: nn.Module) -> Generator[list[_Stand], None, None]:
    _install_output_capture(base)
    layers = decoder_layers(base)
    originals = list(layers)
    calls: list[LayerCall | None] = [None] * len(originals)
    hiddens: list[object] = [None] * len(originals)
    stands = [_Stand(layer, i, calls, hiddens) for i, layer in enumerate(originals)]
    for i, stand in enumerate(stands):
        layers[i] = stand
    try:
        yield stands
    finally:
        for i, layer in enumerate(originals):
            layers[i] = layer


def decoder_input(base: nn.Module, *, input_ids: Tensor, position_ids: Tensor | None) -> Tensor:
    """The first layer's input, as ``base.forward`` computes it from ``input_ids``."""
    with _stand_ins(base) as stands:
        stands[0].stop = True
        try:
            base(input_ids=input_ids, position_ids=position_ids)
        except _Stop as stop:
            (hidden,) = stop.args
            if isinstance(hidden, Tensor):
                return hidden
        raise ConfigError(
            f"{type(base).__name__}.forward: expected it to call its first decoder layer with "
            "the hidden states, received no such call"
        )


def layer_calls(
    base: nn.Module,
    *,
    inputs_embeds: Tensor,
    attention_mask: Tensor | None,
    position_ids: Tensor | None,
) -> tuple[LayerCall, ...]:
    """What ``base.forward`` passes each decoder layer for inputs shaped like ``inputs_embeds``.

    Raises :class:`~moe_overlap.ConfigError` when an argument depends on parameters (it
    would tie every layer's slots to one graph) or a layer is never called.
    """
    with _stand_ins(base) as stands:
        stands[-1].stop = True
        try:
            with suppress(_Stop):
                base(
                    inputs_embeds=inputs_embeds,
                    attention_mask=attention_mask,
                    position_ids=position_ids,
                )
        except Exception as exc:
            _check_hand_on(base, stands, inputs_embeds, exc)
            _diagnose(base, stands, exc)
            raise
    _check_hand_on(base, stands, inputs_embeds, None)
    calls = stands[0].calls
    out: list[LayerCall] = []
    cls = type(base).__name__
    for i, recorded in enumerate(calls):
        call = _without_cache(recorded) if recorded is not None else None
        if call is None:
            raise ConfigError(
                f"{cls}.forward: expected it to call decoder layer {i}, received no call"
            )
        for name, value in [*enumerate(call.args), *call.kwargs.items()]:
            if isinstance(value, Tensor) and value.grad_fn is not None:
                raise ConfigError(
                    f"{type(base).__name__}.forward: layer {i}'s argument {name!r} depends on "
                    "parameters or the embeddings; the adapter supports layer arguments that "
                    "carry no gradient (masks, positions, rotary tables)"
                )
        out.append(call)
    return tuple(out)


def _check_hand_on(
    base: nn.Module, stands: Sequence[_Stand], inputs_embeds: Tensor, exc: Exception | None
) -> None:
    """Each layer the forward called got the embeddings' shape, and (after the first) what
    the layer before returned: each stand-in returns the hidden states it got, so anything
    else means the forward changes or takes apart a layer's output between layers."""
    cls = type(base).__name__
    hiddens = stands[0].hiddens
    for i, call in enumerate(stands[0].calls):
        if call is None:
            break
        hidden = hiddens[i]
        if i > 0 and hidden is not hiddens[i - 1]:
            raise ConfigError(
                f"{cls}.forward: expected each decoder layer's output handed on as it is "
                "(the hidden states alone: what the adapter's slots hand on), received a "
                f"forward that takes layer {i - 1}'s output apart{_returns(stands, i - 1)} or "
                "changes it: state passed from one layer to the next is not supported (layer "
                f"{i} got {_describe(hidden)} for layer {i - 1}'s {_describe(hiddens[i - 1])})"
            ) from exc
        if not isinstance(hidden, Tensor) or hidden.shape != inputs_embeds.shape:
            raise ConfigError(
                f"{cls}.forward: expected decoder layer {i}'s hidden states shaped like the "
                f"embeddings, [batch, sequence, hidden_size] = {list(inputs_embeds.shape)}, "
                f"received {_describe(hidden)}: several residual streams per token "
                "(hyper-connections) are not supported (the adapter's slots hand one [B, S, D] "
                "tensor from layer to layer)"
            ) from exc


def _describe(value: object) -> str:
    if isinstance(value, Tensor):
        return f"a tensor {list(value.shape)}"
    return type(value).__name__


def _real_output(stands: Sequence[_Stand], i: int) -> object:
    """Decoder layer ``i`` itself run (no grad) on what its stand-in got; ``None`` when it
    fails or its call was not recorded."""
    call, hidden = stands[0].calls[i], stands[0].hiddens[i]
    if call is None:
        return None
    real = cast(nn.Module, object.__getattribute__(stands[i], "_layer"))
    try:
        with torch.no_grad():
            out: object = real(hidden, *call.args, **dict(call.kwargs))
    except Exception:
        return None
    return out


def _returns(stands: Sequence[_Stand], i: int) -> str:
    """`` (the layer itself returns ...)`` when it returns several values, else ``""``."""
    out = _real_output(stands, i)
    if isinstance(out, (tuple, list)):
        items = list(cast("Sequence[object]", out))
        if len(items) > 1:
            described = ", ".join(_describe(v) for v in items)
            return f" (it returns {len(items)} values: {described})"
    return ""


def _diagnose(base: nn.Module, stands: Sequence[_Stand], exc: Exception) -> None:
    """Why ``base.forward`` failed around the stand-ins, if it is known: it takes more
    from a layer than its hidden states (state handed to the next layer). Raises
    :class:`~moe_overlap.ConfigError` from ``exc`` then; returns otherwise."""
    done = [i for i, c in enumerate(stands[0].calls) if c is not None]
    if not done:
        return
    i = done[-1]
    returns = _returns(stands, i)
    if returns:
        real = object.__getattribute__(stands[i], "_layer")
        raise ConfigError(
            f"{type(base).__name__}.forward: expected each decoder layer's output handed to "
            "the next layer as it is (the hidden states alone: what the adapter's slots hand "
            f"on), received a forward that takes decoder layer {i}'s output apart "
            f"({type(real).__name__}{returns}; with a stand-in returning the hidden states "
            f"alone it raised {type(exc).__name__}: {exc}); state passed from one layer to "
            "the next is not supported"
        ) from exc


def _is_cache(value: object) -> bool:
    """A transformers KV cache (what ``use_cache`` makes the model create)."""
    return callable(getattr(value, "get_seq_length", None)) and callable(
        getattr(value, "update", None)
    )


def _without_cache(call: LayerCall) -> LayerCall:
    """The call with any KV cache replaced by ``None``: the model's forward ran as its
    config says (``use_cache`` included: the masks it builds depend on it), but training
    keeps no keys and values."""
    return LayerCall(
        tuple(None if _is_cache(a) else a for a in call.args),
        {k: None if _is_cache(v) else v for k, v in call.kwargs.items()},
    )


def causal_lm_output(
    model: nn.Module,
    base: nn.Module,
    hidden_states: Tensor,
    *,
    labels: Tensor | None,
    accepts_router_flag: bool,
    attention_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
) -> Tensor:
    """``model.forward``'s loss (or logits) with ``hidden_states`` as the last layer's output.

    Every layer's stand-in passes the given hidden states on, so the model's own final
    norm, LM head, logit scaling and loss function run on them. The router logits are not
    requested (the adapter adds the load-balancing loss itself).
    """
    config: object = getattr(model, "config", None)
    with _stand_ins(base) as stands, router_flag(config, False, accepts_router_flag) as kwargs:
        for stand in stands:
            stand.feed = hidden_states
        out: object = model(
            inputs_embeds=hidden_states.detach(),
            attention_mask=attention_mask,
            position_ids=position_ids,
            labels=labels,
            **kwargs,
        )
    if labels is not None:
        loss: object = getattr(out, "loss", None)
        if isinstance(loss, Tensor):
            return loss
        raise ConfigError(
            f"{type(model).__name__}.forward: expected a loss for the given labels, "
            f"received {type(loss).__name__}"
        )
    logits: object = getattr(out, "logits", None)
    if not isinstance(logits, Tensor):
        raise ConfigError(
            f"{type(model).__name__}.forward: expected logits, received {type(logits).__name__}"
        )
    return logits


@contextlib.contextmanager
def router_flag(
    config: object, value: bool, accepts: bool
) -> Generator[dict[str, object], None, None]:
    """``output_router_logits`` set to ``value`` for one run of a model's ``forward``: the
    config's field (restored after; what a forward that does not take the keyword reads)
    and, where the forward takes it (``accepts``), the keyword arguments yielded."""
    if config is None:
        yield {"output_router_logits": value} if accepts else {}
        return
    missing = object()
    before: object = getattr(config, "output_router_logits", missing)
    setattr(config, "output_router_logits", value)  # noqa: B010 - a transformers config
    try:
        yield {"output_router_logits": value} if accepts else {}
    finally:
        if before is missing:
            delattr(config, "output_router_logits")
        else:
            setattr(config, "output_router_logits", before)  # noqa: B010


@contextlib.contextmanager
def swap_child(
    parent: nn.Module, name: str, stand_in: nn.Module | None
) -> Generator[None, None, None]:
    """``parent.name`` is ``stand_in`` inside the block (restored after, even on error)."""
    modules = children(parent)
    original = modules[name]
    modules[name] = stand_in
    try:
        yield
    finally:
        modules[name] = original


class ArgFrom(Enum):
    """What one argument of a child call is (:class:`ArgSource`)."""

    INPUT = "input"
    """The hidden states the slot passes."""
    LAYER = "layer"
    """The layer's argument named ``key``, or its positional argument ``index``."""
    CONST = "const"
    """A constant, ``value``."""


@dataclass(frozen=True, slots=True)
class ArgSource:
    """Where one argument of a child call comes from."""

    kind: ArgFrom
    key: str = ""
    index: int = -1
    value: object = None


@dataclass(frozen=True, slots=True)
class CallSpec:
    """How a layer calls a child: positional and keyword argument sources."""

    args: tuple[ArgSource, ...]
    kwargs: tuple[tuple[str, ArgSource], ...]

    @staticmethod
    def record(
        where: str,
        args: Sequence[object],
        kwargs: Mapping[str, object],
        *,
        hidden: object,
        call: LayerCall,
    ) -> CallSpec:
        """Match a recorded call's arguments to the layer's input and arguments, by identity."""

        def source(name: str, value: object) -> ArgSource:
            if value is hidden:
                return ArgSource(ArgFrom.INPUT)
            # The layer's argument of the same name, passed on (None included: a mask may be
            # None for the probe and a tensor later).
            if name in call.kwargs and call.kwargs[name] is value:
                return ArgSource(ArgFrom.LAYER, key=name)
            if not isinstance(value, (bool, int, float, str)) and value is not None:
                for key, v in call.kwargs.items():
                    if v is value:
                        return ArgSource(ArgFrom.LAYER, key=key)
                for i, v in enumerate(call.args):
                    if v is value:
                        return ArgSource(ArgFrom.LAYER, index=i)
            kind = type(value).__name__
            if isinstance(value, Tensor) or (
                isinstance(value, (list, tuple, dict)) and len(cast("Sized", value)) > 0
            ):
                raise ConfigError(
                    f"{where}: argument {name!r} is computed inside the decoder layer; the "
                    "adapter can pass on only the layer's hidden input, the layer's own "
                    f"arguments and constants, received a {kind}"
                )
            return ArgSource(ArgFrom.CONST, value=value)  # pyright: ignore[reportUnknownArgumentType] - any constant

        return CallSpec(
            tuple(source(str(i), a) for i, a in enumerate(args)),
            tuple((k, source(k, v)) for k, v in kwargs.items()),
        )

    def call(self, fn: Callable[..., object], hidden: Tensor, layer: LayerCall) -> object:
        def value(src: ArgSource) -> object:
            if src.kind is ArgFrom.INPUT:
                return hidden
            if src.kind is ArgFrom.LAYER:
                return layer.args[src.index] if src.index >= 0 else layer.value(src.key)
            return src.value

        return fn(*[value(a) for a in self.args], **{k: value(a) for k, a in self.kwargs})
