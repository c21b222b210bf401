"""One gloo rank of the checkpoint launches: ``python -m tests.integrations.ckpt_launch_worker``.

Four ranks; ``CKPT_PHASE`` is ``save`` or ``load`` (the loads run in a fresh set of
processes), ``CKPT_DIR`` the shared checkpoint folder. Every rank first makes every process
group the layouts below use, in one order (a group creation is a collective of every
rank), then runs:

1. FSDP2 DP=2 x EP=2 over the four ranks (``ckpt_worker.phase_fsdp_*``);
2. PP=2 x EP=2 over the four ranks (``ckpt_pp_worker.ppep_*``);
3. at once, on two ranks each: EP=2 (and EP=1, the adapter, FSDP2 DP=1 x EP=2, the
   refusals) on ranks 0-1 (``ckpt_worker.phase_save`` / ``phase_load``), PP=2 on ranks 2-3
   (``ckpt_pp_worker.pp_*``); neither makes a group or uses another's.

Prints JSON lines ``{"rank", "check", ...}`` (``rank``: the global rank); the pipeline
parts print one line per rank, ``check`` ``"pp"`` or ``"ppep"``, with their fields.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from tests.gloo_ranks import exit_worker
from tests.integrations import ckpt_pp_worker, ckpt_worker
from tests.integrations.ckpt_pp_worker import Where

WORLD = 4


def _group(ranks: list[int]) -> dist.ProcessGroup:
    return cast(dist.ProcessGroup, dist.new_group(ranks))


def _row(check: str, fields: dict[str, Any]) -> None:
    print(json.dumps({"rank": dist.get_rank(), "check": check, **fields}), flush=True)


def main() -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    assert dist.get_world_size() == WORLD, "the checkpoint launches take four ranks"
    root = Path(os.environ["CKPT_DIR"])
    phase = os.environ["CKPT_PHASE"]
    every = ckpt_worker.ep_world()

    # Every group of every layout, on every rank, in this order.
    pp_rank, ep_rank = divmod(rank, 2)
    ppep_ep = [_group([0, 1]), _group([2, 3])][pp_rank]
    ppep_pp = [_group([0, 2]), _group([1, 3])][ep_rank]
    ppep = Where(pp=ppep_pp, every=every, consensus=_group(list(range(WORLD))), ep=ppep_ep)
    ep_pair = _group([0, 1])
    alone = [_group([r]) for r in range(WORLD)][rank]
    pp_pair, pp_consensus = _group([2, 3]), _group([2, 3])
    pp = Where(pp=pp_pair, every=pp_pair, consensus=pp_consensus)

    if phase == "save":
        ckpt_worker.phase_fsdp_save(root)
        _row("ppep", ckpt_pp_worker.ppep_save(ppep, str(root)))
        if rank < 2:
            ckpt_worker.phase_save(root, ep_pair)
        else:
            _row("pp", ckpt_pp_worker.pp_save(pp, str(root)))
    else:
        ckpt_worker.phase_fsdp_resume(root)
        _row("ppep", ckpt_pp_worker.ppep_load(ppep, str(root)))
        if rank < 2:
            ckpt_worker.phase_load(root, ep_pair, ckpt_worker.ep_only_layout(ep_pair, alone))
        else:
            _row("pp", ckpt_pp_worker.pp_load(pp, str(root)))
    dist.barrier()


if __name__ == "__main__":
    exit_worker(main)
