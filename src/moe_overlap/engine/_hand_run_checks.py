"""What ``combined_1f1b`` checks of its step, checked per run when plans are driven by hand.

:meth:`ModelChunkSchedulePlan.run <moe_overlap.ModelChunkSchedulePlan.run>` and
``run_pair`` called by the user (Megatron-Core's shape) have no step the library knows;
the run that backs a plan is the unit. Before its first step, a backed plan whose output
needs no grad is refused, as plain ``backward()`` refuses it (``check_backed_output``: a
frozen model, a loss cut from the graph). While it runs, the gradient accumulations of the
backed plans' models are counted (``RunAccumulations``: at a model's first such run and
whenever its parameters change, as ``combined_1f1b`` counts) and a parameter two nodes of
one microbatch accumulate is refused when it returns.

The runs of a step that checks them itself (``counted_step``: ``combined_1f1b``, a
prepared pipelining schedule) are left to it.
"""

from __future__ import annotations

from collections.abc import Sequence

from ._guards import BaseGuard
from ._shared_params import RunAccumulations, in_counted_step
from ._step_checks import output_node
from ._trainable import check_backed_output
from .core._chunk_plan import ModelChunkSchedulePlan
from .core._runner import ChunkRun

__all__ = ["HandRunChecks"]


class HandRunChecks(BaseGuard):
    """The guard: a run's backed outputs at its start, its accumulations at its end."""

    def __init__(self) -> None:
        self.counting: list[tuple[Sequence[ChunkRun], RunAccumulations]] = []
        """The runs counting now (one per thread running one), with the plans each backs."""

    def step_started(
        self,
        forward: Sequence[ChunkRun],
        backward: Sequence[ChunkRun],
        grads: Sequence[object],
        where: str,
    ) -> None:
        del forward, grads
        plans = backward
        if not plans or in_counted_step():
            return
        models: list[object] = []
        for plan in plans:
            if not isinstance(plan, ModelChunkSchedulePlan) or plan.pre_process is None:
                return  # not a model chunk's plan: its model is not known
            model = plan.pre_process.model
            node = output_node(plan)
            outputs = node.outputs if node is not None else ()
            if len(outputs) == 1:  # else not forwarded: the run refuses it
                loss = plan.post_process is not None
                microbatch = plan.state.microbatch
                index = plan.microbatch_index
                check_backed_output(model, outputs[0], microbatch, index, where, loss=loss)
            models.append(model)
        count = RunAccumulations(models)
        if count.active:  # else: the model is clean and unchanged since
            self.counting.append((plans, count.__enter__()))

    def backward_ended(self, plans: Sequence[ChunkRun], where: str, failed: bool) -> None:
        for i, (backed, count) in enumerate(self.counting):
            if backed is plans:  # the run's own count (none: nothing counted)
                del self.counting[i]
                count.__exit__(None, None, None)
                if not failed:
                    count.check(where, [plan.microbatch_index for plan in plans])
                return
