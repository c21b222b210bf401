"""The arguments of the schedule core's data types, checked: a guard at ``arguments``.

The core's constructors (``ScheduleOptions``, ``ChunkHooks``, ``StreamPair``,
``ScheduleOrder``, each step of a ``NodeSchedule``, a ``TransformerLayerNode``'s
Megatron-style ``extra_args`` dict) take what they are given, after calling the guards;
:class:`CoreArguments` checks each against its argument specs (:mod:`moe_overlap.args`) and
raises the library's error naming the field. :func:`layer_args` (public as
:func:`moe_overlap.megatron.layer_args`) checks an ``extra_args`` dict and converts it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import fields
from typing import cast

import torch
from typing_extensions import get_protocol_members

from moe_overlap.args import (
    BOOL,
    CALLABLE,
    POSITIVE,
    Instance,
    Items,
    Mismatch,
    Opt,
    Spec,
    check_arg,
    check_fields,
    refuse,
)
from moe_overlap.errors import ConfigError, StreamError
from moe_overlap.protocols import FreeInputConfig

from ._guards import BaseGuard
from .core._kinds import Direction, Role, Slot, StreamKind
from .core._layer_args import LayerArgs
from .core._options import ScheduleOptions
from .core._order import PairKind, PairOrder, ScheduleOrder
from .core._step import Step
from .core._streams import CpuStream, StreamPair

__all__ = ["STREAM_SPEC", "CoreArguments", "layer_args"]


class CoreArguments(BaseGuard):
    """The guard: what a core constructor was given, by the constructor's name."""

    def arguments(self, owner: str, value: object) -> None:
        _CHECKS[owner](value)


def _options(value: object) -> None:
    options = cast(ScheduleOptions, value)
    check_fields(options, _OPTIONS)
    mixed = options.order.mixed
    early = options.ep_overlap_early_attn_memory_release
    if early and mixed is not None and not mixed.releases_attention_early():
        raise ConfigError(
            "ScheduleOptions: expected with ep_overlap_early_attn_memory_release=True "
            "an order.mixed running b.pre_dispatch.B before f.mlp.F (what early "
            "release means), received one running it after; move that step, or "
            "leave early release off"
        )


class _SlotToRecompute(Spec[Slot]):
    """A compute slot of a layer, as a ``Slot`` or its name; returned as the ``Slot``."""

    __slots__ = ()

    def check(self, value: object) -> Slot:
        if isinstance(value, Slot):
            slot = value
        elif isinstance(value, str) and value in _SLOT_NAMES:
            slot = Slot(value)
        else:
            raise Mismatch("not a slot's name")
        if slot in _COMMUNICATION:
            raise Mismatch(
                f"{slot.value} is communication: recomputing it would repeat an all-to-all"
            )
        if slot not in _RECOMPUTABLE:
            raise Mismatch(
                f"{slot.value}: the schedule recomputes the pre_dispatch and mlp slots of a "
                "layer only"
            )
        return slot


class _SlotsToRecompute(Items[Slot]):
    """:class:`_SlotToRecompute` items, returned once each in the layer's order."""

    __slots__ = ()

    def check(self, value: object) -> tuple[Slot, ...]:
        given = super().check(value)
        return tuple(s for s in _RECOMPUTABLE if s in given)


_SLOT_NAMES = frozenset(s.value for s in Slot)
_COMMUNICATION = (Slot.DISPATCH, Slot.COMBINE)
_RECOMPUTABLE = (Slot.PRE_DISPATCH, Slot.MLP)
"""The slots a schedule can recompute, in the order they are stored."""

_OPTIONS: dict[str, Spec[object]] = {
    "delay_wgrad_compute": Opt(BOOL),
    "ep_overlap_early_attn_memory_release": BOOL,
    "free_input": BOOL,
    "order": Instance(ScheduleOrder, "a ScheduleOrder (moe_overlap.steps.ScheduleOrder)"),
    "recompute": _SlotsToRecompute(
        _SlotToRecompute("Slot.PRE_DISPATCH or Slot.MLP, or its name"),
        expects=(
            "a collection of the layer slots to recompute, each Slot.PRE_DISPATCH or "
            "Slot.MLP or its name ('pre_dispatch', 'mlp')"
        ),
        hint="e.g. recompute=('pre_dispatch', 'mlp'), or () to recompute none",
    ),
}


def _hooks(value: object) -> None:
    check_fields(value, _HOOKS)


_HOOKS: dict[str, Spec[object]] = dict.fromkeys(
    ("pre_forward", "pre_backward", "post_forward", "post_backward"), Opt(CALLABLE)
)


def _stream_pair(value: object) -> None:
    pair = cast(StreamPair, value)
    check_fields(pair, _PAIR)
    if isinstance(pair.comp, CpuStream) != isinstance(pair.comm, CpuStream):
        raise StreamError(
            "StreamPair: expected compute and communication streams of one device type, "
            f"received comp={pair.comp!r}, comm={pair.comm!r}; make both for one device "
            "(make_streams(device))"
        )


STREAM_SPEC = Instance((torch.cuda.Stream, CpuStream), "a torch.cuda.Stream or CpuStream")
_PAIR: dict[str, Spec[object]] = {"comp": STREAM_SPEC, "comm": STREAM_SPEC}


def _schedule_order(value: object) -> None:
    for name, kind in _ORDER_FIELDS.items():
        field: object = getattr(value, name)
        if field is None:
            continue
        if not isinstance(field, PairOrder) or field.kind is not kind:
            raise refuse(
                f"ScheduleOrder.{name}",
                f"None or a PairOrder of kind PairKind.{kind.name}",
                field,
            )


