"""Debug mode's first-step check: one microbatch through the schedule and the plain forward.

A model can compute in its plain ``forward`` something the schedule runs elsewhere or
never (a non-``None`` ``decoder.final_layernorm`` on a non-empty decoder, which the schedule
leaves to the model, as Megatron-Core does; a module the slots skip; slots that compute
other than the layer's forward). Nothing fails then: the model trains on another function.
On the first :func:`~moe_overlap.combined_1f1b` step of a model in debug mode, this module
runs the step's first microbatch through the schedule and through the model's own
``forward``, compares the losses and every parameter's gradient, and names the first
difference; then it puts everything back, so the step itself computes what it would have
computed without the check.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import math
import typing
import weakref
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from moe_overlap.errors import IntegrationError
from moe_overlap.protocols import SchedulableLayer

from ._conformance import check_wgrad_layers
from ._owed_wgrad import check_wgrad_done, declared_wgrad, owed_wgrad, pending_count
from ._torch_wrappers import has_grad_hooks
from ._trainable import needs_grad
from ._use_stream import wait_stream
from .core._backward_dw import BackwardDWWrapper
from .core._streams import AnyStream, current_stream, stream_context
from .core._wgrad_claims import WgradClaim

__all__ = [
    "GRAD_ATOL",
    "GRAD_RTOL",
    "LOSS_RTOL",
    "check_first_step",
    "first_step_outcome",
    "plain_call",
]

GRAD_RTOL = 0.05
"""A gradient differs when ``||g_schedule - g_plain|| > GRAD_RTOL * max(||g_schedule||,
||g_plain||) + GRAD_ATOL * (the largest gradient norm of the model)``."""
GRAD_ATOL = 1e-4
"""The floor, relative to the model's largest gradient norm: a gradient that is zero
mathematically is rounding noise (``1e-10``) in one path and exactly zero in the other."""
LOSS_RTOL = 0.05
"""The losses differ when ``|l_schedule - l_plain| > LOSS_RTOL * max(|l_schedule|,
|l_plain|)``."""

_outcomes: weakref.WeakKeyDictionary[object, str] = weakref.WeakKeyDictionary()
_outcome_ids: dict[int, str] = {}  # models that cannot be weakly referenced
_log = logging.getLogger("moe_overlap")


def first_step_outcome(model: object) -> str | None:
    """What debug mode's first-step check did for ``model``: ``"compared"``, ``"skipped:
    <reason>"``, or ``None`` (not run yet, or it found a difference)."""
    try:
        return _outcomes.get(model)
    except TypeError:
        return _outcome_ids.get(id(model))


def _mark(model: object, outcome: str) -> None:
    if outcome != "compared":
        _log.info("%s: debug mode's first-step check %s", type(model).__name__, outcome)
    try:
        _outcomes[model] = outcome
    except TypeError:
        _outcome_ids[id(model)] = outcome


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_BY_NAME = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def plain_call(model: object, microbatch: object) -> tuple[Callable[[], object], str] | None:
    """How the check calls the model's plain ``forward`` on ``microbatch``, or ``None``.

    A ``forward`` whose one parameter is annotated with the microbatch's class gets the
    microbatch itself. Otherwise every set field of the microbatch (not ``None``; a
    non-empty mapping for ``extra_block_kwargs``) is passed as the keyword of its name, as
    Megatron-Core's ``GPTModel.forward`` names them (``input_ids``, ``position_ids``,
    ``attention_mask``, ``decoder_input``, ``labels``, ``loss_mask``, ``padding_mask``,
    ...): usable when ``forward`` takes each by name (or ``**kwargs``) and needs nothing
    else. An ``nn.Module`` is called (``model(...)``), anything else its ``forward``.
    Returns the call and how it reads (for messages).
    """
    forward: object = getattr(model, "forward", None)
    if not callable(forward):
        return None
    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        return None
    call: Callable[..., object] = model if isinstance(model, nn.Module) else forward
    name = f"{type(model).__name__}.forward"
    if (
        len(params) == 1
        and params[0].kind in _POSITIONAL
        and _is_hint_for(forward, params[0], type(microbatch))
    ):
        return (lambda: call(microbatch)), f"{name}(microbatch)"
    given = _set_fields(microbatch)
    names = {p.name for p in params if p.kind in _BY_NAME}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    if not takes_any and not set(given) <= names:
        return None
    for p in params:
        if p.default is not inspect.Parameter.empty or p.kind in _VARIADIC:
            continue
        if p.kind is inspect.Parameter.POSITIONAL_ONLY or p.name not in given:
            return None  # a parameter the microbatch does not give
    shown = ", ".join(f"{k}=..." for k in given)
    return (lambda: call(**given)), f"{name}({shown})"


