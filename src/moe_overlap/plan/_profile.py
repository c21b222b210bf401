"""Measured node durations as the planner's costs.

A serial step recorded with :class:`moe_overlap.timeline.Timeline` (or a benchmark's
``serial_slot_durations`` rows, ``{"layer", "slot", "direction", "ms"}``) gives each node's
milliseconds. A profile of one pipeline stage covers that stage's layers only (a stage
numbers its layers from 0); :func:`profile_times` repeats it over the model's layers.
"""

import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import cast

from moe_overlap.args import POSITIVE, Real, check_arg
from moe_overlap.engine import ConfigError, Direction, Slot, SlotKey

__all__ = ["check_times", "load_profile", "profile_times", "refuse_unread"]

_MS = Real(min=0.0)


def check_times(where: str, times: object, *, any_layer: bool = False) -> None:
    """Refuse node milliseconds that are not a mapping of ``(layer >= 0 | None, Slot,
    Direction)`` keys to finite milliseconds >= 0 (NaN would time every schedule as 0);
    ``any_layer``: a negative layer index left to the caller's own check."""
    if not isinstance(times, Mapping):
        raise ConfigError(
            f"{where}: expected a mapping of (layer | None, Slot, Direction) to milliseconds, "
            f"received {type(times).__name__}; give load_profile's or Costs.times' mapping"
        )
    for key, ms in cast("Mapping[object, object]", times).items():
        parts = cast("tuple[object, ...]", key) if isinstance(key, tuple) else ()
        layer = parts[0] if len(parts) == 3 else -1
        if (
            len(parts) != 3
            or (layer is not None and (type(layer) is not int or (layer < 0 and not any_layer)))
            or not isinstance(parts[1], Slot)
            or not isinstance(parts[2], Direction)
        ):
            raise ConfigError(
                f"{where}: expected keys (layer >= 0 or None, Slot, Direction), received "
                f"{key!r}; key node milliseconds as load_profile does"
            )
        check_arg(where, f"the milliseconds of {key!r}", ms, _MS)


_TIMED = (Direction.FORWARD, Direction.BACKWARD, Direction.WGRAD)
_LAYER_SLOTS = (Slot.PRE_DISPATCH, Slot.DISPATCH, Slot.MLP, Slot.COMBINE)
_READ_SLOTS: dict[bool | None, tuple[Slot, ...]] = {
    None: (Slot.PRE_PROCESS, Slot.POST_PROCESS),
    True: _LAYER_SLOTS,
    False: (Slot.PRE_DISPATCH, Slot.MLP),
}
"""The slots a replay reads times of: of layer ``None`` (pre- and post-process), of an MoE
layer, of a dense layer; each in the directions of :data:`_TIMED`."""


def _shown(keys: Sequence[SlotKey]) -> str:
    """The first four of ``keys``, and how many more."""
    more = f" and {len(keys) - 4} more" if len(keys) > 4 else ""
    return ", ".join(map(repr, keys[:4])) + more


def refuse_unread(
    where: str,
    times: Mapping[SlotKey, float],
    moe: Sequence[bool] | None,
    moe_name: str = "moe",
) -> None:
    """Refuse keys of ``times`` that no replay reads (checked keys: ``(layer | None, Slot,
    Direction)``): their milliseconds would be dropped without a word. ``moe``: which layer
    is MoE (``None``: unknown, a layer's slots of either kind taken; else a layer past its
    end is refused), ``moe_name`` what the message calls it."""
    if moe is not None:
        beyond = [key for key in times if key[0] is not None and key[0] >= len(moe)]
        if beyond:
            raise ConfigError(
                f"{where}: expected layers 0..{len(moe) - 1} or None ({moe_name} has "
                f"{len(moe)} layers), received {len(beyond)} key(s) of other layers: "
                f"{_shown(beyond)}; drop them (no replay reads them), or give {moe_name} "
                "for every layer the times cover"
            )

    def read(layer: int | None) -> tuple[Slot, ...]:
        if layer is None:
            return _READ_SLOTS[None]
        if moe is None:
            return _LAYER_SLOTS
        return _READ_SLOTS[moe[layer]]

    unread = [key for key in times if key[2] not in _TIMED or key[1] not in read(key[0])]
    if not unread:
        return
    hint = "" if moe is None else f", or set {moe_name} for the layers that dispatch"
    raise ConfigError(
        f"{where}: expected only keys a replay reads, directions F, B or W of "
        "(None, pre_process | post_process), (an MoE layer, pre_dispatch | dispatch | mlp | "
        f"combine) or (a dense layer, pre_dispatch | mlp) ({moe_name} says which layer is "
        f"which), received {len(unread)} other key(s): {_shown(unread)}; drop them (the "
        f"planner has no node that runs them){hint}"
    )


