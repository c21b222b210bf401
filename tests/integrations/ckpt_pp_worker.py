"""One gloo rank of the pipeline checkpoint tests (``torch.distributed.checkpoint``).

Configured by ``CKPT_CASE`` (JSON: ``phase`` 1 or 2, ``dir`` the shared folder). Two
stages per rank of ``ScheduleInterleaved1F1B`` prepared by ``prepare_schedule`` (pairs),
one AdamW per stage, each rank checkpointing its own stages (their state dicts merged: the
keys are the model's global names, so they never collide).

Phase 1: the reference model trained 4 steps uninterrupted (its losses, grads and
parameters of steps 3-4 kept in ``ref{rank}.pt``); a second copy trained 2 steps and saved
(``pp2/``; what was saved also in ``pp2_{rank}.pt``).

Phase 2 (fresh processes, models initialised differently): load ``pp2/`` and train steps
3-4 (compared with ``ref{rank}.pt``); load ``pp1/`` (saved by the test from the whole model
in one process) and compare with ``pp1.pt``; the transformers stages (Qwen3-MoE) load
``hf1/`` (the whole model's, saved by the test; compared with ``hf1.pt``), train one step
and save (``hf2/``, ``hf2_{rank}.pt``). Prints one JSON line per rank and phase.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from moe_overlap.integrations.pipelining import prepare_schedule
from tests.gloo_ranks import exit_worker
from tests.integrations.pp_worker import batch, build, make_schedule, stage_indices

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
REF_CASE: dict[str, Any] = dict(
    pp=2, ep=1, schedule="interleaved", microbatches=4, delay=True, stages=[0, 1, 3, 4, 6]
)
HF_CASE: dict[str, Any] = dict(
    pp=2,
    ep=1,
    schedule="interleaved",
    microbatches=2,
    delay=False,
    stages=[0, 1, 2, 3, 4],
    model="qwen3_moe",
)
LR = 1e-2


def scramble(model: nn.Module, seed: int) -> None:
    """Other initial weights than the saved run's (a load that did nothing shows)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen).to(p.dtype))


class Run:
    """A model's stages on this rank, their prepared schedule and one AdamW per stage."""

    def __init__(self, case: dict[str, Any], pp_rank: int, *, scramble_seed: int | None) -> None:
        self.case, self.pp_rank = case, pp_rank
        self.built = build(case, None, delay=case["delay"])
        if scramble_seed is not None:
            scramble(self.built.model, scramble_seed)
        group = dist.group.WORLD
        assert group is not None
        self.schedule, self.stages = make_schedule(case, self.built, pp_rank, group)
        prepare_schedule(self.schedule, pair=True)
        self.optims = [
            torch.optim.AdamW(s.parameters(), lr=LR, weight_decay=0.1) for s in self.stages
        ]
        self.last = 2 * case["pp"] - 1 in stage_indices(case, pp_rank)

    def step(self, step: int) -> list[float]:
        """Training step ``step`` (its own batch); the last stage's losses."""
        self.built.model.zero_grad(set_to_none=True)
        x, y = batch(self.case, step)
        losses: list[Tensor] = []
        if self.pp_rank == 0:
            self.schedule.step(x, target=y, losses=losses)
        else:
            self.schedule.step(target=y, losses=losses)
        for opt in self.optims:
            opt.step()
        return [float(v.detach()) for v in losses] if self.last else []

    def grads(self) -> dict[str, Tensor]:
        return {
            n: p.grad.clone()
            for s in self.stages
            for n, p in s.named_parameters()
            if p.grad is not None
        }

    def params(self) -> dict[str, Tensor]:
        return {n: p.detach().clone() for s in self.stages for n, p in s.named_parameters()}

    def state(self) -> dict[str, dict[str, Any]]:
        """This rank's checkpoint: every stage's model and optimizer state, merged."""
        model: dict[str, Any] = {}
        optim: dict[str, Any] = {}
        for s, opt in zip(self.stages, self.optims, strict=True):
            model.update(get_model_state_dict(s))
            optim.update(get_optimizer_state_dict(s, opt, options=FLAT))
        return {"model": model, "optim": optim}

    def load(self, path: str) -> None:
        state = self.state()
        dcp_load(state, checkpoint_id=path)
        for s, opt in zip(self.stages, self.optims, strict=True):
            mine = get_model_state_dict(s).keys()
            set_model_state_dict(s, {k: state["model"][k] for k in mine})
            keys = get_optimizer_state_dict(s, opt, options=FLAT).keys()
            set_optimizer_state_dict(s, opt, {k: state["optim"][k] for k in keys}, options=FLAT)