def _is_hint_for(fn: object, param: inspect.Parameter, cls: type) -> bool:
    hint: object = param.annotation
    if isinstance(hint, str):
        with contextlib.suppress(Exception):  # an unresolvable string: compare the name
            hint = typing.get_type_hints(fn).get(param.name, hint)
    if isinstance(hint, str):
        return hint.rsplit(".", 1)[-1] == cls.__name__
    return hint is cls


def _set_fields(microbatch: object) -> dict[str, object]:
    if not dataclasses.is_dataclass(microbatch):
        return {}
    out: dict[str, object] = {}
    for f in dataclasses.fields(microbatch):
        value: object = getattr(microbatch, f.name)
        if value is None or (isinstance(value, Mapping) and not value):
            continue  # unset (an empty extra_block_kwargs is unset too)
        out[f.name] = value
    return out


@dataclass(frozen=True, slots=True)
class _Params:
    names: tuple[str, ...]
    params: tuple[nn.Parameter, ...]


def _parameters(model: object) -> _Params | None:
    """Every parameter the step can touch, named by its path where one is known."""
    get: object = getattr(model, "parameters", None)
    if not callable(get):
        return None
    params = tuple(p for p in typing.cast("Iterator[object]", get()) if isinstance(p, nn.Parameter))
    names: dict[int, str] = {}
    for prefix, module in _modules_of(model):
        for n, p in module.named_parameters():
            names.setdefault(id(p), f"{prefix}{n}")
    return _Params(tuple(names.get(id(p), f"parameter {i}") for i, p in enumerate(params)), params)


def _modules_of(model: object) -> list[tuple[str, nn.Module]]:
    """``model`` itself when it is an ``nn.Module``, else the modules among its attributes
    (a wrapper such as the transformers adapter), with the prefix naming them."""
    if isinstance(model, nn.Module):
        return [("", model)]
    attrs: dict[str, object] = getattr(model, "__dict__", {})
    return [(f"{k}.", v) for k, v in attrs.items() if isinstance(v, nn.Module)]


def _skip_reason(model: object, params: _Params) -> str | None:
    """Why the comparison cannot be made for this model (``None``: it can)."""
    from torch.distributed.fsdp import FSDPModule

    if not (getattr(model, "pre_process", False) and getattr(model, "post_process", False)):
        return "not a whole model (a pipeline stage)"
    for _, root in _modules_of(model):
        if any(isinstance(m, FSDPModule) for m in root.modules()):
            return "FSDP2-sharded (its gradients are reduce-scattered across ranks)"
    for p in params.params:
        if getattr(p, "post_wgrad_grad_acc_hook", None) is not None or has_grad_hooks(p):
            return "parameters with gradient hooks (they would run for the check's passes)"
        if hasattr(p, "main_grad"):
            return "parameters with a main_grad (Megatron-style accumulation outside .grad)"
    return None


class _Saved:
    """What a pass through the model may change: ``.grad``, RNG states, buffers."""

    def __init__(self, model: object, params: _Params) -> None:
        self.params = params.params
        self.grads = [p.grad for p in self.params]
        self.cpu_rng = torch.get_rng_state()
        initialized = typing.cast("Callable[[], bool]", torch.cuda.is_initialized)
        self.cuda_rng = (
            torch.cuda.get_rng_state_all() if torch.cuda.is_available() and initialized() else None
        )
        buffers: dict[int, Tensor] = {}
        for _, root in _modules_of(model):
            for b in root.buffers():
                buffers.setdefault(id(b), b)
        self.buffers = [(b, b.detach().clone()) for b in buffers.values()]

    def clear_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def restore_rng_and_buffers(self) -> None:
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        with torch.no_grad():
            for b, value in self.buffers:
                b.copy_(value)

    def restore(self) -> None:
        for p, g in zip(self.params, self.grads, strict=True):
            p.grad = g
        self.restore_rng_and_buffers()


