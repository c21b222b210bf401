"""Megatron's own chunk schedule plan (what ``GPTModel.build_schedule_plan`` returns)."""

from collections.abc import Callable

from torch import Tensor

class TransformerModelChunkSchedulePlan:
    """One model chunk's plan for one microbatch."""

    vp_stage: int | None
    def num_layers(self) -> int: ...
    @staticmethod
    def run(
        f_schedule_plan: TransformerModelChunkSchedulePlan | None,
        b_schedule_plan: TransformerModelChunkSchedulePlan | None,
        b_grad: Tensor | None = None,
        pre_forward: Callable[[int | None], object] | None = None,
        pre_backward: Callable[[int | None], object] | None = None,
        post_forward: Callable[[Tensor | None, int | None], object] | None = None,
        post_backward: Callable[[Tensor | None, int | None], object] | None = None,
    ) -> Tensor | None: ...
