"""One gloo rank of the EP failure tests: ``combined_1f1b`` steps with a failure on some ranks.

Configured by ``EP_FAILURE`` (JSON: ``timeout``, the seconds of the EP group's timeout (a
rank blocked in an all-to-all with a failed peer fails after it), and ``cases``). Each case
builds a new EP group (and, with ``consensus``, a gloo ``consensus_group``), a model and a
reference model on a group of their own, then runs three steps of ``combined_1f1b``: step 0
(must be exact), step 1 with the case's ``fault`` on the case's ``ranks``, step 2 after the
documented recovery (zero the gradients, ``discard_wgrad``); when step 2 is refused, step 3
tries the same model with a new ``consensus_group`` and a new model with the old one. A
fault ``kind`` is ``forward`` (the forward of microbatch 1 fails in the first MoE layer's
``pre_dispatch``, after microbatch 0's all-to-alls), ``labels`` (microbatch 1 has no
labels: the loss check fails mid-step) or ``before`` (microbatch 1's ``padding_mask`` has
the wrong shape: ``combined_1f1b`` refuses it before the step communicates). Prints one
JSON line per case, rank and step as soon as the step ends (a rank aborted by gloo leaves
the lines it printed).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe_overlap import Microbatch, combined_1f1b
from moe_overlap.blocks import discard_wgrad
from moe_overlap.models import GPTMoEModel, MoELayer
from tests.gloo_ranks import exit_worker
from tests.models._helpers import SMALL, microbatches

INJECTED = "injected failure"
CONFIG = dataclasses.replace(SMALL, delay_wgrad_compute=True)


def group(timeout: timedelta) -> dist.ProcessGroup:
    return cast("dist.ProcessGroup", dist.new_group([0, 1], timeout=timeout, backend="gloo"))


def data(step: int, *, bad: str | None = None) -> list[Microbatch]:
    mbs = microbatches(3, vocab=CONFIG.vocab_size, seed=100 * step + dist.get_rank())
    if bad == "labels":
        mbs[1] = dataclasses.replace(mbs[1], labels=None)
    elif bad == "before":
        mbs[1] = dataclasses.replace(mbs[1], padding_mask=torch.zeros(2, 5, dtype=torch.bool))
    return mbs


def grads(model: nn.Module) -> list[Tensor | None]:
    return [p.grad.clone() if p.grad is not None else None for p in model.parameters()]


def same(a: list[Tensor | None], b: list[Tensor | None]) -> bool:
    return len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a, b, strict=True)
    )


def outcome(run: Callable[[], object]) -> dict[str, Any]:
    """How a call ended: ``raised`` (the exception's type or None), its message, seconds."""
    start = time.monotonic()
    try:
        run()
    except Exception as e:
        return {"raised": type(e).__name__, "message": str(e), "seconds": time.monotonic() - start}
    return {"raised": None, "message": "", "seconds": time.monotonic() - start}


class Fault:
    """Microbatch 1's forward fails in the first MoE layer's ``pre_dispatch``."""

    def __init__(self, model: GPTMoEModel) -> None:
        self.layer = next(x for x in model.layer_list if isinstance(x, MoELayer))
        self.calls = 0

    def install(self) -> None:
        original = self.layer.pre_dispatch

        def failing(ctx: Any, x: Tensor) -> tuple[Tensor, Tensor]:
            self.calls += 1
            if self.calls == 2:  # microbatch 1 (microbatch 0's all-to-alls are done)
                raise RuntimeError(f"{INJECTED} in a forward")
            return original(ctx, x)

        setattr(self.layer, "pre_dispatch", failing)  # noqa: B010 - shadows the method

    def remove(self) -> None:
        if "pre_dispatch" in vars(self.layer):
            del self.layer.pre_dispatch


def run_case(case: dict[str, Any], timeout: timedelta) -> None:
    rank = dist.get_rank()
    faulty = rank in case["ranks"]
    kind = case["kind"]
    ref_ep, ep = group(timeout), group(timeout)
    consensus = group(timedelta(seconds=30)) if case.get("consensus") else None
    extra: dict[str, Any] = {} if consensus is None else {"consensus_group": consensus}

    torch.manual_seed(0)
    model = GPTMoEModel(CONFIG, ep_group=ep)
    ref = GPTMoEModel(CONFIG, ep_group=ref_ep)
    ref.load_state_dict(model.state_dict())
    expected: dict[int, list[Tensor | None]] = {}
    for n in (0, 2):
        ref.zero_grad(set_to_none=True)
        combined_1f1b(ref, data(n))
        expected[n] = grads(ref)

    def report(step: int, row: dict[str, Any]) -> None:
        line = {"case": case["name"], "rank": rank, "step": step, **row}
        print(json.dumps(line), flush=True)

    def step(n: int, *, bad: str | None = None) -> dict[str, Any]:
        model.zero_grad(set_to_none=True)
        result = outcome(lambda: combined_1f1b(model, data(n, bad=bad), **extra))
        result["exact"] = result["raised"] is None and same(grads(model), expected.get(n, []))
        return result

    report(0, step(0))
    fault = Fault(model)
    if faulty and kind == "forward":
        fault.install()
    report(1, step(1, bad=kind if faulty and kind != "forward" else None))
    fault.remove()
    discard_wgrad(model)  # the documented recovery (zero_grad is in step)
    last = step(2)
    report(2, last)
    if consensus is not None and last["raised"] is not None:  # refused (on every rank): the
        # same model with a new consensus group, a new model with the old one
        again = group(timedelta(seconds=30))
        row = outcome(lambda: combined_1f1b(model, data(2), consensus_group=again))
        fresh = GPTMoEModel(CONFIG, ep_group=group(timeout))
        row2 = outcome(lambda: combined_1f1b(fresh, data(2), consensus_group=consensus))
        report(3, {"same_model": row, "same_consensus_group": row2})


def main() -> None:
    config: dict[str, Any] = json.loads(os.environ["EP_FAILURE"])
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    # The default group's long timeout is for the set-up and the final barrier only.
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    assert dist.get_world_size() == 2
    timeout = timedelta(seconds=config["timeout"])
    for case in config["cases"]:
        run_case(case, timeout)
    dist.barrier()


if __name__ == "__main__":
    exit_worker(main)
