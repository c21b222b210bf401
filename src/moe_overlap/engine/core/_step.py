"""One step of a schedule, at any level, and its one text form.

A :class:`~moe_overlap.steps.Step` is a direction plus the levels that apply: a microbatch
(``F1``: microbatch 1's forward), a role, layer, slot and stream (``b.L3.combine.B@comm``:
a node step of a run), or a role and slot only (``b.combine.B``: a step of a
:class:`~moe_overlap.steps.PairOrder`'s template). Several microbatch steps run together
(a macro step, ``F1+B0``) are a tuple of steps. ``str(step)`` writes the grammar
``[role.][L<layer>.][slot.]D[<microbatch>][@stream]`` and :meth:`Step.parse` reads it back.
"""

import re
from typing import NamedTuple, cast

from moe_overlap.args import refuse
from moe_overlap.errors import ConfigError

from ._kinds import Direction, Role, Slot, StreamKind

__all__ = ["Step"]

_GRAMMAR = "[role.][L<layer>.][slot.]D[<microbatch>][@stream]"  # all but D optional

_STEP_RE = re.compile(
    rf"(?:(?P<role>[{''.join(r.value for r in Role)}])\.)?"
    r"(?:L(?P<layer>\d+)\.)?"
    r"(?:(?P<slot>[a-z_]+)\.)?"
    rf"(?P<dir>[{''.join(d.value for d in Direction)}])"
    r"(?P<microbatch>\d+)?"
    r"(?:@(?P<stream>\w+))?"
)


class Step(NamedTuple):
    """One step of a schedule: a direction and the levels it is given at.

    ``Step(Direction.FORWARD, 1)`` is microbatch 1's forward (``F1``);
    ``Step(Direction.BACKWARD, role=Role.B, layer=3, slot=Slot.COMBINE,
    stream=StreamKind.COMM)`` a node step (``b.L3.combine.B@comm``); ``Step(Direction.BACKWARD,
    role=Role.B, slot=Slot.COMBINE)`` a template step (``b.combine.B``). ``str(step)``
    round-trips through :meth:`~moe_overlap.steps.Step.parse`.
    """

    direction: Direction
    microbatch: int | None = None
    role: Role | None = None
    layer: int | None = None
    slot: Slot | None = None
    stream: StreamKind | None = None

    def __str__(self) -> str:
        role = "" if self.role is None else f"{self.role.value}."
        layer = "" if self.layer is None else f"L{self.layer}."
        slot = "" if self.slot is None else f"{self.slot.value}."
        microbatch = "" if self.microbatch is None else str(self.microbatch)
        stream = "" if self.stream is None else f"@{self.stream.value}"
        return f"{role}{layer}{slot}{self.direction.value}{microbatch}{stream}"

    @classmethod
    def parse(cls, text: str) -> "Step":
        """Read a step back from its string form, e.g. ``F1``, ``b.combine.B`` or
        ``f.L0.dispatch.F@comm``."""
        if not isinstance(cast(object, text), str):
            raise refuse("Step.parse: text", f"a step's string form '{_GRAMMAR}'", text)
        match = _STEP_RE.fullmatch(text)
        if match is None:
            raise ConfigError(
                f"Step.parse: expected '{_GRAMMAR}' (e.g. 'F1', 'b.combine.B', "
                f"'b.L3.combine.B@comm'), received {text!r}"
            )
        layer, slot, microbatch, stream = match.group("layer", "slot", "microbatch", "stream")
        try:
            slot_kind = None if slot is None else Slot(slot)
            stream_kind = None if stream is None else StreamKind(stream)
        except ValueError:
            raise ConfigError(
                f"Step.parse: unknown slot or stream in {text!r}; slots: "
                f"{[s.value for s in Slot]}, streams: {[s.value for s in StreamKind]}"
            ) from None
        role = match["role"]
        return cls(
            Direction(match["dir"]),
            None if microbatch is None else int(microbatch),
            None if role is None else Role(role),
            None if layer is None else int(layer),
            slot_kind,
            stream_kind,
        )
