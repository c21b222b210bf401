"""The pipeline parts of the checkpoint launches (``torch.distributed.checkpoint``), on gloo.

Run by ``ckpt_launch_worker.py``. Two stages per rank of ``ScheduleInterleaved1F1B``
prepared by ``prepare_schedule`` (pairs), one AdamW per stage, each rank checkpointing its
own stages (their state dicts merged: the keys are the model's global names, so they never
collide). :class:`Where` places a rank: its pipeline group, its EP group (PP x EP) and
the consensus group of its schedules.

PP=2 (``pp_*``, two ranks): ``pp_save`` trains the reference model 4 steps uninterrupted
(steps 3-4's losses, grads and parameters kept in ``pp_ref{rank}.pt``) and a second copy 2
steps, saved (``pp2/``; what was saved also in ``pp2_{rank}.pt``). ``pp_load`` (fresh
processes, models initialised differently): load ``pp2/`` and train steps 3-4 (compared
with ``pp_ref{rank}.pt``); load ``pp1/`` (saved by the test from the whole model in one
process) and compare with ``pp1.pt``; the transformers stages (Qwen3-MoE) load ``hf1/``
(the whole model's, saved by the test; compared with ``hf1.pt``), train one step and save
(``hf2/``, ``hf2_{rank}.pt``).

PP=2 x EP=2 (``ppep_*``, four ranks, each EP rank its own data, the dense gradients
averaged over the EP group): the same save and resume (``ppep2/``; the global tensors
gathered in ``ppep2_{pp_rank}.pt``), and ``pp1/`` (PP=1 x EP=1) loaded into the EP-sharded
stages.
"""

from __future__ import annotations

from dataclasses import dataclass
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
from tests.integrations.pp_worker import batch, build, loss_fn, make_schedule, stage_indices

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
FULL_FLAT = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
REF_CASE: dict[str, Any] = dict(
    pp=2, ep=1, schedule="interleaved", microbatches=4, delay=True, stages=[0, 1, 3, 4, 6]
)
PPEP_CASE: dict[str, Any] = {**REF_CASE, "ep": 2}
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


@dataclass(frozen=True)
class Where:
    """A rank's place: its pipeline group, the group of every rank of the layout (DCP's),
    the consensus group of the schedules it prepares, its EP group (``None``: EP=1)."""

    pp: dist.ProcessGroup
    every: dist.ProcessGroup
    consensus: dist.ProcessGroup
    ep: dist.ProcessGroup | None = None

    @property
    def pp_rank(self) -> int:
        return dist.get_rank(self.pp)

    @property
    def ep_rank(self) -> int:
        return 0 if self.ep is None else dist.get_rank(self.ep)

    @property
    def tag(self) -> str:
        """``{pp_rank}``, under EP ``{pp_rank}_{ep_rank}``: this rank's file names."""
        return str(self.pp_rank) if self.ep is None else f"{self.pp_rank}_{self.ep_rank}"


