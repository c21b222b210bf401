"""Predict a schedule's step time, bubbles and activation memory on layouts you cannot run.

The schedule is never described a second time: one pipeline rank's ``serial``,
``combined_1f1b`` and ``fill_drain`` are the engine's macro steps, pipelines are torch's
own schedule classes lowered by their constructors
(:func:`~moe_overlap.integrations.pipelining.schedule_order`) and, for combined 1F1B, the
library's pairing. :func:`plan` replays every rank's actions, each action as the engine's
step list of that chunk run on two streams (:func:`moe_overlap.steps.replay`), from node
durations: measured (:func:`load_profile` of a serial step, :func:`costs_from_profile`) or
estimated (:func:`costs_from_model`: a roofline of the GPU and alpha-beta links,
:class:`ModelSpec`, :class:`Machine`). ``python -m moe_overlap plan --help`` runs it from
the command line; ``docs/planning.md`` shows what it predicts and how it was validated.
:func:`search_schedules` searches exact schedules of one pipeline rank beyond today's
(chunked all-to-all, several microbatches in flight, delayed weight gradients,
recomputation) for step time against peak memory (``docs/performance.md``);
:func:`choose_schedule` says which of today's and the searched schedules to run within a
memory budget, why, and how (``python -m moe_overlap plan --choose``).
"""

from moe_overlap.plan._choose import (
    CHOICE_SPACE,
    QUICK_CHOICE_SPACE,
    Bound,
    ScheduleChoice,
    choose_schedule,
)
from moe_overlap.plan._cli import add_plan_parser, run_plan
from moe_overlap.plan._contention import (
    COMPUTE_CONTENTION_KINDS,
    CONTENTION_KINDS,
    ContentionFit,
    ContentionKind,
    MeasuredSpan,
    fit_compute_contention_by_kind,
    fit_contention_by_kind,
    parse_contention_by_kind,
)
from moe_overlap.plan._layout import Layout, Schedule
from moe_overlap.plan._machine import MACHINES, Link, Machine, a2a_ms, p2p_ms, roofline_durations
from moe_overlap.plan._model import PRESETS, LayerKind, ModelSpec
from moe_overlap.plan._plan import (
    Plan,
    costs_from_model,
    costs_from_profile,
    fit_contention,
    plan,
)
from moe_overlap.plan._profile import load_profile, profile_times
from moe_overlap.plan._search import (
    Recompute,
    SearchPoint,
    SearchResult,
    SearchSpace,
    fit_activations,
    search_schedules,
    today_orders,
)
from moe_overlap.plan._search_steps import (
    ActivationModel,
    ScheduleGraph,
    SearchStep,
    StepTimes,
    check_exact,
    node_schedule,
    replay_order,
)
from moe_overlap.plan._simulate import Costs, PlanSpan, RankFigures, stage_layers

__all__ = [
    "CHOICE_SPACE",
    "COMPUTE_CONTENTION_KINDS",
    "CONTENTION_KINDS",
    "MACHINES",
    "PRESETS",
    "QUICK_CHOICE_SPACE",
    "ActivationModel",
    "Bound",
    "ContentionFit",
    "ContentionKind",
    "Costs",
    "LayerKind",
    "Layout",
    "Link",
    "Machine",
    "MeasuredSpan",
    "ModelSpec",
    "Plan",
    "PlanSpan",
    "RankFigures",
    "Recompute",
    "Schedule",
    "ScheduleChoice",
    "ScheduleGraph",
    "SearchPoint",
    "SearchResult",
    "SearchSpace",
    "SearchStep",
    "StepTimes",
    "a2a_ms",
    "add_plan_parser",
    "check_exact",
    "choose_schedule",
    "costs_from_model",
    "costs_from_profile",
    "fit_activations",
    "fit_compute_contention_by_kind",
    "fit_contention",
    "fit_contention_by_kind",
    "load_profile",
    "node_schedule",
    "p2p_ms",
    "parse_contention_by_kind",
    "plan",
    "profile_times",
    "replay_order",
    "roofline_durations",
    "run_plan",
    "search_schedules",
    "stage_layers",
    "today_orders",
]
