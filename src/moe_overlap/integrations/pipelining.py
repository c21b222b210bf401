"""``torch.distributed.pipelining`` schedules with ``OVERLAP_F_B`` actions for the EP overlap.

A forward of one (stage, microbatch) and a full backward of another, run as one
``OVERLAP_F_B`` action, is what :meth:`~moe_overlap.ModelChunkSchedulePlan.run` overlaps
(the all-to-all of one under the compute of the other). ``ScheduleDualPipeV`` emits such
actions itself; :func:`pair_overlap_f_b` lowers any other compute-only schedule (e.g.
``ScheduleInterleaved1F1B``'s ``pipeline_order``) by pairing neighbouring forwards and
backwards, as Megatron-Core's combined 1F1B does with virtual pipeline stages.

Status: this module holds the lowering only. Running the paired actions through
``moe_overlap`` plans inside ``_PipelineScheduleRuntime`` (issue 13) is not built yet; the
lowered schedule runs today with torch's own sequential execution of the sub-actions.

Private torch names used: ``torch.distributed.pipelining.schedules._Action``,
``_ComputationType`` (``FORWARD``, ``FULL_BACKWARD``, ``OVERLAP_F_B``) and
``_add_send_recv`` (torch's own lowering of a compute schedule to communication, used to
prove a pairing cannot deadlock). Tested with torch 2.11 and 2.13; on another version
every function raises :class:`~moe_overlap.ConfigError` before touching them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from moe_overlap import ConfigError

if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import (
        _Action,  # pyright: ignore[reportPrivateUsage] - this module owns the private names
    )

__all__ = ["TESTED_TORCH", "check_torch", "pair_overlap_f_b"]

TESTED_TORCH = ("2.11", "2.13")
"""The torch releases (major.minor) whose pipelining internals this module was tested with."""


def check_torch(version: str | None = None) -> None:
    """Raise :class:`~moe_overlap.ConfigError` unless torch is one of :data:`TESTED_TORCH`."""
    found = version if version is not None else torch.__version__
    release = ".".join(found.split("+")[0].split(".")[:2])
    if release not in TESTED_TORCH:
        raise ConfigError(
            f"moe_overlap.integrations.pipelining: uses private names of "
            f"torch.distributed.pipelining tested with torch {', '.join(TESTED_TORCH)}; "
            f"received torch {found}. Pin one of those, or check the module against this "
            "release and add it to TESTED_TORCH"
        )


Order = Mapping[int, Sequence["_Action | None"]]


def pair_overlap_f_b(
    order: Order, *, num_stages: int, stage_to_rank: Callable[[int], int]
) -> dict[int, list[_Action | None]]:
    """Pair each rank's neighbouring forward and full backward into ``OVERLAP_F_B`` actions.

    ``order`` is a compute-only schedule (``schedule.pipeline_order``: per rank, ``F``,
    ``B`` (full backward) and ``None`` bubbles). Two neighbours on one rank are paired when
    one is a forward and the other a full backward of another microbatch (a backward needs
    the loss, hence every forward, of its own microbatch) and the schedule with the pair
    still lowers to communication without a deadlock: torch's own send/recv placement
    must succeed for every rank, the pair waiting for both of its inputs. The pair is
    ``(forward, backward)``, as ``ScheduleDualPipeV`` orders its own. Each rank's compute
    actions keep their order; ranks are paired in rank order.
    """
    check_torch()
    from torch.distributed.pipelining.schedules import (
        FORWARD,
        FULL_BACKWARD,
        OVERLAP_F_B,
        _Action,  # pyright: ignore[reportPrivateUsage] - see the module docstring
    )

    def pairable(a: _Action | None, b: _Action | None) -> _Action | None:
        if a is None or b is None or a.sub_actions is not None or b.sub_actions is not None:
            return None
        kinds = {a.computation_type, b.computation_type}
        if kinds != {FORWARD, FULL_BACKWARD} or a.microbatch_index == b.microbatch_index:
            return None
        f, bwd = (a, b) if a.computation_type == FORWARD else (b, a)
        return _Action(-1, OVERLAP_F_B, None, (f, bwd))

    out: dict[int, list[_Action | None]] = {r: list(order[r]) for r in sorted(order)}
    for rank in sorted(out):
        i = 0
        while i + 1 < len(out[rank]):
            acts = out[rank]
            pair = pairable(acts[i], acts[i + 1])
            if pair is not None:
                trial = {**out, rank: [*acts[:i], pair, *acts[i + 2 :]]}
                if _lowers(trial, num_stages, stage_to_rank):
                    out = trial
            i += 1
    return out


def _lowers(order: Order, num_stages: int, stage_to_rank: Callable[[int], int]) -> bool:
    """torch's send/recv placement succeeds (no rank waits forever)."""
    from torch.distributed.pipelining.schedules import (
        _add_send_recv,  # pyright: ignore[reportPrivateUsage] - see the module docstring
    )

    compute = {r: [a for a in acts if a is not None] for r, acts in order.items()}
    compute = {r: acts for r, acts in compute.items() if acts}
    try:
        _add_send_recv(compute, stage_to_rank, num_stages)
    except AssertionError:
        return False
    return True
