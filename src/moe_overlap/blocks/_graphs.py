"""CUDA graphs for the static-shape parts of a layer, forward and backward, exact.

A :class:`GraphedBlock` runs one function of tensors (attention, a norm and router, a dense
MLP) as captured CUDA graphs with PyTorch's own API (:class:`torch.cuda.CUDAGraph`,
:func:`torch.cuda.graph`): one graph for its forward, one for its backward (captured from
``torch.autograd.grad``, as :func:`torch.cuda.make_graphed_callables` does) and, when the
function's linears delay their weight gradients, one for those. The kernels are the ones
eager mode runs, so results are bit-identical to eager.

What :func:`~torch.cuda.make_graphed_callables` leaves to its caller, the block does:

- **Copies per microbatch in flight.** A graph's saved activations live in its private
  memory pool, so a second forward replay before the first one's backward would overwrite
  them. The block keeps a set of captured copies; a forward takes a free copy (capturing a
  new one when all are busy) and the copy stays busy until its backward has replayed and its
  delayed weight gradients are computed (or its autograd graph is dropped). The combined
  1F1B schedule keeps two microbatches of a layer alive, so two copies.
- **No aliasing of static buffers.** Outputs and gradients are returned as fresh tensors,
  never the graph's static buffers: ``AccumulateGrad`` may keep a gradient as ``.grad``,
  and the schedule's free-input policy may release an output's storage.
- **Delayed weight gradients.** The backward capture queues the linears' ``(x, grad_y)``
  on static buffers (it claims them while it captures); a backward replay that a schedule
  claims (:mod:`moe_overlap.wgrad`) queues them again, holding the copy, so
  :func:`~moe_overlap.blocks.finish_wgrad` and ``backward_dw`` work as in eager mode, and
  :meth:`GraphedBlock.backward_dw` replays their captured weight-gradient graph instead
  (the layer plugs it into :meth:`~moe_overlap.BackwardDWWrapper.set_graphed_backward_dw_callable`).
  An unclaimed replay (a plain ``loss.backward()``) replays that graph at once and hands
  the gradients to autograd, as an undelayed block does.
- **Random numbers as in eager mode.** The capture's warm-up calls draw from the device's
  default generator; the block puts its state back after them, so every replay, the
  capturing call's too, draws what an eager call at the same random state would, and a
  slot the schedule recomputes draws the same the second time even where that call
  captures a new copy.
- **Refusals instead of silent staleness.** A call whose tensor shapes, dtypes, devices or
  ``requires_grad`` differ from the capture's, parameters that moved (``model.to``, FSDP,
  ``load_state_dict(assign=True)``) or were frozen or unfrozen, or a Python-side value the
  capture froze (``frozen``) that changed raise :class:`~moe_overlap.ConfigError`;
  :meth:`GraphedBlock.reset` drops the graphs so the next call captures again. The
  parameters are walked again whenever a module, parameter or buffer was registered
  anywhere since the last walk (torch's global registration hooks count them: one integer
  compared per call), so a submodule or parameter *replaced* after the capture is refused
  too; debug mode (``MOE_OVERLAP_DEBUG=1``) walks them at every call, which also catches a
  submodule deleted (torch has no hook for deletion).

Without CUDA, or with autograd off, the function runs eagerly: the same values, no graphs.
Capture synchronizes the device (once per copy, on the first steps).
"""

from __future__ import annotations

import gc
import warnings
import weakref
from collections.abc import Callable, Generator, Hashable, Iterable, Sequence
from contextlib import contextmanager
from copy import deepcopy
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn

from moe_overlap import ConfigError, CudaGraphModule, IntegrationError, WgradError
from moe_overlap.args import CALLABLE, POSITIVE, Func, Instance, Items, Opt, check_arg
from moe_overlap.blocks._delayed_linear import DelayedWgradModule, PendingItem, accumulate_grad
from moe_overlap.blocks._torch_private import tree_leaves
from moe_overlap.engine import DEBUG, WgradClaim, registrations, wgrad_claimed

__all__ = ["GraphedBlock"]

_Signature = tuple[tuple[tuple[int, ...], torch.dtype, torch.device, bool], ...]