def scramble(model: nn.Module, seed: int) -> None:
    """Other initial weights than the saved run's (a load that did nothing shows)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen).to(p.dtype))


class Run:
    """A model's stages on this rank, their prepared schedule and one AdamW per stage."""

    def __init__(self, case: dict[str, Any], where: Where, *, scramble_seed: int | None) -> None:
        self.case, self.where = case, where
        self.built = build(case, where.ep, delay=case["delay"])
        if scramble_seed is not None:
            scramble(self.built.model, scramble_seed)
        self.schedule, self.stages = make_schedule(case, self.built, where.pp_rank, where.pp)
        prepare_schedule(self.schedule, pair=True, consensus_group=where.consensus)
        self.optims = [
            torch.optim.AdamW(s.parameters(), lr=LR, weight_decay=0.1) for s in self.stages
        ]
        self.last = 2 * case["pp"] - 1 in stage_indices(case, where.pp_rank)

    def step(self, step: int) -> list[float]:
        """Training step ``step`` (its own batch; under EP, each EP rank's own); the last
        stage's losses."""
        self.built.model.zero_grad(set_to_none=True)
        x, y = batch(self.case, step + 1000 * self.where.ep_rank)
        losses: list[Tensor] = []
        if self.where.pp_rank == 0:
            self.schedule.step(x, target=y, losses=losses)
        else:
            self.schedule.step(target=y, losses=losses)
        self._average_dense()
        for opt in self.optims:
            opt.step()
        return [float(v.detach()) for v in losses] if self.last else []

    def _average_dense(self) -> None:
        """Data parallelism over the EP group for the replicated parameters (the mean of
        their gradients), so the replicas stay identical: DCP keeps one copy of them."""
        if self.where.ep is None:
            return
        size = dist.get_world_size(self.where.ep)
        for s in self.stages:
            for name, p in s.named_parameters():
                if p.grad is not None and ".experts." not in name:
                    dist.all_reduce(p.grad, group=self.where.ep)
                    p.grad.div_(size)

    def grads(self) -> dict[str, Tensor]:
        return {
            n: p.grad.clone()
            for s in self.stages
            for n, p in s.named_parameters()
            if p.grad is not None
        }

    def params(self) -> dict[str, Tensor]:
        return {n: p.detach().clone() for s in self.stages for n, p in s.named_parameters()}

    def state(self, options: StateDictOptions = FLAT) -> dict[str, dict[str, Any]]:
        """This rank's checkpoint: every stage's model and optimizer state, merged
        (``FULL_FLAT``: the global tensors, a collective over the EP group)."""
        model: dict[str, Any] = {}
        optim: dict[str, Any] = {}
        model_options = StateDictOptions(full_state_dict=options.full_state_dict)
        for s, opt in zip(self.stages, self.optims, strict=True):
            model.update(get_model_state_dict(s, options=model_options))
            optim.update(get_optimizer_state_dict(s, opt, options=options))
        return {"model": model, "optim": optim}

    def full(self) -> dict[str, dict[str, Any]]:
        """The global tensors of this rank's stages (plain copies)."""
        return plain(self.state(FULL_FLAT) if self.where.ep is not None else self.state())

    def save(self, path: str) -> None:
        dcp_save(self.state(), checkpoint_id=path, process_group=self.where.every)

    def load(self, path: str) -> None:
        state = self.state()
        dcp_load(state, checkpoint_id=path, process_group=self.where.every)
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


def part_of(full: dict[str, dict[str, Any]], got: dict[str, dict[str, Any]]) -> list[str]:
    """``same`` of ``got`` and the entries of ``full`` under its keys (``full`` may hold
    more: the other stages')."""
    bad: list[str] = []
    for part, values in got.items():
        want = {k: full[part][k] for k in values if k in full[part]}
        bad += [f"{part}.{k}" for k in same(values, want)]
    return bad


def differ(a: dict[str, dict[str, Any]], b: dict[str, dict[str, Any]]) -> list[str]:
    """``same`` of each part (``model``, ``optim``) of two checkpoints."""
    return [f"{part}.{k}" for part in sorted(a.keys() | b.keys()) for k in same(a[part], b[part])]


def train_and_save(case: dict[str, Any], where: Where, folder: str, name: str) -> dict[str, Any]:
    """4 steps uninterrupted (``{name}_ref{tag}.pt``: the losses, grads and parameters of
    steps 3-4), and a second copy 2 steps then saved (``{name}2/``, its global tensors in
    ``{name}2_{pp_rank}.pt``)."""
    ref = Run(case, where, scramble_seed=None)
    losses, grads = [], []
    for step in range(4):
        losses.append(ref.step(step))
        if step >= 2:
            grads.append(ref.grads())
    saved_ref = {"losses": losses, "grads": grads, "params": ref.params()}
    torch.save(saved_ref, f"{folder}/{name}_ref{where.tag}.pt")

    run = Run(case, where, scramble_seed=None)
    first = [run.step(step) for step in range(2)]
    full = run.full()
    if where.ep_rank == 0:
        torch.save(full, f"{folder}/{name}2_{where.pp_rank}.pt")
    run.save(f"{folder}/{name}2")
    return {"same_first_steps": first == losses[:2], "keys": sorted(full["model"])}


def load_and_resume(
    case: dict[str, Any], where: Where, folder: str, name: str, seed: int
) -> dict[str, Any]:
    """In fresh processes: ``{name}2/`` into stages that started elsewhere, steps 3-4
    compared with the uninterrupted run; ``pp1/`` (the whole model, PP=1 x EP=1) loaded
    into the same layout and compared with ``pp1.pt``."""
    ref = torch.load(f"{folder}/{name}_ref{where.tag}.pt")
    run = Run(case, where, scramble_seed=seed)
    saved = torch.load(f"{folder}/{name}2_{where.pp_rank}.pt")
    differs_before = part_of(saved, run.full())
    run.load(f"{folder}/{name}2")
    load_diff = differ(run.full(), saved)
    losses, grad_diff = [], []
    for step in (2, 3):
        losses.append(run.step(step))
        grad_diff += same(run.grads(), ref["grads"][step - 2])
    param_diff = same(run.params(), ref["params"])

    fresh = Run(case, where, scramble_seed=seed + 1)
    fresh.load(f"{folder}/pp1")
    got = fresh.full()
    return {
        "differed_before_load": bool(differs_before),
        "load_diff": load_diff,
        "losses_identical": losses == ref["losses"][2:],
        "grad_diff": grad_diff,
        "param_diff": param_diff,
        "pp1_keys": sorted(got["model"]),
        "pp1_diff": part_of(torch.load(f"{folder}/pp1.pt"), got),
    }