_ORDER_FIELDS = {
    "mixed": PairKind.MIXED,
    "forwards": PairKind.FORWARDS,
    "backwards": PairKind.BACKWARDS,
}


def _layer_node_args(value: object) -> None:
    layer_args(cast("Mapping[str, object] | None", value))


_LOCAL_EXPERTS = Opt(POSITIVE)
_FLAGS = ("is_moe", "delay_wgrad_compute", "is_mtp", "is_first_layer", "is_last_layer")
_KEYS = frozenset(f.name for f in fields(LayerArgs))
_CONFIG_FIELDS = tuple(  # (a list first: asking for the members caches them on the class)
    name for name in list(vars(FreeInputConfig)) if name in get_protocol_members(FreeInputConfig)
)
"""The fields a config must have, in the Protocol's order (as its rule table lists them)."""


def layer_args(extra_args: Mapping[str, object] | None) -> LayerArgs:
    """Megatron's ``extra_args`` dict as a :class:`~moe_overlap.LayerArgs`.

    Keys are ``LayerArgs``' fields; ``config`` is required, the flags default to
    ``False``. An unknown key, a flag that is not a bool, a config without the free-input
    fields, or ``None`` is a :class:`~moe_overlap.ConfigError`.
    """
    if extra_args is None:
        raise ConfigError("LayerArgs: extra_args must give at least 'config', received None")
    unknown = sorted(set(extra_args) - _KEYS)
    if unknown:
        raise ConfigError(
            f"LayerArgs: unknown extra_args keys {unknown}; expected a subset of {sorted(_KEYS)}"
        )
    config = extra_args.get("config")
    if any(not hasattr(config, name) for name in _CONFIG_FIELDS):
        *names, last = _CONFIG_FIELDS
        raise ConfigError(
            f"LayerArgs: extra_args['config'] must have {', '.join(names)} and {last}; "
            f"received {type(config).__name__}"
        )
    flags = {
        key: check_arg("LayerArgs", f"extra_args[{key!r}]", extra_args.get(key, False), BOOL)
        for key in _FLAGS
    }
    nle = check_arg(
        "LayerArgs",
        "extra_args['num_local_experts']",
        extra_args.get("num_local_experts"),
        _LOCAL_EXPERTS,
    )
    return LayerArgs(config=cast(FreeInputConfig, config), num_local_experts=nle, **flags)


def _index(value: object) -> bool:
    return type(value) is int and value >= 0


def _node_schedule(steps: object) -> None:
    if not isinstance(steps, (str, Iterable)):
        raise refuse(
            "NodeSchedule: steps",
            f"node steps ('{_GRAMMAR}', e.g. 'L0.mlp.F1@comp'), or one string of them",
            steps,
        )


def _node_step(value: object) -> None:
    """One step of a ``NodeSchedule`` (``(index, item, step)``: what was given, and the step
    it was parsed to): a Step with the fields a schedule's steps need."""
    index, item, step = cast("tuple[int, object, object]", value)
    if not isinstance(step, Step):
        raise refuse(f"NodeSchedule: step {index}", f"a Step or '{_GRAMMAR}'", item)
    _check_fields(index, step)
    problem = None
    if step.microbatch is None:
        problem = "no microbatch"
    elif step.role is not None:
        problem = f"a role ({step.role.value}.): a schedule's steps name microbatches instead"
    elif step.slot is None:
        problem = "no slot"
    elif step.direction not in (_F, _B, _W, _R):
        problem = f"direction {step.direction.value} (expected F, B, W or R)"
    elif (step.layer is None) != (step.slot in (Slot.PRE_PROCESS, Slot.POST_PROCESS)):
        problem = "a layer slot without a layer, or a layer on pre/post-process"
    if problem is not None:
        raise ConfigError(
            f"NodeSchedule: step {index} ({step}): expected '{_GRAMMAR}' with a microbatch, "
            f"a slot and F, B, W or R, received {problem}"
        )


_F, _B, _W, _R = Direction.FORWARD, Direction.BACKWARD, Direction.WGRAD, Direction.RECOMPUTE
_GRAMMAR = "[L<layer>.]<slot>.<D><microbatch>[@stream]"


def _check_fields(index: int, step: Step) -> None:
    """Refuse a hand-made :class:`Step` whose fields are not of their kinds (a string
    direction, a bool or negative microbatch): it would print as another step, or not at all."""
    fields: tuple[object, ...] = tuple(step)
    direction, microbatch, role, layer, slot, stream = fields
    kinds = (
        ("direction", isinstance(direction, Direction)),
        ("microbatch", microbatch is None or _index(microbatch)),
        ("layer", layer is None or _index(layer)),
        ("slot", slot is None or isinstance(slot, Slot)),
        ("stream", stream is None or isinstance(stream, StreamKind)),
        ("role", role is None or isinstance(role, Role)),
    )
    bad = [name for name, ok in kinds if not ok]
    if bad:
        raise refuse(
            f"NodeSchedule: step {index}",
            "a Step of a Direction, a microbatch int >= 0, a layer int >= 0 or None, a Slot, "
            "a StreamKind or None",
            step,
            detail=", ".join(f"{name} {getattr(step, name)!r}" for name in bad),
            hint=f"write it as text, '{_GRAMMAR}', or use the enums",
        )


_CHECKS: dict[str, Callable[[object], None]] = {
    "ScheduleOptions": _options,
    "ChunkHooks": _hooks,
    "StreamPair": _stream_pair,
    "ScheduleOrder": _schedule_order,
    "NodeSchedule": _node_schedule,
    "NodeSchedule step": _node_step,
    "TransformerLayerNode": _layer_node_args,
}
