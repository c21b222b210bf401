"""Predict a schedule's step time and memory on layouts you cannot run (yet).

Work in progress: see docs/planning.md.
"""

from moe_overlap.plan._layout import Layout, Schedule
from moe_overlap.plan._plan import Plan, costs_from_profile, fit_contention, plan
from moe_overlap.plan._profile import load_profile, profile_times
from moe_overlap.plan._simulate import Costs, PlanSpan, RankFigures, stage_layers

__all__ = [
    "Costs",
    "Layout",
    "Plan",
    "PlanSpan",
    "RankFigures",
    "Schedule",
    "costs_from_profile",
    "fit_contention",
    "load_profile",
    "plan",
    "profile_times",
    "stage_layers",
]