class _Lease:
    """Held while a copy's buffers are in use (by the autograd node, then by queued wgrads)."""

    __slots__ = ("__weakref__", "copy")

    def __init__(self, copy: _Copy) -> None:
        self.copy = copy


@dataclass(eq=False)
class _Copy:
    """One captured set of graphs and the static tensors they read and write."""

    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]
    fwd: torch.cuda.CUDAGraph
    bwd: torch.cuda.CUDAGraph | None
    grad_outputs: tuple[Tensor | None, ...]
    grad_inputs: tuple[Tensor | None, ...]
    deferred: tuple[tuple[DelayedWgradModule, PendingItem], ...]
    wgrad: torch.cuda.CUDAGraph | None = None
    wgrad_out: tuple[Tensor, ...] = ()
    lease: weakref.ref[_Lease] | None = None

    def free(self) -> bool:
        return self.lease is None or self.lease() is None


@dataclass
class _Stats:
    """What a block did: captures, forward replays, weight-gradient graph replays."""

    captures: int = 0
    forward_replays: int = 0
    wgrad_replays: int = 0
    eager_calls: int = 0


class _GraphedFn(torch.autograd.Function):
    """One replayed copy as one autograd node: inputs are the user tensors and parameters."""

    @staticmethod
    def forward(
        ctx: Any,  # torch's FunctionCtx declares no fields; we add our own
        block: GraphedBlock,
        copy: _Copy,
        lease: _Lease,
        *tensors: Tensor,
    ) -> tuple[Tensor, ...]:
        for static, value in zip(copy.inputs, tensors, strict=False):
            if static.data_ptr() != value.data_ptr():
                static.copy_(value)
        copy.fwd.replay()
        outputs = tuple(o.clone() for o in copy.outputs)
        ctx.mark_non_differentiable(*(o for o in outputs if not _differentiable(o)))
        ctx.block = block
        ctx.lease = lease
        ctx.params = tuple(id(p) for p in tensors[len(copy.inputs) :])
        return outputs

    @staticmethod
    def backward(
        ctx: Any,  # see forward
        *grads: Tensor,
    ) -> tuple[Tensor | None, ...]:
        block: GraphedBlock = ctx.block
        lease: _Lease | None = ctx.lease
        ctx.lease = None
        if lease is None:
            raise WgradError(
                f"{block.label}: a graphed block's backward ran twice for one forward; its "
                "graph buffers belong to the next microbatch by now: backward once "
                "(no retain_graph) through a GraphedBlock"
            )
        copy = lease.copy
        if copy.bwd is None:
            raise WgradError(
                f"{block.label}: no backward graph was captured (no output needs grad)"
            )
        for static, grad in zip(copy.grad_outputs, grads, strict=True):
            if static is not None and static.data_ptr() != grad.data_ptr():
                static.copy_(grad)
        copy.bwd.replay()
        grad_inputs = [g.clone() if g is not None else None for g in copy.grad_inputs]
        if _claimed(block, copy):
            for module, item in copy.deferred:
                module.defer_wgrad(
                    item.x, item.grad_y, item.kernel, keep=lease, autocast=item.autocast
                )
        elif copy.deferred:  # no schedule will run backward_dw: the weight gradients now
            assert copy.wgrad is not None
            copy.wgrad.replay()
            block.stats.wgrad_replays += 1
            at = {p: len(copy.inputs) + i for i, p in enumerate(ctx.params)}
            for (module, _), grad in zip(copy.deferred, copy.wgrad_out, strict=True):
                i = at[id(module.weight)]
                g = grad_inputs[i]
                grad_inputs[i] = grad.clone() if g is None else g + grad
        return (None, None, None, *grad_inputs)


def _claimed(block: GraphedBlock, copy: _Copy) -> bool:
    """Whether a schedule claims the modules whose weight gradients ``copy`` defers (it
    will run their ``backward_dw()``); all or none, else :class:`~moe_overlap.WgradError`."""
    claimed = [wgrad_claimed(module) for module, _ in copy.deferred]
    if all(claimed):
        return True
    if any(claimed):
        split = [m.label for (m, _), c in zip(copy.deferred, claimed, strict=True) if not c]
        raise WgradError(
            f"{block.label}: expected a schedule to claim every delayed module of the graphed "
            f"block or none (one weight-gradient graph computes them all), received "
            f"{split} unclaimed: list the block's modules together (one WgradScope)"
        )
    return False


