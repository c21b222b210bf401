"""The ``forward`` torchtitan's ``Module.parallelize`` sets on a module: honoured where
it is provably a no-op, refused otherwise.

``torchtitan.protocols.module.Module.parallelize`` replaces the ``forward`` of every module
with a sharding config by a closure (``forward_with_redistribution``) that redistributes the
inputs, runs the class's forward (inside a ``local_map`` when the config asks for one) and
redistributes the output. The slots skip or split the ``forward`` of some modules (the
model, a MoE block, its ``moe``, its ``routed_experts``), so such a closure there would
not run as in plain training. It does nothing when every boundary of the config resolves to
no device mesh (``ParallelDims.resolve_shared_mesh`` is ``None``: the axes it names, tensor,
context or data parallel, all have degree 1, as under expert parallelism alone) and no
``local_map`` was applied: the inputs go in, and the output comes out, unchanged.
:func:`honoured_forward` accepts exactly that (read from the closure, at every plan build);
any other such closure is refused with :class:`~moe_overlap.ConfigError`, and a forward of
another origin is left to the bypass check (which refuses it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import cast

from torch import nn

from moe_overlap import ConfigError

__all__ = ["honoured_forward"]

_ORIGIN = ("torchtitan.protocols.module", "Module.parallelize.<locals>.forward_with_redistribution")
_DO = (
    "expected torchtitan's expert parallelism alone (tensor, context and data parallel "
    "degrees 1, the 'partial_dtensor' or 'full_dtensor' SPMD backend), where the wrapper "
    "does nothing"
)


def _closure(fn: object) -> dict[str, object]:
    code: object = getattr(fn, "__code__", None)
    names: object = getattr(code, "co_freevars", ())
    cells: object = getattr(fn, "__closure__", None) or ()
    pairs = zip(cast("tuple[str, ...]", names), cast("tuple[object, ...]", cells), strict=False)
    return {n: cast("object", getattr(c, "cell_contents", None)) for n, c in pairs}


def _boundaries(config: object) -> list[list[object]]:
    """The config's boundaries, each the layouts one redistribution resolves its mesh
    from: an input (source and destination), the output, the local map."""
    src = cast("Mapping[str, object] | None", getattr(config, "in_src_shardings", None)) or {}
    dst = cast("Mapping[str, object] | None", getattr(config, "in_dst_shardings", None)) or {}
    out: list[list[object]] = [[src.get(k), dst.get(k)] for k in {*src, *dst}]
    out_src: object = getattr(config, "out_src_shardings", None)
    out_dst: object = getattr(config, "out_dst_shardings", None)
    if not isinstance(out_src, tuple):  # a tuple: torchtitan hands the outputs on as they are
        out.append([out_src, out_dst])
    local_map: object = getattr(config, "local_map", None)
    if local_map is not None:
        grads = cast("Iterable[object] | None", getattr(local_map, "in_grad_placements", None))
        outs = (
            list(cast("tuple[object, ...]", out_src)) if isinstance(out_src, tuple) else [out_src]
        )
        out.append([*src.values(), *dst.values(), *outs, *(grads or ())])
    return out


def honoured_forward(module: nn.Module, where: str) -> object:
    """The ``forward`` torchtitan's ``parallelize`` set on ``module``, when it is a no-op
    (the bypass check then skips it); ``None`` when there is no ``forward`` on the instance
    or it is not torchtitan's (the bypass check refuses it). A torchtitan one that
    redistributes or maps to local tensors is a :class:`~moe_overlap.ConfigError`."""
    fn: object = module.__dict__.get("forward")
    if fn is None:
        return None
    if (getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)) != _ORIGIN:
        return None
    cls = type(module).__name__
    env = _closure(fn)
    inner, dims = env.get("fn"), env.get("parallel_dims")
    own = getattr(type(module), "forward", None)
    bound_to: object = getattr(inner, "__self__", module)
    if env.get("self") is not module or bound_to is not module:
        raise ConfigError(
            f"{where} ({cls}): expected the forward torchtitan's parallelize set on it to run "
            "this module's own forward, received one that runs another module's (a copy of "
            "a parallelized module keeps the original's); the slots skip it; parallelize "
            "the model the adapter is built on, not a copy's original"
        )
    if getattr(inner, "__func__", None) is not own:
        raise ConfigError(
            f"{where} ({cls}): expected torchtitan's parallelize to wrap its forward with "
            "redistributions only, received a local_map around it (its inputs become local "
            f"shards and its output a DTensor); the slots skip that conversion; {_DO}"
        )
    backend: object = getattr(dims, "spmd_backend", None)
    if backend not in ("partial_dtensor", "full_dtensor"):
        raise ConfigError(
            f"{where} ({cls}): expected the forward torchtitan's parallelize set on it to do "
            f"nothing, received one under the {backend!r} SPMD backend (it checks and "
            f"redistributes its inputs and output); the slots skip it; {_DO}"
        )
    resolve = cast(
        "Callable[[list[object]], object] | None", getattr(dims, "resolve_shared_mesh", None)
    )
    config: object = getattr(module, "_sharding_config", None)
    if resolve is None or config is None:
        raise ConfigError(
            f"{where} ({cls}): expected torchtitan's ParallelDims and the module's sharding "
            "config in the forward its parallelize set, received neither; the slots skip it; "
            f"{_DO}"
        )
    for layouts in _boundaries(config):
        mesh = resolve(layouts)
        if mesh is not None:
            raise ConfigError(
                f"{where} ({cls}): expected the forward torchtitan's parallelize set on it to "
                f"do nothing, received one that redistributes its inputs or output on {mesh}; "
                f"the slots skip it, so that redistribution would not run; {_DO}"
            )
    return fn
