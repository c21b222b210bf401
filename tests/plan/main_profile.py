"""The main configuration's measured serial profile (H200, round 9) and activation model,
shared by the planner's search tests."""

from __future__ import annotations

import json
from pathlib import Path

from moe_overlap.plan import ActivationModel, Costs, costs_from_profile, load_profile

ROUND9 = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "round9" / "results.json"
MEMORY = ActivationModel.of_layer(hidden=4096, moe_ffn=2048, top_k=8, static_units=140.0)


def main_costs() -> Costs:
    """The main configuration's measured serial profile (H200), contention as validated."""
    row = json.loads(ROUND9.read_text())["results"][0]
    profile = load_profile(row["order_search"]["serial_slot_durations"])
    return costs_from_profile(profile, num_layers=4, comm_contention=0.05525)
