"""Parallelism configuration (the base class of ``TransformerConfig``)."""

from dataclasses import dataclass

# kw_only: this stub declares a subset of the fields, so positional construction (which
# depends on the full field order) must not type-check against it.
@dataclass(kw_only=True)
class ModelParallelConfig:
    """The fields of Megatron's ``ModelParallelConfig`` the EP-A2A overlap reads."""

    fp16: bool = False
    bf16: bool = False
    overlap_moe_expert_parallel_comm: bool = False
    """Run combined 1F1B: overlap one microbatch's EP all-to-all with another's compute."""
    delay_wgrad_compute: bool = False
    """Compute weight gradients late (``backward_dw``); requires the overlap."""
    ep_overlap_early_attn_memory_release: bool = False
    """Run the attention backward before the next forward MLP; requires the overlap."""