# Function.apply is untyped; give it its signature once, here.
_graphed_apply = cast(
    "Callable[..., tuple[Tensor, ...]]",
    _GraphedFn.apply,  # pyright: ignore[reportUnknownMemberType]
)


# torch.cuda.Stream's constructor is unannotated; give it a type once, here.
_new_stream: Callable[[], torch.cuda.Stream] = torch.cuda.Stream


def _differentiable(t: Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


_FN = Func("a callable of tensors", error=IntegrationError)
_MODULES = Items(Instance(nn.Module, "an nn.Module", error=IntegrationError))


_SCOPE = Instance(
    CudaGraphModule,
    "a CudaGraphModule (it names the scope in errors and wgrad coverage)",
    hint="pass the member, e.g. CudaGraphModule.attn, not its name",
)
_LABEL = Instance(str, "a str")


class GraphedBlock:
    """``fn(*tensors)`` of the parameters of ``modules``, run as CUDA graphs (see the
    module doc).

    ``fn`` returns a tensor or a (nested) tuple of tensors; :meth:`__call__` returns them
    flattened to a tuple. ``modules`` are exactly the modules ``fn`` runs (their delayed
    linears are the block's), or a callable returning them: pass a bound method of their
    owner (``lambda``-free, so a copied model's block reads the copy) when ``fn`` reads
    them as the owner's attributes, so a submodule replaced on the owner is seen and
    refused rather than replayed stale. ``scope`` and ``label`` name the block in errors. ``frozen``
    returns the Python-side values the capture bakes in (a router's loss scale); pass a
    bound method of one of ``modules`` so a copied model's block reads the copy. A call
    where it returns something else raises instead of replaying a stale graph. Not an
    ``nn.Module``: ``modules`` keep their parameters, the block only reads them.
    """

    def __init__(
        self,
        fn: Callable[..., object],
        modules: Iterable[nn.Module] | Callable[[], Sequence[nn.Module]],
        scope: CudaGraphModule,
        *,
        label: str,
        frozen: Callable[[], Hashable] | None = None,
        warmup: int = 2,
    ) -> None:
        w = "GraphedBlock"
        self.fn = check_arg(w, "fn", fn, _FN)
        self._modules_of: Callable[[], Sequence[nn.Module]] | None = None
        self._fixed: tuple[nn.Module, ...] = ()
        if callable(modules) and not isinstance(modules, nn.Module):
            self._modules_of = modules  # its result is checked at every walk
        else:
            self._fixed = check_arg(w, "modules", modules, _MODULES)
        self.scope = check_arg(w, "scope", scope, _SCOPE)
        self.label = check_arg(w, "label", label, _LABEL)
        self.frozen = check_arg(w, "frozen", frozen, Opt(CALLABLE))
        self.warmup = check_arg(w, "warmup", warmup, POSITIVE)
        self.stats = _Stats()
        self._copies: list[_Copy] = []
        self._signature: _Signature | None = None
        self._key: tuple[object, ...] | None = None
        self._all: tuple[nn.Parameter, ...] | None = None
        self._walked = -1  # registrations() when the parameters were last walked
        self._delayed_modules: list[DelayedWgradModule] | None = None

    @property
    def modules(self) -> tuple[nn.Module, ...]:
        """The modules ``fn`` runs, now."""
        return self._fixed if self._modules_of is None else tuple(self._modules_of())

    def __deepcopy__(self, memo: dict[int, object]) -> GraphedBlock:
        """A copy of the model gets its own block, uncaptured (graphs are not copyable)."""
        return GraphedBlock(
            deepcopy(self.fn, memo),
            deepcopy(self._fixed if self._modules_of is None else self._modules_of, memo),
            self.scope,
            label=self.label,
            frozen=deepcopy(self.frozen, memo),
            warmup=self.warmup,
        )

    @property
    def copies(self) -> int:
        """How many copies are captured (one per microbatch in flight at once)."""
        return len(self._copies)

    def reset(self) -> None:
        """Drop every captured graph; the next call captures again (after moving the model)."""
        gc.collect()  # a failed step's autograd graph may sit in a reference cycle
        busy = [i for i, c in enumerate(self._copies) if not c.free()]
        if busy:
            raise ConfigError(
                f"{self.label}: reset() expected every graph copy idle, received copies {busy} "
                "still owed a backward or a weight gradient: finish or discard the step first"
            )
        self._copies.clear()
        self._signature = None
        self._key = None
        self._all = None
        self._walked = -1
        self._delayed_modules = None

    def __call__(self, *args: Tensor) -> tuple[Tensor, ...]:
        """Run ``fn(*args)``: graphed on CUDA with autograd on, eagerly otherwise."""
        if not (torch.is_grad_enabled() and args and all(a.is_cuda for a in args)):
            self.stats.eager_calls += 1
            return tuple(tree_leaves(self.fn(*args)))
        every = self._surface()
        params = tuple(p for p in every if p.requires_grad)
        copy = self._acquire(args, every, params)
        lease = _Lease(copy)
        copy.lease = weakref.ref(lease)
        self.stats.forward_replays += 1
        return _graphed_apply(self, copy, lease, *args, *params)

    def backward_dw(self) -> None:
        """Weight gradients of the oldest backward, by replaying their captured graph.

        The graphed-wgrad hook of :class:`~moe_overlap.BackwardDWWrapper`. Items queued
        without a graph (CPU, eager calls) are computed as ``backward_dw`` computes them.
        """
        modules = self._delayed()
        head = next((item for m in modules if (item := m.oldest_pending()) is not None), None)
        lease = head.keep if head is not None else None
        wgrad = lease.copy.wgrad if isinstance(lease, _Lease) else None
        if not isinstance(lease, _Lease) or wgrad is None:
            for module in modules:
                module.backward_dw()
            return
        copy = lease.copy
        for module, _ in copy.deferred:
            item = module.oldest_pending()
            if item is None or item.keep is not lease:
                raise WgradError(
                    f"{self.label}: expected {module.label}'s oldest pending weight gradient "
                    "to come from the same graphed backward as the block's, received "
                    f"{'none' if item is None else 'another backward'}: run backward_dw once "
                    "per backward, in order, for every module of the block"
                )
            module.pop_pending()
        wgrad.replay()
        self.stats.wgrad_replays += 1
        with torch.no_grad():
            for (module, _), grad in zip(copy.deferred, copy.wgrad_out, strict=True):
                accumulate_grad(module.weight, grad.clone())

    # --- capture -------------------------------------------------------------------------
    def _named(self) -> list[tuple[str, nn.Parameter]]:
        seen: set[int] = set()
        named: list[tuple[str, nn.Parameter]] = []
        modules = self.modules
        if self._modules_of is not None:
            modules = check_arg(self.label, "modules()", modules, _MODULES)
        for i, module in enumerate(modules):
            for name, p in module.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    named.append((f"{i}.{name}", p))
        return named

    def _surface(self) -> tuple[nn.Parameter, ...]:
        """Every parameter of the modules, walked again when anything was registered since
        the last walk (in debug mode at every call), which catches a submodule or parameter
        replaced by another object since the capture."""
        if self._all is None or DEBUG or self._walked != registrations():
            walked = registrations()
            found = tuple(p for _, p in self._named())
            if self._all is not None and (
                len(found) != len(self._all)
                or any(a is not b for a, b in zip(found, self._all, strict=True))
            ):
                raise ConfigError(
                    f"{self.label}: the CUDA graph of scope '{self.scope.name}' was captured "
                    f"with other parameter objects ({len(self._all)}), received "
                    f"{len(found)} parameters of which some were replaced (a parameter or "
                    "submodule set since the capture); call reset_graphs() on the model after "
                    "replacing parameters or submodules"
                )
            self._all, self._walked, self._delayed_modules = found, walked, None
        return self._all

    def _state_key(self, every: Sequence[nn.Parameter]) -> tuple[object, ...]:
        frozen = self.frozen() if self.frozen is not None else None
        training = tuple(m.training for m in self.modules)
        grads = tuple(p.requires_grad for p in every)
        return (grads, tuple(p.data_ptr() for p in every), training, frozen)

    def _acquire(
        self,
        args: Sequence[Tensor],
        every: Sequence[nn.Parameter],
        params: Sequence[nn.Parameter],
    ) -> _Copy:
        signature: _Signature = tuple(
            (tuple(a.shape), a.dtype, a.device, a.requires_grad) for a in args
        )
        key = self._state_key(every)
        if self._signature is None:
            self._check_params()
            self._signature, self._key = signature, key
        elif signature != self._signature:
            raise ConfigError(
                f"{self.label}: the CUDA graph of scope '{self.scope.name}' was captured for "
                f"inputs {_describe(self._signature)}, received {_describe(signature)}; a "
                "graphed scope needs the same shapes every microbatch: keep the microbatch "
                f"shape fixed or leave '{self.scope.name}' out of cuda_graph_modules"
            )
        elif key != self._key:
            raise ConfigError(
                f"{self.label}: the CUDA graph of scope '{self.scope.name}' was captured "
                f"with other parameters or settings (trainable names, storage, training "
                f"flag, frozen values {self._key[3] if self._key else None!r}), received "
                f"{key[3]!r} and parameters that changed since; graphs read parameters by "
                "address: call reset_graphs() on the model after moving, re-sharding or "
                "re-freezing it, or changing what the capture froze"
            )
        for copy in self._copies:
            if copy.free():
                return copy
        copy = self._capture(args, params)
        self._copies.append(copy)
        return copy

    def _check_params(self) -> None:
        for name, p in self._named():
            if type(p.data) is not torch.Tensor or not p.is_cuda:
                raise ConfigError(
                    f"{self.label}: a CUDA graph of scope '{self.scope.name}' needs plain "
                    f"CUDA tensor parameters, received {name} as {type(p.data).__name__} on "
                    f"{p.device}: leave the scope out of cuda_graph_modules when sharding "
                    "(FSDP2 moves parameters every step)"
                )

    def _delayed(self) -> list[DelayedWgradModule]:
        if self._delayed_modules is None:
            found: dict[int, DelayedWgradModule] = {}
            for module in self.modules:
                for m in module.modules():
                    if isinstance(m, DelayedWgradModule):
                        found.setdefault(id(m), m)
            self._delayed_modules = list(found.values())
        return self._delayed_modules

    def _capture(self, args: Sequence[Tensor], params: Sequence[nn.Parameter]) -> _Copy:
        delayed = self._delayed()
        # Captured delayed whoever calls: each backward replay then queues the weight
        # gradients for a schedule that claims the modules, or replays them at once.
        with WgradClaim([m for m in delayed if m.delay_wgrad]):
            try:
                with _collector_paused():
                    return self._capture_claimed(delayed, args, params)
            except RuntimeError as error:  # torch.AcceleratorError too
                if "captur" not in str(error):  # capture, capturing
                    raise
                _leave_capture_mode(args[0].device)
                raise ConfigError(
                    f"{self.label}: capturing the CUDA graph of scope '{self.scope.name}' "
                    "expected a function that only launches kernels, on parameters no older "
                    "autograd graph holds, received a capture CUDA invalidated "
                    f"({str(error).splitlines()[0]}). The usual causes: a host "
                    "synchronisation inside the scope (.item(), .tolist(), a dropless "
                    "router's counts), or an autograd graph from before the first graphed "
                    "call still alive and using these parameters (an eager output or loss "
                    "kept in a variable: its gradient accumulators sit on another stream). "
                    "Drop or detach such outputs before the first graphed call, or leave "
                    f"'{self.scope.name}' out of cuda_graph_modules"
                ) from error

    def _capture_claimed(
        self,
        delayed: Sequence[DelayedWgradModule],
        args: Sequence[Tensor],
        params: Sequence[nn.Parameter],
    ) -> _Copy:
        queued = [m.pending_wgrad for m in delayed]
        inputs = tuple(a.detach().clone().requires_grad_(a.requires_grad) for a in args)
        surface = tuple(t for t in (*inputs, *params) if t.requires_grad)
        torch.cuda.synchronize()
        side = _new_stream()
        side.wait_stream(torch.cuda.current_stream())
        used: set[int] = {id(t) for t in inputs}
        device = inputs[0].device
        rng = torch.cuda.get_rng_state(device)
        with torch.cuda.stream(side):  # lazy initialisations stay out of the graphs
            for _ in range(self.warmup):
                outs = [o for o in tree_leaves(self.fn(*inputs)) if o.requires_grad]
                if outs:
                    # allow_unused: None for an untouched input (torch's stub says Tensor).
                    found = cast(
                        "Sequence[Tensor | None]",
                        torch.autograd.grad(
                            outs, surface, [torch.zeros_like(o) for o in outs], allow_unused=True
                        ),
                    )
                    used.update(id(t) for t, g in zip(surface, found, strict=True) if g is not None)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        # The warm-up's random draws are undone (a capture draws none): the replay that
        # follows draws what an eager call would, and a recompute that captures a copy
        # draws what its forward drew.
        torch.cuda.set_rng_state(rng, device)
        for module, count in zip(delayed, queued, strict=True):
            if module.take_pending_since(count):  # the warm-up's; its weight is used, delayed
                used.add(id(module.weight))
        # Parameters the function does not touch stay out of the backward capture: their
        # gradient is none either way, and autograd would sync with their accumulators'
        # streams, which the capture forbids.
        surface = tuple(t for t in surface if id(t) in used)
        pool = torch.cuda.graph_pool_handle()
        fwd = torch.cuda.CUDAGraph()
        with torch.cuda.graph(fwd, pool=pool):
            result = self.fn(*inputs)
        outputs = tuple(cast("list[Tensor]", tree_leaves(result)))
        grad_outputs = tuple(torch.empty_like(o) if o.requires_grad else None for o in outputs)
        needed = [(o, g) for o, g in zip(outputs, grad_outputs, strict=True) if g is not None]
        bwd: torch.cuda.CUDAGraph | None = None
        grads: Sequence[Tensor | None] = [None] * len(surface)
        if needed:
            bwd = torch.cuda.CUDAGraph()
            with torch.cuda.graph(bwd, pool=pool):
                grads = torch.autograd.grad(
                    [o for o, _ in needed], surface, [g for _, g in needed], allow_unused=True
                )
        by_tensor = {id(t): g for t, g in zip(surface, grads, strict=True)}
        grad_inputs = tuple(by_tensor.get(id(t)) for t in (*inputs, *params))
        deferred = tuple(
            (module, item)
            for module, count in zip(delayed, queued, strict=True)
            for item in module.take_pending_since(count)
        )
        copy = _Copy(
            inputs=inputs,
            outputs=outputs,
            fwd=fwd,
            bwd=bwd,
            grad_outputs=grad_outputs,
            grad_inputs=grad_inputs,
            deferred=deferred,
        )
        if deferred:
            copy.wgrad = torch.cuda.CUDAGraph()
            with torch.no_grad(), torch.cuda.graph(copy.wgrad, pool=pool):
                copy.wgrad_out = tuple(i.wgrad() for _, i in deferred)
        self.stats.captures += 1
        return copy


@contextmanager
def _collector_paused() -> Generator[None]:
    """Python's cyclic garbage collector off while the block captures. A dead reference
    cycle holding CUDA graphs (a dropped graphed model's, say) collected inside a capture
    destroys them there, and that CUDA call invalidates the capture (torch's
    :func:`torch.cuda.graph` no longer collects before it begins). Collection resumes after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _leave_capture_mode(device: torch.device) -> None:
    """After a capture CUDA invalidated, torch skips the random generator's capture epilogue:
    the device's default generator stays in capture mode and every later draw on the device
    fails ("Offset increment outside graph capture"). An empty capture runs the prologue and
    epilogue again on the same generator state, whose eager offset a capture leaves as it
    was; if even that fails, the caller's error is raised all the same."""
    if device.type != "cuda":
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that the graph is empty
        try:
            with torch.cuda.device(device), torch.cuda.graph(torch.cuda.CUDAGraph()):
                pass
        except RuntimeError:
            pass


def _describe(signature: _Signature) -> str:
    return ", ".join(
        f"{list(shape)} {str(dtype).removeprefix('torch.')}{' (grad)' if grad else ''}"
        for shape, dtype, _, grad in signature
    )
