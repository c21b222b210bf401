"""One rank of the expert-parallel parity test: ``python -m tests.models.ep_worker``.

Reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``; runs every case on a
gloo group and prints one JSON line per case with this rank's verdict.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moe_overlap import ConfigError
from moe_overlap.blocks import TokenDispatcher
from tests.gloo_ranks import exit_worker
from tests.models._helpers import SMALL, check_parity


@dataclass(frozen=True)
class Case:
    """A config change plus how to run it."""

    fields: dict[str, object] = field(default_factory=dict[str, object])
    starved: tuple[int, ...] = ()
    overlap: bool = True
    count_group: bool = False
    padded: bool = False
    fill_drain: bool = False


CASES: dict[str, Case] = {
    "moe": Case(),
    "shared_delay": Case({"moe_shared_expert_hidden_size": 8, "delay_wgrad_compute": True}),
    "all_moe_aux": Case({"first_k_dense": 0, "moe_aux_loss_coeff": 0.01}),
    "starved_delay": Case({"delay_wgrad_compute": True}, starved=(0, 1)),
    "no_overlap": Case(overlap=False),
    "count_group": Case({"delay_wgrad_compute": True}, count_group=True),
    "padded_aux_delay": Case(
        {"moe_aux_loss_coeff": 0.01, "delay_wgrad_compute": True, "attention": "sdpa"},
        padded=True,
    ),
    # Chunked all-to-alls (moe_a2a_chunks): each chunk its own all-to-all with its own splits.
    "chunks3_shared_delay": Case(
        {"moe_a2a_chunks": 3, "moe_shared_expert_hidden_size": 8, "delay_wgrad_compute": True}
    ),
    "chunks2_starved_fill_drain": Case({"moe_a2a_chunks": 2}, starved=(0, 1), fill_drain=True),
    "chunks2_no_overlap": Case({"moe_a2a_chunks": 2}, overlap=False),
    "chunks40_padded_aux": Case({"moe_a2a_chunks": 40, "moe_aux_loss_coeff": 0.01}, padded=True),
}


def main() -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    counts = dist.new_group([0, 1])
    assert isinstance(counts, dist.ProcessGroup)  # typed as a union with a sentinel int
    only = os.environ.get("EP_CASES")  # a comma-separated subset (then no error cases)
    chosen = {k: v for k, v in CASES.items() if only is None or k in only.split(",")}
    try:
        for name, case in chosen.items():
            config = dataclasses.replace(SMALL, **case.fields)  # type: ignore[arg-type]
            result = check_parity(
                config,
                starved=case.starved,
                overlap=case.overlap,
                ep_group=dist.group.WORLD,
                count_group=counts if case.count_group else None,
                data_seed=100 + rank,
                padded=case.padded,
                fill_drain=case.fill_drain,
            )
            print(json.dumps({"case": name, "rank": rank, **dataclasses.asdict(result)}))
        if only is not None:
            return
        try:
            check_parity(dataclasses.replace(SMALL, num_experts=3), ep_group=dist.group.WORLD)
        except ConfigError as exc:
            print(json.dumps({"case": "config_error", "rank": rank, "message": str(exc)}))
        try:
            TokenDispatcher(4, 2, count_group=counts)
        except ConfigError as exc:
            print(json.dumps({"case": "count_group_error", "rank": rank, "message": str(exc)}))
    finally:
        dist.barrier()  # leave together: a rank tearing gloo down alone can abort the other
        dist.destroy_process_group()


if __name__ == "__main__":
    exit_worker(main)
