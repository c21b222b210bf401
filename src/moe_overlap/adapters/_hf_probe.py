"""The adapter's self-check: its slot split against the transformers layer's own forward.

For each distinct decoder-layer structure the adapter builds its layer on a float32 copy
and runs it on a probe (a private generator's random hidden states, the model's own layer
arguments for a tiny batch), next to the original layer's ``forward`` on another copy; it
compares the outputs, the input gradient and every parameter's gradient. Candidate splits
are tried in order and the first that matches is kept; when none does, a
:class:`~moe_overlap.ConfigError` names the layer class and the largest difference.
Nothing outside the copies is touched and the global RNG is not used.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor, nn

from moe_overlap import ChunkState, Microbatch
from moe_overlap.adapters._hf_calls import LayerCall
from moe_overlap.adapters._hf_structure import first_tensor
from moe_overlap.blocks import DelayedWgradModule

__all__ = [
    "GRADIENT_FLOOR",
    "PROBE_TOKENS",
    "PROBE_TOLERANCE",
    "Mismatch",
    "compare_layer",
    "failing_module",
    "float32_call",
    "float32_copy",
    "probe_ids",
    "rel_difference",
    "structure_key",
    "worst_gradient",
]

PROBE_TOKENS = 6
"""Each probe is two sequences of this many tokens."""

PROBE_TOLERANCE = 1e-5
"""Largest difference accepted, relative to the largest magnitude of the compared tensor.
The split follows the model's order of operations (each expert's rows, the MoE input's
gradient sums); the tolerance is for what may still round otherwise without being wrong
(Llama 4's dense experts, other kernels, devices, experts implementations, user models)."""

GRADIENT_FLOOR = 1e-2
"""A gradient is compared relative to ``max(its largest magnitude, GRADIENT_FLOOR * G)``,
``G`` the largest magnitude among all the layer's gradients (input and parameters): a
difference under ``PROBE_TOLERANCE * GRADIENT_FLOOR * G = 1e-7 * G``, float32's rounding
unit of the layer's largest gradient, is rounding. A gradient that is exactly zero
mathematically (a key bias without rotary: softmax ignores a shift shared by every key)
comes out as float32 noise of ~1e-10 * G, which a purely relative comparison would call a
difference of order 1."""


@dataclass(frozen=True, slots=True)
class Mismatch:
    """The largest difference the probe found (``None`` from :func:`compare_layer` if none)."""

    what: str
    difference: float

    def __str__(self) -> str:
        return (
            f"{self.what} differs by {self.difference:.3g} (relative; float32 rounding is "
            f"< {PROBE_TOLERANCE:g})"
        )


_INDEX_NAMES = frozenset({"layer_idx", "layer_index", "index", "layer_id"})
"""Attributes that only number a layer (caches are off in training); every other plain
attribute (a per-layer scale, window or flag) makes layers distinct structures."""


def _settings(module: nn.Module) -> tuple[tuple[str, object], ...]:
    return tuple(
        sorted(
            (k, v)
            for k, v in vars(module).items()
            if isinstance(v, (bool, int, float, str))
            and not k.startswith("_")
            and k not in _INDEX_NAMES
        )
    )


def structure_key(layer: nn.Module, call: LayerCall) -> tuple[object, ...]:
    """Layers with equal keys compute alike: module tree, parameter shapes, plain settings
    (attributes holding numbers, flags or names), argument kinds."""
    named = cast("list[tuple[str, nn.Module]]", list(layer.named_modules()))  # pyright: ignore[reportUnknownArgumentType]
    modules = tuple(
        (
            name,
            type(m).__qualname__,
            tuple(tuple(p.shape) for p in m.parameters(recurse=False)),
            _settings(m),
        )
        for name, m in named
    )
    kinds = tuple(sorted((k, type(v).__name__) for k, v in call.kwargs.items()))
    return (type(layer).__qualname__, modules, kinds)


def _to_float32(value: object) -> object:
    if isinstance(value, Tensor) and value.is_floating_point():
        return value.float()
    if isinstance(value, (tuple, list)):
        items = [_to_float32(v) for v in cast("Sequence[object]", value)]
        return tuple(items) if isinstance(value, tuple) else items
    return value


def float32_call(call: LayerCall) -> LayerCall:
    return LayerCall(
        tuple(_to_float32(a) for a in call.args),
        {k: _to_float32(v) for k, v in call.kwargs.items()},
    )


def _magnitude(t: Tensor) -> float:
    return float(t.detach().abs().max()) if t.numel() else 0.0


def rel_difference(a: Tensor, b: Tensor, floor: float = 0.0) -> float:
    """``max |a - b|`` relative to ``max(max |b|, floor)`` (absolute when both are 0)."""
    a, b = a.detach(), b.detach()
    scale = max(_magnitude(b), floor)
    diff = float((a.double() - b.double()).abs().max()) if b.numel() else 0.0
    return diff / scale if scale > 0 else diff


def _grads(module: nn.Module) -> Iterator[tuple[str, Tensor | None]]:
    for name, p in module.named_parameters():
        yield name, p.grad


def compare_layer(
    reference: nn.Module,
    run: Callable[[Tensor, ChunkState], Tensor],
    candidate: nn.Module,
    delayed: Callable[[], AbstractContextManager[None]],
    hidden: Tensor,
    call: LayerCall,
    *,
    seed: int,
) -> Mismatch | None:
    """Run ``reference(x, **call)`` and ``run(x, ...)`` (built on ``candidate``) on one probe.

    The candidate's backward runs inside ``delayed()`` (which claims its delayed modules
    and computes their weight gradients on exit, as the schedule would). Returns
    the largest mismatch over output, input gradient and parameter gradients, or ``None``.
    """
    g = torch.Generator().manual_seed(seed)
    layer_call = call
    x_ref = hidden.detach().clone().requires_grad_()
    x_cand = hidden.detach().clone().requires_grad_()
    out_r = first_tensor(reference(x_ref, *layer_call.args, **dict(layer_call.kwargs)))
    out_c = run(x_cand, ChunkState(Microbatch()))
    worst = (
        Mismatch("output", rel_difference(out_c, out_r))
        if out_c.shape == out_r.shape
        else Mismatch("output shape", float("inf"))
    )
    if worst.difference > PROBE_TOLERANCE:
        return worst
    grad_out = torch.randn(out_r.shape, generator=g, dtype=out_r.dtype).to(out_r.device)
    torch.autograd.backward(out_r, grad_out)
    with delayed():
        torch.autograd.backward(out_c, grad_out)
    pairs: list[tuple[str, Tensor | None, Tensor | None]] = [
        ("input gradient", x_cand.grad, x_ref.grad)
    ]
    cand_grads = dict(_grads(candidate))
    for name, ref_grad in _grads(reference):
        pairs.append((f"gradient of {name}", cand_grads.get(name), ref_grad))
    worst = worst_gradient(pairs, worst)
    return worst if worst.difference > PROBE_TOLERANCE else None


def worst_gradient(
    pairs: Sequence[tuple[str, Tensor | None, Tensor | None]], worst: Mismatch
) -> Mismatch:
    """The largest of ``worst`` and the ``(what, split's, reference's)`` gradient
    differences, each relative to its own magnitude floored at ``GRADIENT_FLOOR`` times the
    largest gradient of all (a mathematically-zero gradient's float32 noise sits far below
    it); a gradient only one side gives is an infinite difference."""
    floor = GRADIENT_FLOOR * max((_magnitude(w) for _, _, w in pairs if w is not None), default=0.0)
    for what, got, want in pairs:
        if (got is None) != (want is None):
            absent = "no gradient" if got is None else "a gradient the layer does not give"
            return Mismatch(f"{what} (the split gives {absent})", float("inf"))
        if got is not None and want is not None:
            d = rel_difference(got, want, floor) if got.shape == want.shape else float("inf")
            if d > worst.difference:
                worst = Mismatch(what, d)
    return worst


def float32_copy(
    layer: nn.Module, *, immediate: bool = False, quiet: frozenset[str] = frozenset()
) -> nn.Module:
    """A float32 deep copy in training mode (the probe never touches the model's own layer;
    it checks what training runs, whatever mode the model is in now).

    ``immediate``: linears an earlier adapter made delayable compute their weight gradient
    in backward, as the ``nn.Linear`` they replaced (the layer's own forward, for reference).
    ``quiet``: modules (by name in the layer) that draw random numbers in training mode
    stay in eval mode (only they, not their children): the adapter trains them so, and
    refuses them in training mode (:mod:`._hf_random`).
    """
    dup = copy.deepcopy(layer)
    dup.float()
    dup.train()
    for name in quiet:
        dup.get_submodule(name).training = False
    for m in dup.modules():  # activation checkpointing changes memory, not the math
        if getattr(m, "gradient_checkpointing", False) is True:
            setattr(m, "gradient_checkpointing", False)  # noqa: B010 - transformers' flag
    if immediate:
        for m in dup.modules():
            if isinstance(m, DelayedWgradModule):
                m.discard_wgrad()
                m.delay_wgrad = False
    return dup


def probe_ids(config: object, device: torch.device) -> Tensor:
    """Two sequences of token ids from a private generator, within the config's vocabulary."""
    vocab: object = getattr(config, "vocab_size", None)
    high = vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else 2
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, max(2, min(high, 100)), (2, PROBE_TOKENS), generator=g).to(device)


def failing_module(exc: BaseException, root: nn.Module) -> str:
    """Where ``exc`` was raised: the innermost module of ``root`` (by its path) whose code
    is on the traceback, for messages."""
    names = {id(m): n for n, m in cast("Iterator[tuple[str, nn.Module]]", root.named_modules())}
    cls = type(root).__name__
    found = cls
    tb = exc.__traceback__
    while tb is not None:
        obj: object = tb.tb_frame.f_locals.get("self")
        if isinstance(obj, nn.Module) and id(obj) in names:
            path = names[id(obj)]
            found = f"{cls}.{path} ({type(obj).__name__})" if path else cls
        tb = tb.tb_next
    return found
