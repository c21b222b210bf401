"""The free-input policy: which layer nodes may release their inputs after forward."""

from __future__ import annotations

import enum
from collections.abc import Iterable

from moe_overlap.protocols import CudaGraphModule, FreeInputConfig

__all__ = ["CudaGraphModule", "graph_module_names", "should_free_input"]


def graph_module_names(modules: Iterable[object]) -> frozenset[str]:
    """Member names of ``modules``: enum members by ``.name``, anything else by ``str``."""
    return frozenset(m.name if isinstance(m, enum.Enum) else str(m) for m in modules)


def should_free_input(
    name: str, is_moe: bool, config: FreeInputConfig, num_local_experts: int | None
) -> bool:
    """Whether the layer node ``name`` may release its input storage after forward.

    Matches Megatron-Core 0.19 for every input. Dense layers never free (the residual of
    the attention block is read again after the MLP). For MoE layers:

    - ``moe_combine`` always frees;
    - ``mlp`` frees with fp8/fp4, or when more than one local expert or a dispatcher other
      than ``alltoall`` means the expert input is a fresh buffer, unless the flex backend is
      ``hybridep`` or ``ncclep`` (which keep it);
    - ``moe_dispatch`` frees unless the flex backend owns the buffer (``deepep``,
      ``hybridep``, ``ncclep``) or ``moe_preprocess`` is CUDA-graphed;
    - any other name (``pre_dispatch_computation``, ``mtp_post_process``) keeps its input.
    """
    if not is_moe:
        return False
    # Every MoE slot reads the dispatcher fields (a config without them fails for every
    # slot alike); each backend is compared only where its slot asks.
    flex = config.moe_token_dispatcher_type == "flex"
    backend = config.moe_flex_dispatcher_backend if flex else None
    if name == "mlp":
        if config.fp8 is not None or config.fp4 is not None:
            return True
        fresh_buffer = (num_local_experts is not None and num_local_experts > 1) or (
            config.moe_token_dispatcher_type != "alltoall"
        )
        return fresh_buffer and not (backend == "hybridep" or backend == "ncclep")
    if name == "moe_combine":
        return True
    if name == "moe_dispatch":
        graphed_preprocess = "moe_preprocess" in graph_module_names(config.cuda_graph_modules)
        owned = backend == "deepep" or backend == "hybridep" or backend == "ncclep"
        return not owned and not graphed_preprocess
    return False
