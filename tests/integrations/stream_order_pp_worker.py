"""One of four gloo ranks of the stream-order pipelining test: the prepared V and paired
schedules at PP=2 and at PP=2 x EP=2 under the stream-order checker, in one launch.

Run through ``tests.stream_checked`` (``MOE_OVERLAP_STREAM_CHECK=1``: the whole process is
checked). The four ranks are laid out as ``pp_worker.py`` lays them (rank ``p * 2 + e``,
pipeline groups ``{e, 2 + e}``): first as two PP=2 pipelines side by side (no EP: each
pipeline group alone), then as one PP=2 x EP=2 pipeline. For each layout and each schedule
in :data:`SCHEDULES` it prepares the schedule with ``prepare_schedule`` (``pp_worker.py``'s
models, stages and data) and runs two steps (the first with torch's shape inference), then
prints one JSON line: the checker's counters over those steps, the last stage's losses
and whether every parameter of this rank's stages has a finite gradient. Bit-identity with
torch's own execution is ``test_pipelining.py``'s (and, under the checker, with two stages
in one process, ``tests/engine/test_stream_order_compositions.py``'s): torch's run here
would double the launch's time under the checker.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch
import torch.distributed as dist

from moe_overlap.integrations.pipelining import prepare_schedule
from tests.integrations.pp_worker import build, make_schedule, run
from tests.stream_checked import checker

PP = 2
LAYOUTS = {"pp2": 1, "pp2-ep2": 2}
"""Each layout's EP size (PP=2 on the four ranks)."""
STAGES = [0, 1, 2, 3, 4]
"""Layer boundaries of the four stages: the dense layer alone, then one MoE layer each."""
SCHEDULES: list[dict[str, Any]] = [
    {"schedule": "dualpipev", "delay": True},
    {"schedule": "interleaved", "delay": True},  # pair=True: its F and B neighbours paired
    {"schedule": "zbv", "delay": False},
]
MICROBATCHES = 4  # DualPipeV's least: one per stage


def main() -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == PP * 2
    pp_rank, ep_rank = divmod(rank, 2)
    ep_groups = [dist.new_group([p * 2 + e for e in range(2)]) for p in range(PP)]
    pp_groups = [dist.new_group([p * 2 + e for p in range(PP)]) for e in range(2)]
    pp_group: Any = pp_groups[ep_rank]
    c = checker()
    for layout, ep in LAYOUTS.items():
        ep_group: Any = ep_groups[pp_rank] if ep > 1 else None
        for kind in SCHEDULES:
            case = {**kind, "pp": PP, "ep": ep, "microbatches": MICROBATCHES, "stages": STAGES}
            built = build(case, ep_group, delay=case["delay"])
            schedule, stages = make_schedule(case, built, pp_rank, pp_group)
            overlap = prepare_schedule(schedule, pair=case["schedule"] != "dualpipev")
            ops, cross = c.checked_ops, c.cross_stream_storages
            losses = run(case, built.model, schedule, pp_rank, 2)
            c.finish()
            params = [(n, p) for m in stages for n, p in m.named_parameters()]
            row = {
                "rank": rank,
                "layout": layout,
                "schedule": case["schedule"],
                "pairs": overlap.paired,
                "checked_ops": c.checked_ops - ops,
                "cross_stream_storages": c.cross_stream_storages - cross,
                "losses": losses,
                "losses_finite": all(math.isfinite(v) for step in losses for v in step),
                "bad_grads": [
                    n for n, p in params if p.grad is None or not bool(p.grad.isfinite().all())
                ],
            }
            print(json.dumps(row), flush=True)
    dist.barrier()
