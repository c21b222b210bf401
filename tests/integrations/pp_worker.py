"""One gloo rank of the pipelining tests: a torch schedule with and without moe_overlap.

Configured by ``PP_CASE`` (JSON: ``pp``, ``ep``, ``schedule`` ``"dualpipev"`` or
``"interleaved"``, ``microbatches``, ``delay``, ``stages`` (layer boundaries),
``starve`` (route no token to the last EP rank's experts), ``masks`` (attention and
padding masks as stage keywords), ``fail_at`` (a microbatch whose
forward fails in an overlapped action, on rank 0)), or ``{"cases": {name: case}}``: each
case in turn in the one process group (every case the same world size; each builds its own
groups and models, seeded, so it runs as it would alone), its rows carrying ``case``: one
launch for many cases (most of a launch is the ranks' start and imports). Prints one JSON
line per case and rank: the losses of each run and whether every gradient of this rank's
stages is bit-identical.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    ScheduleDualPipeV,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)

from moe_overlap import ScheduleError
from moe_overlap.adapters.transformers import TransformersMoEAdapter, TransformersMoEStage
from moe_overlap.blocks import TopKRouter, discard_wgrad
from moe_overlap.blocks._slots import PlainContext
from moe_overlap.integrations.pipelining import prepare_schedule
from moe_overlap.models import GPTMoEConfig, GPTMoEModel, GPTMoEStage, masked_cross_entropy
from moe_overlap.steps import Step
from tests.gloo_ranks import exit_worker

B, S = 2, 8
SCHEDULES: dict[str, Any] = {
    "dualpipev": ScheduleDualPipeV,
    "interleaved": ScheduleInterleaved1F1B,
    "interleaved-zero-bubble": ScheduleInterleavedZeroBubble,
    "looped-bfs": ScheduleLoopedBFS,
    "zbv": ScheduleZBVZeroBubble,
}
V_SHAPED = ("dualpipev", "zbv")


class Interleaving:
    """Counts the plan steps and how often consecutive ones belong to two microbatches."""

    def __init__(self) -> None:
        self.steps = 0
        self.switches = 0
        self._last: int | None = None

    def timer(self, step: Step, microbatch: int | None) -> None:
        del step
        self.steps += 1
        if self._last is not None and microbatch != self._last:
            self.switches += 1
        self._last = microbatch


def loss_fn(logits: Tensor, labels: Tensor) -> Tensor:
    return masked_cross_entropy(logits, labels, None)


@dataclass(frozen=True)
class Built:
    """A model for the case: its parameters in a fixed order, its stages, its own forward."""

    model: nn.Module
    stage: Callable[[range], nn.Module]
    logits: Callable[..., Tensor]


def build(case: dict[str, Any], ep_group: dist.ProcessGroup | None, *, delay: bool) -> Built:
    if case.get("model") == "qwen3_moe":
        return _qwen3_moe(case, delay=delay)
    config = GPTMoEConfig(
        num_layers=case["stages"][-1],
        first_k_dense=1,
        hidden_size=32,
        ffn_hidden_size=64,
        num_experts=4,
        moe_ffn_hidden_size=16,
        moe_router_topk=2,
        delay_wgrad_compute=delay,
        seed=3,
        dtype=torch.bfloat16 if case.get("device") == "cuda" else torch.float32,
    )
    model = GPTMoEModel(config, ep_group=ep_group, device=device(case))
    if case.get("starve"):
        for m in model.modules():
            if isinstance(m, TopKRouter):
                m.expert_bias[config.num_experts // 2 :] = -1e4
    return Built(
        model, lambda r: GPTMoEStage(model, r), lambda x, pos, **masks: model(x, pos, **masks)
    )


def _qwen3_moe(case: dict[str, Any], *, delay: bool) -> Built:
    """A transformers Qwen3-MoE (QK norm) through the adapter; layer 0 dense."""
    t: Any = importlib.import_module("transformers")
    config = t.Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=case["stages"][-1],
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        intermediate_size=48,
        mlp_only_layers=[0],
        max_position_embeddings=64,
    )
    torch.manual_seed(3)
    model: nn.Module = t.Qwen3MoeForCausalLM(config)
    adapter = TransformersMoEAdapter(model, delay_wgrad_compute=delay)

    def logits(x: Tensor, pos: Tensor | None) -> Tensor:
        out: Tensor = model(input_ids=x, position_ids=pos).logits
        return out

    return Built(model, lambda r: TransformersMoEStage(adapter, r), logits)


def stage_indices(case: dict[str, Any], pp_rank: int) -> list[int]:
    pp, n = case["pp"], 2 * case["pp"]
    if case["schedule"] in V_SHAPED:
        return [pp_rank, n - 1 - pp_rank]
    return [pp_rank, pp_rank + pp]


def make_schedule(
    case: dict[str, Any], built: Built, pp_rank: int, pp_group: dist.ProcessGroup
) -> tuple[Any, list[nn.Module]]:
    bounds, n = case["stages"], 2 * case["pp"]
    stages: list[Any] = []
    modules: list[nn.Module] = []
    for index in stage_indices(case, pp_rank):
        module = built.stage(range(bounds[index], bounds[index + 1]))
        modules.append(module)
        stages.append(PipelineStage(module, index, n, device(case), group=pp_group))
    cls = SCHEDULES[case["schedule"]]
    return cls(stages, n_microbatches=case["microbatches"], loss_fn=loss_fn), modules


def device(case: dict[str, Any]) -> torch.device:
    return torch.device(case.get("device", "cpu"))


def batch(case: dict[str, Any], step: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    n = B * case["microbatches"]
    x = torch.randint(0, 128, (n, S), generator=gen)
    y = torch.randint(0, 128, (n, S), generator=gen)
    return x.to(device(case)), y.to(device(case))


def positions(case: dict[str, Any]) -> Tensor:
    """Position ids that are not the default ``0 .. S-1``: row ``r`` starts at ``3 r``."""
    n = B * case["microbatches"]
    rows = torch.arange(n)[:, None] * 3 + torch.arange(S)[None, :]
    return rows.to(device(case))


def masks(case: dict[str, Any]) -> dict[str, Tensor]:
    """Padded rows (``masks``): even rows left-padded by 3, odd rows right-padded by 2, and
    an attention mask hiding key 1 from the second half of each row's queries."""
    if not case.get("masks"):
        return {}
    n = B * case["microbatches"]
    padding = torch.zeros(n, S, dtype=torch.bool)
    padding[0::2, :3] = True
    padding[1::2, S - 2 :] = True
    attention = torch.zeros(n, 1, S, S, dtype=torch.bool)
    attention[:, 0, S // 2 :, 1] = True
    return {"attention_mask": attention.to(device(case)), "padding_mask": padding.to(device(case))}


def run(
    case: dict[str, Any],
    model: nn.Module,
    schedule: Any,
    pp_rank: int,
    steps: int,
) -> list[list[float]]:
    """``steps`` schedule steps (grads zeroed before each); the last stage's losses."""
    losses_per_step: list[list[float]] = []
    last = 2 * case["pp"] - 1 in stage_indices(case, pp_rank)
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        x, y = batch(case, step)
        kwargs: dict[str, Tensor] = (
            {"position_ids": positions(case)} if case.get("positions") else {}
        )
        kwargs.update(masks(case))
        losses: list[Tensor] = []
        if pp_rank == 0:
            schedule.step(x, target=y, losses=losses, **kwargs)
        else:
            schedule.step(target=y, losses=losses, **kwargs)
        losses_per_step.append([float(v.detach()) for v in losses] if last else [])
    return losses_per_step


def plain_reference(case: dict[str, Any], built: Built, steps: int) -> list[Tensor | None]:
    """Single-process plain training of the whole model (its own forward): last step's grads."""
    n = case["microbatches"]
    for step in range(steps):
        built.model.zero_grad(set_to_none=True)
        x, y = batch(case, step)
        pos = positions(case) if case.get("positions") else None
        pos_chunks = pos.chunk(n) if pos is not None else [None] * n
        mask_chunks = [{k: v.chunk(n)[i] for k, v in masks(case).items()} for i in range(n)]
        for xs, ys, ps, ms in zip(x.chunk(n), y.chunk(n), pos_chunks, mask_chunks, strict=True):
            (loss_fn(built.logits(xs, ps, **ms), ys) / n).backward()
    return [p.grad for p in built.model.parameters()]


def main() -> None:
    config: dict[str, Any] = json.loads(os.environ["PP_CASE"])
    cases: dict[str, dict[str, Any]] = config.get("cases", {"": config})
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    first = next(iter(cases.values()))
    dist.init_process_group("nccl" if device(first).type == "cuda" else "gloo")
    torch.use_deterministic_algorithms(True)
    for case_name, case in cases.items():
        run_case(case_name, case)


def run_case(case_name: str, case: dict[str, Any]) -> None:
    """One case on this rank (new groups; the process group is the launch's)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    pp, ep = case["pp"], case["ep"]
    assert world == pp * ep
    pp_rank, ep_rank = divmod(rank, ep)
    ep_groups = [_group([p * ep + e for e in range(ep)]) for p in range(pp)]
    pp_groups = [_group([p * ep + e for p in range(pp)]) for e in range(ep)]
    ep_group = ep_groups[pp_rank] if ep > 1 else None
    pp_group = pp_groups[ep_rank]
    steps = 2

    if case.get("eval"):
        evaluate(case, ep_group, pp_rank, pp_group, case_name)
        dist.barrier()
        return
    base_built = build(case, ep_group, delay=False)
    base_schedule, base_stages = make_schedule(case, base_built, pp_rank, pp_group)
    base = run(case, base_built.model, base_schedule, pp_rank, steps)

    built = build(case, ep_group, delay=case["delay"])
    model = built.model
    schedule, stages = make_schedule(case, built, pp_rank, pp_group)
    seen = Interleaving()
    overlap = prepare_schedule(
        schedule,
        pair=case["schedule"] != "dualpipev",
        overlap=case.get("overlap", True),
        observer=seen,
    )
    failure = ""
    if case.get("fail_at") is not None:
        assert isinstance(model, GPTMoEModel)
        failure = fail_once(case, model, schedule, pp_rank)
        discard_wgrad(model)
    got = run(case, model, schedule, pp_rank, steps)

    mine = [p for m in stages for p in m.parameters()]
    theirs = [p for m in base_stages for p in m.parameters()]
    names = [n for m in stages for n, _ in m.named_parameters()]
    differ = [
        name
        for name, a, b in zip(names, mine, theirs, strict=True)
        if not (
            (a.grad is None and b.grad is None)
            or (a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad))
        )
    ]
    identical = not differ
    ids = {id(p) for p in theirs}
    ref = plain_reference(case, build(case, ep_group, delay=False), steps)
    rtol, atol = (1e-4, 1e-6) if device(case).type == "cpu" else (5e-2, 1e-2)
    close = all(
        g is not None and p.grad is not None and torch.allclose(p.grad, g, rtol=rtol, atol=atol)
        for p, g in zip(base_built.model.parameters(), ref, strict=True)
        if id(p) in ids
    )
    print(
        json.dumps(
            {
                "case": case_name,
                "rank": rank,
                "pairs": overlap.paired,
                "plan_steps": seen.steps,
                "switches": seen.switches,
                "base": base,
                "got": got,
                "identical": identical,
                "differ": differ,
                "close_to_plain": close,
                "failure": failure,
            }
        ),
        flush=True,
    )
    dist.barrier()


def _group(ranks: list[int]) -> Any:
    """A group of ``ranks`` (every rank creates every group; a non-member gets torch's
    placeholder, never used)."""
    return dist.new_group(ranks)


def fail_once(case: dict[str, Any], model: GPTMoEModel, schedule: Any, pp_rank: int) -> str:
    """One step in which a layer of rank 0 fails at microbatch ``fail_at`` (world 1 only:
    a peer of a failed rank would wait for it)."""
    layer = model.layer_list[-1]
    original = layer.pre_dispatch
    calls = {"n": 0}

    def failing(*args: Any) -> Any:
        if isinstance(args[0], PlainContext):  # torch's shape inference: the plain path
            return original(*args)
        calls["n"] += 1
        if calls["n"] == case["fail_at"]:
            raise RuntimeError("injected failure")
        return original(*args)

    setattr(layer, "pre_dispatch", failing)  # noqa: B010 - an instance attribute shadows it
    message = ""
    try:
        run(case, model, schedule, pp_rank, 1)
    except ScheduleError as e:
        message = str(e)
    finally:
        del layer.pre_dispatch
    model.zero_grad(set_to_none=True)
    return message


def make_eval_schedule(
    case: dict[str, Any], built: Built, pp_rank: int, pp_group: dist.ProcessGroup, *, loss: bool
) -> Any:
    """The case's schedule with the loss function, or without one (forward only)."""
    bounds, n = case["stages"], 2 * case["pp"]
    stages = [
        PipelineStage(
            built.stage(range(bounds[i], bounds[i + 1])), i, n, device(case), group=pp_group
        )
        for i in stage_indices(case, pp_rank)
    ]
    cls = SCHEDULES[case["schedule"]]
    return cls(stages, n_microbatches=case["microbatches"], loss_fn=loss_fn if loss else None)


def evaluate(
    case: dict[str, Any],
    ep_group: dist.ProcessGroup | None,
    pp_rank: int,
    pp_group: Any,
    case_name: str = "",
) -> None:
    """``schedule.eval()`` and a schedule without ``loss_fn``, prepared: the plain model's
    outputs and losses (torch's own where torch runs it), no gradient, no pending wgrad;
    then a training step of the same schedule exact against torch's own."""
    n = case["microbatches"]
    x, y = batch(case, 0)
    args = (x,) if pp_rank == 0 else ()
    last = 2 * case["pp"] - 1 in stage_indices(case, pp_rank)
    plain = build(case, ep_group, delay=False)
    with torch.no_grad():
        logits = [plain.logits(xs, None) for xs in x.chunk(n)]
        want_losses = [loss_fn(lg, ys) for lg, ys in zip(logits, y.chunk(n), strict=True)]
    want_out = torch.cat(logits)
    row: dict[str, Any] = {"case": case_name, "rank": dist.get_rank()}

    built = build(case, ep_group, delay=case["delay"])
    schedule = make_eval_schedule(case, built, pp_rank, pp_group, loss=True)
    prepare_schedule(schedule, pair=case["schedule"] != "dualpipev")
    losses: list[Tensor] = []
    out = schedule.eval(*args, target=y, losses=losses)
    row["eval_losses"] = (not last) or all(
        torch.equal(a, b) for a, b in zip(losses, want_losses, strict=True)
    )
    row["eval_output"] = (not last) or torch.equal(out, want_out)
    row["eval_no_grads"] = all(p.grad is None for p in built.model.parameters())
    if not torch.__version__.startswith("2.13"):  # the eval -> train switch: 2.13's
        row["step_after_eval"] = True  # (not checked on another torch)
        _forward_only(case, ep_group, pp_rank, pp_group, args, last, want_out, row)
        print(json.dumps(row), flush=True)
        return
    # The same schedule trains next: exact against torch's own step of a fresh model.
    schedule.step(*args, target=y, losses=[])
    base = build(case, ep_group, delay=False)
    base_schedule = make_eval_schedule(case, base, pp_rank, pp_group, loss=True)
    base_schedule.step(*args, target=y, losses=[])
    mine = [p for p in built.model.parameters() if p.grad is not None]
    theirs = [p for p in base.model.parameters() if p.grad is not None]
    row["step_after_eval"] = len(mine) == len(theirs) > 0 and all(
        torch.equal(a.grad, b.grad)
        for a, b in zip(mine, theirs, strict=True)
        if a.grad is not None and b.grad is not None
    )

    _forward_only(case, ep_group, pp_rank, pp_group, args, last, want_out, row)
    print(json.dumps(row), flush=True)


def _forward_only(
    case: dict[str, Any],
    ep_group: dist.ProcessGroup | None,
    pp_rank: int,
    pp_group: Any,
    args: tuple[Tensor, ...],
    last: bool,
    want_out: Tensor,
    row: dict[str, Any],
) -> None:
    """A prepared schedule built without ``loss_fn``: two steps (autograd on, then off)."""
    forward_only = build(case, ep_group, delay=case["delay"])
    schedule = make_eval_schedule(case, forward_only, pp_rank, pp_group, loss=False)
    prepare_schedule(schedule, pair=case["schedule"] != "dualpipev")
    outs = [schedule.step(*args)]
    with torch.no_grad():
        outs.append(schedule.step(*args))
    row["no_loss_fn_output"] = (not last) or all(
        isinstance(o, Tensor) and torch.equal(o.detach(), want_out) for o in outs
    )
    row["no_loss_fn_no_grads"] = all(p.grad is None for p in forward_only.model.parameters())


if __name__ == "__main__":
    exit_worker(main)