def check_first_step(
    model: object,
    microbatch: object,
    run_schedule: Callable[[], Sequence[Tensor]],
    loss_scale: float,
    *,
    compute: AnyStream,
) -> None:
    """Debug mode: compare one microbatch's schedule and plain forward, once per model.

    ``run_schedule()`` runs ``microbatch`` through the schedule (the step's options and
    streams) and returns its loss. The check runs on ``compute``, the schedule's compute
    stream, ordered after the caller's stream and before it as the schedule's own work is.
    Raises :class:`~moe_overlap.IntegrationError` naming the first difference beyond
    :data:`GRAD_RTOL` / :data:`GRAD_ATOL` / :data:`LOSS_RTOL`; skips, marking the model as
    checked, a model without a usable plain forward (:func:`plain_call`), a microbatch with
    an input that requires grad (the check's backward passes would add to its gradient),
    a model that is not a whole model, FSDP2-sharded, whose parameters carry gradient hooks
    or a ``main_grad``, or whose forward raises or returns other than a scalar tensor
    requiring grad (:func:`first_step_outcome` says which). Leaves ``.grad``, the RNG states and the
    buffers as it found them, and no delayed weight gradient pending.
    """
    if first_step_outcome(model) is not None:
        return
    plain = plain_call(model, microbatch)
    if plain is None:
        _mark(model, "skipped: no forward that takes the microbatch's set fields by name")
        return
    params = _parameters(model)
    if params is None:
        _mark(model, "skipped: no parameters() to compare")
        return
    if needs_grad(microbatch):  # its gradient, or its producer's, would take the check's too
        _mark(model, "skipped: an input of the microbatch requires grad")
        return
    reason = _skip_reason(model, params)
    if reason is not None:
        _mark(model, f"skipped: {reason}")
        return
    with _on_compute_stream(compute):
        _compare(model, plain, params, run_schedule, loss_scale)


@contextlib.contextmanager
def _on_compute_stream(compute: AnyStream) -> Generator[None]:
    """Run the check where the schedule runs the model: on its compute stream, after the
    caller's work so far; the caller's stream then waits for the check (the schedule's own
    boundary waits)."""
    caller = current_stream(compute)
    if caller == compute:
        yield
        return
    wait_stream(compute, caller)
    try:
        with stream_context(compute):
            yield
    finally:
        wait_stream(caller, compute)


def _compare(
    model: object,
    plain: tuple[Callable[[], object], str],
    params: _Params,
    run_schedule: Callable[[], Sequence[Tensor]],
    loss_scale: float,
) -> None:
    """:func:`check_first_step`'s comparison, for a model it does not skip."""
    call, how = plain
    saved = _Saved(model, params)
    try:
        saved.clear_grads()
        (loss_s,) = run_schedule()
        check_wgrad_done(
            model, when="after the schedule ran debug mode's first-step check (one microbatch)"
        )
        g_s = [p.grad for p in params.params]
        saved.clear_grads()
        saved.restore_rng_and_buffers()
        try:
            loss_p = call()
        except Exception as e:  # not a usable plain forward: nothing to compare with
            _mark(model, f"skipped: {how} raised {type(e).__name__}: {e}")
            return
        if not (isinstance(loss_p, Tensor) and loss_p.numel() == 1 and loss_p.requires_grad):
            _mark(model, f"skipped: {how} returned other than a scalar loss that needs grad")
            return
        # Claimed as the schedule claims them, so the listed parts' backward_dw() computes
        # what they queue (a part that delays whoever calls needs it as much).
        with WgradClaim(part for _, part in declared_wgrad(model)):
            torch.autograd.backward(loss_p, torch.full_like(loss_p, loss_scale))
        _finish_listed_wgrad(model)
        g_p = [p.grad for p in params.params]
        difference = _first_difference(loss_s, loss_p.detach(), g_s, g_p, params.names)
    finally:
        _drop_pending(model)
        saved.restore()
    if difference is not None:
        raise IntegrationError(
            f"{type(model).__name__}: debug mode's first-step check ran microbatch 0 through "
            f"the schedule and through the model's own forward ({how}) and they disagree: "
            f"{difference}. Something is applied in another place than the plain forward "
            "applies it (or not at all): e.g. a decoder.final_layernorm on a non-empty "
            "decoder, which the schedule never applies (the model applies its final norm "
            "itself, in _postprocess or in the last layer's last slot), a module the slots "
            "skip, or slots that compute other than the layer's forward. Make the schedule "
            "and the plain forward compute the same function (docs/debug.md: tolerance "
            f"{GRAD_RTOL:g} of a gradient's norm + {GRAD_ATOL:g} of the largest one)"
        )
    _mark(model, "compared")