def plain(state: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        part: {k: v.clone() if isinstance(v, Tensor) else v for k, v in d.items()}
        for part, d in state.items()
    }


def same(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Keys whose values differ (tensors bit for bit), or that only one side has."""
    bad = sorted(a.keys() ^ b.keys())
    for k in sorted(a.keys() & b.keys()):
        x, y = a[k], b[k]
        if isinstance(x, Tensor) or isinstance(y, Tensor):
            ok = isinstance(x, Tensor) and isinstance(y, Tensor) and torch.equal(x, y)
        else:
            ok = x == y
        if not ok:
            bad.append(k)
    return bad


def phase1(folder: str, rank: int) -> dict[str, Any]:
    ref = Run(REF_CASE, rank, scramble_seed=None)
    losses, grads, params = [], [], {}
    for step in range(4):
        losses.append(ref.step(step))
        if step >= 2:
            grads.append(ref.grads())
    params = ref.params()
    torch.save({"losses": losses, "grads": grads, "params": params}, f"{folder}/ref{rank}.pt")

    run = Run(REF_CASE, rank, scramble_seed=None)
    first = [run.step(step) for step in range(2)]
    state = run.state()
    torch.save(plain(state), f"{folder}/pp2_{rank}.pt")
    dcp_save(state, checkpoint_id=f"{folder}/pp2")
    return {"rank": rank, "same_first_steps": first == losses[:2], "keys": sorted(state["model"])}


def phase2(folder: str, rank: int) -> dict[str, Any]:
    ref = torch.load(f"{folder}/ref{rank}.pt")
    run = Run(REF_CASE, rank, scramble_seed=11)
    saved = torch.load(f"{folder}/pp2_{rank}.pt")
    differs_before = same(run.state()["model"], saved["model"])
    run.load(f"{folder}/pp2")
    loaded = run.state()
    load_diff = same(loaded["model"], saved["model"]) + same(loaded["optim"], saved["optim"])
    losses, grad_diff = [], []
    for step in (2, 3):
        losses.append(run.step(step))
        grad_diff += same(run.grads(), ref["grads"][step - 2])
    param_diff = same(run.params(), ref["params"])

    fresh = Run(REF_CASE, rank, scramble_seed=12)
    fresh.load(f"{folder}/pp1")
    full = torch.load(f"{folder}/pp1.pt")
    got = fresh.state()
    pp1_keys = sorted(got["model"])
    pp1_diff = same(got["model"], {k: full["model"][k] for k in got["model"]})
    pp1_diff += same(got["optim"], {k: full["optim"][k] for k in got["optim"]})

    hf = Run(HF_CASE, rank, scramble_seed=13)
    hf_full = torch.load(f"{folder}/hf1.pt")
    hf_before = hf.state()
    hf_differs_before = same(
        hf_before["model"], {k: hf_full["model"][k] for k in hf_before["model"]}
    )
    hf.load(f"{folder}/hf1")
    hf_got = hf.state()
    hf_diff = same(hf_got["model"], {k: hf_full["model"][k] for k in hf_got["model"]})
    hf_diff += same(hf_got["optim"], {k: hf_full["optim"][k] for k in hf_got["optim"]})
    hf.step(1)
    hf_state = hf.state()
    torch.save(plain(hf_state), f"{folder}/hf2_{rank}.pt")
    dcp_save(hf_state, checkpoint_id=f"{folder}/hf2")
    return {
        "rank": rank,
        "differed_before_load": bool(differs_before) and bool(hf_differs_before),
        "load_diff": load_diff,
        "losses_identical": losses == ref["losses"][2:],
        "grad_diff": grad_diff,
        "param_diff": param_diff,
        "pp1_keys": pp1_keys,
        "pp1_diff": pp1_diff,
        "hf_diff": hf_diff,
        "hf_keys": sorted(hf_state["model"]),
    }


def main() -> None:
    case: dict[str, Any] = json.loads(os.environ["CKPT_CASE"])
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    folder = case["dir"]
    out = phase1(folder, rank) if case["phase"] == 1 else phase2(folder, rank)
    print(json.dumps(out), flush=True)
    dist.barrier()


if __name__ == "__main__":
    exit_worker(main)
