"""One gloo rank of the recovery tests: steps of prepared schedules with injected failures.

Configured by ``PP_RECOVERY`` (JSON: ``pp``, ``ep``, ``timeout`` (seconds, of the pipeline
and expert-parallel groups; a rank blocked on a failed peer fails after it) and ``cases``).
Each case builds new groups, a model, torch's own schedule (the reference) and a prepared
one, then runs three steps of the prepared one: step 0 (must be exact), step 1 with the
case's fault on the case's ranks, step 2 after the documented recovery (zero the gradients,
``discard_wgrad``). A case is ``schedule``, ``microbatches``, ``delay`` and a ``fault``:
``kind`` (``forward``, ``backward``, ``overlap`` (the forward half of an ``OVERLAP_F_B``
fails), ``input``, ``weight`` (the ``k``-th action of that kind fails), ``before`` (a backward
inside ``claim_wgrad`` left delayed weight gradients pending: the library's check refuses the step
before it communicates), ``after`` (torch's output merge fails, after the communication),
``interrupt`` (a ``KeyboardInterrupt`` inside a forward)), ``at`` (one for every rank, or by
rank: which ranks reach their own failure depends on the schedule) and ``ranks``. Prints one
JSON line per case and rank: how each step ended, and for a poisoned schedule whether a
new schedule on the same groups is refused.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining.schedules import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    FULL_BACKWARD,
    OVERLAP_F_B,
)

from moe_overlap.blocks import discard_wgrad
from moe_overlap.blocks._slots import PlainContext
from moe_overlap.integrations.pipelining import prepare_schedule
from moe_overlap.models import GPTMoEModel
from moe_overlap.wgrad import claim_wgrad
from tests.gloo_ranks import exit_worker
from tests.integrations.pp_worker import batch, build, make_schedule

KINDS = {
    "forward": FORWARD,
    "backward": FULL_BACKWARD,
    "overlap": OVERLAP_F_B,
    "input": BACKWARD_INPUT,
    "weight": BACKWARD_WEIGHT,
    "interrupt": FORWARD,
}


def step(case: dict[str, Any], model: nn.Module, schedule: Any, pp_rank: int, n: int) -> None:
    """Step ``n`` of ``schedule`` from zeroed gradients (the recovery before every step)."""
    model.zero_grad(set_to_none=True)
    x, y = batch(case, n)
    if pp_rank == 0:
        schedule.step(x, target=y)
    else:
        schedule.step(target=y)


def grads(modules: list[nn.Module]) -> list[Tensor | None]:
    return [p.grad.clone() if p.grad is not None else None for m in modules for p in m.parameters()]


def same(a: list[Tensor | None], b: list[Tensor | None]) -> bool:
    return len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a, b, strict=True)
    )


def outcome(run: Any) -> dict[str, Any]:
    """How a call ended: ``raised`` (the exception's type or None), its message, seconds."""
    start = time.monotonic()
    try:
        run()
    except BaseException as e:  # KeyboardInterrupt is a case
        cause = e.__cause__
        return {
            "raised": type(e).__name__,
            "message": str(e),
            "cause": type(cause).__name__ if cause is not None else None,
            "seconds": time.monotonic() - start,
        }
    return {"raised": None, "message": "", "cause": None, "seconds": time.monotonic() - start}


class Fault:
    """Arms a failure in this rank's ``at``-th action of one kind (see the module doc)."""

    def __init__(self, model: GPTMoEModel, schedule: Any, fault: dict[str, Any]) -> None:
        self.kind: str = fault["kind"]
        at: int | dict[str, int] = fault.get("at", 1)
        self.at = at if isinstance(at, int) else at[str(dist.get_rank())]
        self.calls = 0
        self.armed = False
        self.schedule = schedule
        self.model = model
        self.active = False

    def install(self) -> None:
        self.active = True
        if self.kind == "before":  # a claimed backward leaves delayed weight gradients pending
            x, _ = batch({"microbatches": 1, "device": "cpu"}, 7)
            with claim_wgrad(self.model):
                self.model(x, None).float().mean().backward()
            return
        if self.kind == "after":
            merge = self.schedule._merge_outputs

            def failing_merge(*args: Any) -> Any:
                if self.active:
                    raise RuntimeError("injected failure in torch's output merge")
                return merge(*args)

            self.schedule._merge_outputs = failing_merge
            return
        functions = self.schedule._comp_type_to_function_map
        kind = KINDS[self.kind]
        original = functions[kind]

        def counted(action: Any, ctx: Any) -> None:
            self.calls += 1
            if not self.active or self.calls != self.at:
                original(action, ctx)
                return
            if self.kind == "weight":  # no plan runs in W: fail in the action itself
                raise RuntimeError("injected failure in a weight backward")
            self.armed = True
            try:
                original(action, ctx)
            finally:
                self.armed = False

        functions[kind] = counted
        for layer in self.model.layer_list:
            self._patch(layer)

    def _patch(self, layer: nn.Module) -> None:
        original: Any = getattr(layer, "pre_dispatch")  # noqa: B009 - nn.Module types it a Tensor
        backward = self.kind in ("backward", "input")

        def failing(ctx: Any, *args: Any) -> Any:
            if isinstance(ctx, PlainContext) or not self.armed or backward:
                out = original(ctx, *args)
                first = out[0] if isinstance(out, tuple) else out
                if backward and first.requires_grad and not isinstance(ctx, PlainContext):
                    first.register_hook(self._backward_hook)
                return out
            if self.kind == "interrupt":
                raise KeyboardInterrupt
            raise RuntimeError("injected failure in a forward")

        setattr(layer, "pre_dispatch", failing)  # noqa: B010 - an instance attribute shadows it

    def _backward_hook(self, grad: Tensor) -> Tensor:
        if self.armed:
            raise RuntimeError("injected failure in a backward")
        return grad

    def remove(self) -> None:
        self.active = False
        for layer in self.model.layer_list:
            if "pre_dispatch" in vars(layer):
                del layer.pre_dispatch


def group(ranks: list[int], timeout: timedelta) -> dist.ProcessGroup:
    """A new gloo group (every rank creates every group, in the same order; a non-member
    gets torch's placeholder, never used)."""
    made = dist.new_group(ranks, timeout=timeout, backend="gloo")
    return cast("dist.ProcessGroup", made)


def run_case(
    case: dict[str, Any], rank: int, pp: int, ep: int, timeout: timedelta
) -> dict[str, Any]:
    pp_rank, ep_rank = divmod(rank, ep)
    # New groups for every case: a poisoned case's groups may hold messages in flight.
    ep_groups = [group([p * ep + e for e in range(ep)], timeout) for p in range(pp)]
    pp_groups = [group([p * ep + e for p in range(pp)], timeout) for e in range(ep)]
    ep_group = ep_groups[pp_rank] if ep > 1 else None
    pp_group = pp_groups[ep_rank]
    torch.use_deterministic_algorithms(True)

    ref_built = build(case, ep_group, delay=False)
    ref_schedule, ref_stages = make_schedule(case, ref_built, pp_rank, pp_group)
    step(case, ref_built.model, ref_schedule, pp_rank, 0)
    ref0 = grads(ref_stages)
    step(case, ref_built.model, ref_schedule, pp_rank, 2)
    ref2 = grads(ref_stages)

    built = build(case, ep_group, delay=case["delay"])
    model = built.model
    assert isinstance(model, GPTMoEModel)
    schedule, stages = make_schedule(case, built, pp_rank, pp_group)
    extra: dict[str, Any] = {}
    row: dict[str, Any] = {"case": case["name"], "rank": rank}
    if case.get("consensus_timeout"):
        extra["consensus_timeout"] = timedelta(seconds=case["consensus_timeout"])
    if case.get("own_consensus_group"):  # a group of the user's, and one lacking ranks
        alone = [group([r], timeout) for r in range(pp * ep)][rank]
        row["consensus_group_alone"] = outcome(
            lambda: prepare_schedule(schedule, consensus_group=alone)
        )
        extra["consensus_group"] = group(list(range(pp * ep)), 4 * timeout)
    prepare_schedule(schedule, pair=case["schedule"] == "interleaved", **extra)
    row["step0"] = outcome(lambda: step(case, model, schedule, pp_rank, 0))
    row["step0_exact"] = same(grads(stages), ref0)

    fault = Fault(model, schedule, case["fault"])
    if rank in case["fault"]["ranks"]:
        fault.install()
    row["step1"] = outcome(lambda: step(case, model, schedule, pp_rank, 1))
    fault.remove()
    discard_wgrad(model)  # the documented recovery (zero_grad is in step)
    row["step2"] = outcome(lambda: step(case, model, schedule, pp_rank, 2))
    row["step2_exact"] = row["step2"]["raised"] is None and same(grads(stages), ref2)
    if row["step2"]["raised"] is not None:  # a new schedule on the same groups: refused
        again = build(case, ep_group, delay=case["delay"])
        fresh, _ = make_schedule(case, again, pp_rank, pp_group)
        row["rebuilt_on_old_groups"] = outcome(
            lambda: prepare_schedule(fresh, pair=case["schedule"] == "interleaved")
        )
    return row


def main() -> None:
    config: dict[str, Any] = json.loads(os.environ["PP_RECOVERY"])
    torch.set_num_threads(1)
    # The default group's long timeout is for the set-up and the final barrier only.
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    pp, ep = config["pp"], config["ep"]
    assert dist.get_world_size() == pp * ep
    timeout = timedelta(seconds=config["timeout"])
    for case in config["cases"]:
        full = {"pp": pp, "ep": ep, "stages": config["stages"], **case}
        print(json.dumps(run_case(full, rank, pp, ep, timeout)), flush=True)
    dist.barrier()


if __name__ == "__main__":
    exit_worker(main)