def _finish_listed_wgrad(model: object) -> None:
    """The delayed weight gradients of a plain backward, as the layers list them."""
    decoder: object = getattr(model, "decoder", None)
    layers: object = getattr(decoder, "layers", ())
    for i, layer in enumerate(typing.cast("Sequence[object]", layers)):
        BackwardDWWrapper(typing.cast(SchedulableLayer, layer)).backward_dw()
        mlp: object = getattr(layer, "mlp_wgrad", None)
        if callable(mlp):
            for part in check_wgrad_layers(mlp(), f"decoder.layers[{i}]", "mlp_wgrad()"):
                part.backward_dw()


def _drop_pending(model: object) -> None:
    """Drop what a pass left owed (a failed pass, a module nothing lists)."""
    if not owed_wgrad(model):
        return
    parts = [part for _, part in declared_wgrad(model)]
    roots = [m for _, m in _modules_of(model)] + [p for p in parts if isinstance(p, nn.Module)]
    candidates: list[object] = [m for root in roots for m in root.modules()]
    candidates += [p for p in parts if not isinstance(p, nn.Module)]
    for module in candidates:
        drop: object = getattr(module, "discard_wgrad", None)
        if (pending_count(module) or 0) > 0 and callable(drop):
            drop()


def _norm(t: Tensor) -> float:
    x = t.detach().float()
    peak = float(x.abs().max()) if x.numel() else 0.0
    if peak == 0.0 or not math.isfinite(peak):
        return peak
    y = x / peak  # no overflow of the squares
    return peak * math.sqrt(float(y.mul(y).sum()))


def _first_difference(
    loss_s: Tensor,
    loss_p: Tensor,
    g_s: Sequence[Tensor | None],
    g_p: Sequence[Tensor | None],
    names: Sequence[str],
) -> str | None:
    found: list[str] = []
    ls, lp = float(loss_s.detach().float()), float(loss_p.detach().float())
    if abs(ls - lp) > LOSS_RTOL * max(abs(ls), abs(lp)):
        found.append(f"the loss: {ls:.6g} through the schedule, {lp:.6g} through forward")
    norms = [
        max(_norm(a) if a is not None else 0.0, _norm(b) if b is not None else 0.0)
        for a, b in zip(g_s, g_p, strict=True)
    ]
    scale = max(norms, default=0.0)
    differ: list[str] = []
    for name, a, b, ref in zip(names, g_s, g_p, norms, strict=True):
        if a is None or b is None:
            present = a if a is not None else b
            if present is None or not bool(present.detach().ne(0).any()):
                continue  # None and zeros: no gradient either way
            peak = float(present.detach().float().abs().max())
            where = "the schedule" if a is None else "the plain forward"
            other = "the plain forward" if a is None else "the schedule"
            differ.append(
                f"{name}: no gradient through {where}, one through {other} (max abs {peak:.3g})"
            )
            continue
        d = a.detach().float() - b.detach().float()
        dn = _norm(d)
        if not math.isnan(dn) and dn > GRAD_RTOL * ref + GRAD_ATOL * scale:
            peak = float(d.abs().max())
            differ.append(
                f"{name}: gradients differ by max abs {peak:.3g} (difference norm {dn:.3g}, "
                f"gradient norm {ref:.3g})"
            )
    if differ:
        more = f" ({len(differ)} of {len(names)} parameters differ)" if len(differ) > 1 else ""
        found.append(f"first parameter {differ[0]}{more}")
    return "; ".join(found) if found else None