def pp_save(where: Where, folder: str) -> dict[str, Any]:
    """PP=2: train, save."""
    return train_and_save(REF_CASE, where, folder, "pp")


def pp_load(where: Where, folder: str) -> dict[str, Any]:
    """PP=2 in fresh processes: resume, PP=1 -> PP=2, the transformers stages."""
    out = load_and_resume(REF_CASE, where, folder, "pp", 11)
    hf = Run(HF_CASE, where, scramble_seed=13)
    hf_full = torch.load(f"{folder}/hf1.pt")
    hf_differs_before = part_of(hf_full, hf.state())
    hf.load(f"{folder}/hf1")
    hf_diff = part_of(hf_full, hf.state())
    hf.step(1)
    hf_state = hf.state()
    torch.save(plain(hf_state), f"{folder}/hf2_{where.pp_rank}.pt")
    hf.save(f"{folder}/hf2")
    out["differed_before_load"] = out["differed_before_load"] and bool(hf_differs_before)
    return {**out, "hf_diff": hf_diff, "hf_keys": sorted(hf_state["model"])}


def ppep_save(where: Where, folder: str) -> dict[str, Any]:
    """PP=2 x EP=2: train, save."""
    return train_and_save(PPEP_CASE, where, folder, "ppep")


def ppep_load(where: Where, folder: str) -> dict[str, Any]:
    """PP=2 x EP=2 in fresh processes: resume; PP=1 x EP=1 -> PP=2 x EP=2."""
    return load_and_resume(PPEP_CASE, where, folder, "ppep", 21)


# ----------------------------------------------------------- the whole model, one process


def whole_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    return {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, opt, options=FLAT),
    }


def save_whole(folder: str) -> set[str]:
    """PP=1 x EP=1, in this process: the whole reference model trained 2 steps (plain
    backward, AdamW) saved (``pp1/``, ``pp1.pt``), and the whole transformers model one
    step of its own forward and loss (``hf1/``, ``hf1.pt``). The reference model's keys."""
    built = build(REF_CASE, None, delay=False)
    model = built.model
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    n = REF_CASE["microbatches"]
    for step in range(2):
        model.zero_grad(set_to_none=True)
        x, y = batch(REF_CASE, step)
        for xs, ys in zip(x.chunk(n), y.chunk(n), strict=True):
            (loss_fn(built.logits(xs, None), ys) / n).backward()
        opt.step()
    state = whole_state(model, opt)
    torch.save(plain(state), f"{folder}/pp1.pt")
    dcp_save(state, checkpoint_id=f"{folder}/pp1", no_dist=True)

    hf, hf_opt = whole_hf()
    x, y = batch(HF_CASE, 0)
    n = HF_CASE["microbatches"]
    for xs, ys in zip(x.chunk(n), y.chunk(n), strict=True):
        (loss_fn(hf(input_ids=xs).logits, ys) / n).backward()
    hf_opt.step()
    hf_state = whole_state(hf, hf_opt)
    torch.save(plain(hf_state), f"{folder}/hf1.pt")
    dcp_save(hf_state, checkpoint_id=f"{folder}/hf1", no_dist=True)
    return set(state["model"])


def whole_hf() -> tuple[Any, torch.optim.Optimizer]:
    model = build(HF_CASE, None, delay=False).model
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def load_whole(model: Any, opt: torch.optim.Optimizer, folder: str, name: str) -> list[str]:
    """The stages' checkpoint ``{name}/`` (any PP x EP) into the whole model in this
    process: what differs from the stages' saved global tensors ``{name}_{pp_rank}.pt``."""
    state = whole_state(model, opt)
    dcp_load(state, checkpoint_id=f"{folder}/{name}", no_dist=True)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"], options=FLAT)
    saved: dict[str, dict[str, Any]] = {"model": {}, "optim": {}}
    for rank in range(2):
        part = torch.load(f"{folder}/{name}_{rank}.pt")
        for k in saved:
            saved[k].update(part[k])
    return differ(whole_state(model, opt), saved)
