"""The core's hook points: one list of attached guards per hook (see :mod:`._guard`).

The core (plans, nodes) reads these lists on its path and calls each guard in them; it
imports nothing else of the checks. The lists are mutated in place, never rebound; the
registry that attaches a guard to the lists of the hooks it overrides
(``engine/_guards.py``) names each list by its hook.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._arguments import on_arguments

if TYPE_CHECKING:  # annotations only: the Guard Protocol's module imports the plans
    from ._guard import Guard

__all__ = [
    "on_ahead_entered",
    "on_ahead_left",
    "on_arguments",
    "on_backward_ended",
    "on_backward_failed",
    "on_before_release",
    "on_copies_backwarded",
    "on_inputs_read",
    "on_layer_started",
    "on_mlp_wgrad_listed",
    "on_model_returned",
    "on_node_detached",
    "on_node_entered",
    "on_node_forwarded",
    "on_node_left",
    "on_plan_built",
    "on_plan_started",
    "on_pre_dispatch_wgrad_listed",
    "on_slot_returned",
    "on_step_started",
]

if TYPE_CHECKING:  # declared apart: debug mode's beartype checks annotated assignments
    on_plan_started: list[Guard]
    on_inputs_read: list[Guard]
    on_plan_built: list[Guard]
    on_node_entered: list[Guard]
    on_node_left: list[Guard]
    on_node_forwarded: list[Guard]
    on_before_release: list[Guard]
    on_node_detached: list[Guard]
    on_slot_returned: list[Guard]
    on_model_returned: list[Guard]
    on_copies_backwarded: list[Guard]
    on_backward_failed: list[Guard]
    on_layer_started: list[Guard]
    on_pre_dispatch_wgrad_listed: list[Guard]
    on_mlp_wgrad_listed: list[Guard]
    on_step_started: list[Guard]
    on_backward_ended: list[Guard]
    on_ahead_entered: list[Guard]
    on_ahead_left: list[Guard]

on_plan_started = []
on_inputs_read = []
on_plan_built = []
on_node_entered = []
on_node_left = []
on_node_forwarded = []
on_before_release = []
on_node_detached = []
on_slot_returned = []
on_model_returned = []
on_copies_backwarded = []
on_backward_failed = []
on_layer_started = []
on_pre_dispatch_wgrad_listed = []
on_mlp_wgrad_listed = []
on_step_started = []
on_backward_ended = []
on_ahead_entered = []
on_ahead_left = []