def _row_key(given: object, where: str) -> tuple[SlotKey, float]:
    if not isinstance(given, Mapping):
        raise ConfigError(
            f"{where}: expected each row a mapping {{'layer', 'slot', 'direction', 'ms'}}, "
            f"received {type(given).__name__} {given!r}"
        )
    row = cast("Mapping[str, object]", given)
    try:
        layer = row["layer"]
        slot = Slot(row["slot"])
        direction = Direction(row["direction"])
        ms = row["ms"]
    except (KeyError, ValueError, TypeError) as e:
        raise ConfigError(
            f"{where}: expected rows {{'layer', 'slot', 'direction', 'ms'}} with a known slot "
            f"and direction, received {dict(row)!r} ({e})"
        ) from None
    if (
        layer is not None and (not isinstance(layer, int) or isinstance(layer, bool) or layer < 0)
    ) or isinstance(ms, bool):
        raise ConfigError(f"{where}: expected a layer index >= 0 or null, received {dict(row)!r}")
    if not isinstance(ms, (int, float)) or ms < 0 or not math.isfinite(ms):
        odd = isinstance(ms, float) and not math.isfinite(ms)
        why = "; NaN and infinities are not durations: re-measure the node" if odd else ""
        raise ConfigError(f"{where}: expected milliseconds >= 0, received {dict(row)!r}{why}")
    return (layer, slot, direction), float(ms)


def load_profile(
    source: "str | os.PathLike[str] | Iterable[Mapping[str, object]]",
) -> dict[SlotKey, float]:
    """Node milliseconds per ``(layer, slot, direction)`` from rows, or from a JSON file
    holding the rows (a list, or an object with ``serial_slot_durations``)."""
    where = "load_profile"
    if isinstance(source, (str, os.PathLike)):
        try:
            with open(source, encoding="utf-8") as f:
                data = cast(object, json.load(f))
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"{where}: expected a readable JSON file of profile rows at "
                f"{os.fspath(source)!r}, could not read it ({e}); give a file of "
                f"{{'layer', 'slot', 'direction', 'ms'}} rows (a benchmark's serial_slot_durations)"
            ) from None
        if isinstance(data, dict) and "serial_slot_durations" in data:
            data = cast("dict[str, object]", data)["serial_slot_durations"]
        if not isinstance(data, list):
            raise ConfigError(f"{where}: expected a JSON list of rows in {os.fspath(source)!r}")
        source = [cast("dict[str, object]", r) for r in cast("list[object]", data)]
    if not isinstance(cast(object, source), Iterable):
        raise ConfigError(
            f"{where}: expected a path or rows (mappings), received {type(source).__name__} "
            f"{source!r}"
        )
    out: dict[SlotKey, float] = {}
    for row in source:
        key, ms = _row_key(row, where)
        out[key] = ms
    if not out:
        raise ConfigError(f"{where}: expected at least one row, received none")
    return out


def profile_times(profile: Mapping[SlotKey, float], num_layers: int) -> dict[SlotKey, float]:
    """``profile`` over ``num_layers`` layers: layer ``i`` takes the profile's layer
    ``i % k`` (``k`` the profile's layer count; the profile's own layers when it has them
    all). Pre- and post-process rows are kept. A profile of more layers than the model is
    refused (its last layers would be dropped)."""
    where = "profile_times"
    check_times(where, profile, any_layer=True)
    num_layers = check_arg(where, "num_layers", num_layers, POSITIVE)
    layers = sorted({k[0] for k in profile if k[0] is not None})
    if layers != list(range(len(layers))):
        raise ConfigError(
            f"profile_times: expected the profile's layers numbered 0..k-1, received {layers}"
        )
    k = len(layers)
    if not k:
        raise ConfigError("profile_times: expected at least one layer in the profile")
    if k > num_layers:
        raise ConfigError(
            f"profile_times: expected a profile of at most num_layers={num_layers} layers, "
            f"received one of {k} layers (0..{k - 1}); give the model's layer count, or a "
            "profile of one of its stages"
        )
    out: dict[SlotKey, float] = {key: ms for key, ms in profile.items() if key[0] is None}
    for i in range(num_layers):
        for (layer, slot, direction), ms in profile.items():
            if layer == i % k:
                out[(i, slot, direction)] = ms
    return out
