"""What the planner is asked about: a parallel layout and a schedule name."""

import enum
from dataclasses import dataclass

from moe_overlap.args import POSITIVE, Int, check_arg, check_fields, refuse, replaced
from moe_overlap.engine import ConfigError

__all__ = ["MAX_MICROBATCHES", "Layout", "Schedule", "check_microbatches"]

MAX_MICROBATCHES = 65536
"""The most microbatches the planner takes for one step: it replays (and keeps a span of)
every node of every microbatch, so time and memory grow with the count. A real step has
at most a few thousand."""


def check_microbatches(subject: str, value: int, *, field: bool = False) -> int:
    """``value`` (an int >= 1, already checked) when it is at most
    ``MAX_MICROBATCHES``, else a :class:`~moe_overlap.ConfigError` naming ``subject``
    (``"<where>: <name>"``, or ``"<Class>.<field>"`` with ``field``)."""
    if value > MAX_MICROBATCHES:
        raise refuse(
            subject,
            f"at most {MAX_MICROBATCHES} microbatches (the planner replays every node of "
            "every microbatch: time and memory grow with the count)",
            value,
            field=field,
            hint="plan a step of fewer microbatches (a real step has at most a few "
            "thousand; the pipeline's steady state repeats)",
        )
    return value


class Schedule(str, enum.Enum):
    """The schedules the planner predicts, each lowered by the code that runs it.

    At one pipeline rank with one stage (``pp=1``, ``vpp=1``) ``serial``, ``combined_1f1b``
    and ``fill_drain`` are the engine's own macro schedules
    (:func:`moe_overlap.steps.macro_steps`); otherwise ``serial`` is torch's interleaved
    1F1B (``vpp`` stages per rank) and ``combined_1f1b`` the same with neighbouring forwards
    and backwards paired (:func:`~moe_overlap.integrations.pipelining.pair_overlap_f_b`),
    as Megatron-Core's combined 1F1B does with virtual stages. The others are torch's
    schedules as they are (:func:`~moe_overlap.integrations.pipelining.schedule_order`).
    ``vpp > 1`` at ``pp=1`` is such a pipeline too: the model cut into ``vpp`` stages on
    the one rank, in torch's order (``combined_1f1b`` then pairs one stage's forward with
    another's backward instead of whole-model chunks, with other step times and memory).
    """

    SERIAL = "serial"
    COMBINED_1F1B = "combined_1f1b"
    FILL_DRAIN = "fill_drain"
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"
    ZERO_BUBBLE = "zero_bubble"
    ZBV = "zbv"
    DUALPIPEV = "dualpipev"

    @classmethod
    def of(cls, value: "Schedule | str") -> "Schedule":
        """``value`` as a member (its string value taken too)."""
        if isinstance(value, Schedule):
            return value
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(
                f"Schedule: expected one of {[s.value for s in cls]}, received {value!r}"
            ) from None


_LAYOUT_SPECS = {
    "ep": POSITIVE,
    "pp": POSITIVE,
    "dp": POSITIVE,
    "vpp": POSITIVE,
    "microbatches": POSITIVE,
}


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How the GPUs are used: ``ep * pp * dp`` of them.

    ``vpp`` is the number of model stages per pipeline rank (virtual stages; the V-shaped
    ``dualpipev`` and ``zbv`` always have 2), at ``pp=1`` too
    (:class:`~moe_overlap.plan.Schedule` says what that runs). Ranks are placed EP
    innermost, then DP, then PP (an EP group on consecutive GPUs), so an EP group of at
    most a node's GPUs stays on one node. ``microbatches`` per step per pipeline, at most
    65536 (the planner replays every node of every microbatch; a real step has at most a
    few thousand).
    """

    ep: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int = 1
    microbatches: int = 4

    def __post_init__(self) -> None:
        check_fields(self, _LAYOUT_SPECS)
        check_microbatches("Layout.microbatches", self.microbatches, field=True)

    @property
    def gpus(self) -> int:
        """``ep * pp * dp``."""
        return self.ep * self.pp * self.dp

    def first_gpu(self, pp_rank: int) -> int:
        """The global index of pipeline rank ``pp_rank``'s first GPU."""
        rank = check_arg(
            "Layout.first_gpu", "pp_rank", pp_rank, Int(0, self.pp - 1, max_name="pp-1")
        )
        return rank * self.dp * self.ep

    def replace(self, **changes: int) -> "Layout":
        """A copy with ``changes``."""
        return replaced(self, changes)
