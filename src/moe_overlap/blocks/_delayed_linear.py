"""Linear layers whose weight gradient can be delayed to an explicit ``backward_dw()``.

Legend: ``N`` rows (tokens), ``I`` input features, ``O`` output features, ``G`` groups
(local experts).

With ``delay_wgrad`` off, backward computes both gradients, like ``nn.Linear``. With it on,
backward computes only the input gradient and queues ``(input, grad_output)`` when a
schedule claims the module (:mod:`moe_overlap.wgrad`: a plan whose layer lists it, or
:func:`~moe_overlap.wgrad.claim_wgrad`); :meth:`DelayedWgradModule.backward_dw` later
computes the weight gradient with *the same expression* and accumulates it as autograd
would (cast to the gradient's dtype, e.g. from an autocast dtype; assign when ``grad`` is
``None``, else add in place), so delayed and immediate results are bit-identical. Unclaimed (a plain ``loss.backward()``, another adapter's
schedule, a deep copy), backward computes the weight gradient at once, as with
``delay_wgrad`` off: nothing is ever queued that nothing would compute.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast, overload, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import Self

from moe_overlap import ConfigError, IntegrationError, WgradError
from moe_overlap.args import (
    BOOL,
    FLOAT_DTYPE,
    NON_NEGATIVE,
    OPT_DEVICE,
    POSITIVE,
    Instance,
    Items,
    check_arg,
    refuse,
)
from moe_overlap.blocks._autocast import AutocastState
from moe_overlap.blocks._torch_private import grouped_mm, has_grouped_mm
from moe_overlap.engine import wgrad_claimed
from moe_overlap.engine.contracts import Contract, method

__all__ = [
    "DelayedWgradGroupedLinear",
    "DelayedWgradLinear",
    "DelayedWgradModule",
    "DenseKernel",
    "GroupSizes",
    "GroupedKernel",
    "MatmulKernel",
    "PendingItem",
    "discard_wgrad",
    "finish_wgrad",
]


_PARAMETER = Instance(nn.Parameter, "an nn.Parameter (the weight)")
_SIZES = Items(
    NON_NEGATIVE,
    hint="one row count per group, in order (sizes on the device: GroupSizes.on_device)",
    ordered=True,
)


@runtime_checkable
class MatmulKernel(Protocol):
    """The three products of a linear layer: forward, input grad and weight grad."""

    def forward(self, x: Tensor, weight: Tensor) -> Tensor: ...
    def dgrad(self, grad_y: Tensor, weight: Tensor) -> Tensor: ...
    def wgrad(self, x: Tensor, grad_y: Tensor) -> Tensor: ...


MATMUL_KERNEL: Contract[MatmulKernel] = Contract(
    MatmulKernel,
    "a MatmulKernel (forward, dgrad and wgrad of a linear layer)",
    method("forward"),
    method("dgrad"),
    method("wgrad"),
)


@dataclass(frozen=True, slots=True)
class DenseKernel:
    """``y = x @ W^T`` with ``W`` of shape ``[O, I]``; ``x`` may have leading batch dims."""

    def forward(self, x: Tensor, weight: Tensor) -> Tensor:
        return F.linear(x, weight)

    def dgrad(self, grad_y: Tensor, weight: Tensor) -> Tensor:
        return grad_y.matmul(weight)

    def wgrad(self, x: Tensor, grad_y: Tensor) -> Tensor:
        gy_NO = grad_y.reshape(-1, grad_y.shape[-1])
        x_NI = x.reshape(-1, x.shape[-1])
        return gy_NO.t().matmul(x_NI)


def _grouped_mm_usable(x: Tensor, weight: Tensor) -> bool:
    """``torch._grouped_mm``: CUDA, bf16, Hopper or newer, 16-byte aligned feature dims."""
    return _grouped_mm_dims_usable(x, weight.shape[-2], weight.shape[-1])


def _grouped_mm_dims_usable(x: Tensor, out_features: int, in_features: int) -> bool:
    """:func:`_grouped_mm_usable` for a weight of ``[..., out_features, in_features]``."""
    if not (x.is_cuda and x.dtype == torch.bfloat16 and has_grouped_mm()):
        return False
    if torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    return out_features % 8 == 0 and in_features % 8 == 0


class GroupSizes(Sequence[int]):
    """Rows per group: host sizes, device offsets, or both.

    A ``Sequence[int]`` of the sizes. ``offsets`` holds their cumulative sum as ``int32`` on
    the rows' device; given, the grouped GEMM reads it instead of copying the sizes to the
    device (a host-to-device copy from pageable memory, which waits for the GPU). ``ids``
    holds each row's group (for per-group biases). ``total`` (the row count) and the group
    count are always known on the host.

    :meth:`on_device` builds one without host sizes (the dispatcher does: the counts stay on
    the device); the host tuple is then made only when something reads it (iteration,
    indexing, :attr:`sizes`: the per-group fallback, the CPU path), from ``host`` when given
    (a callable returning the sizes, e.g. from a pending pinned copy) or else by copying
    ``offsets`` to the host (one host sync on a GPU). :attr:`has_host_sizes` says whether
    that has happened.
    """

    __slots__ = ("_count", "_host", "_sizes", "ids", "offsets", "total")

    def __init__(
        self, sizes: Iterable[int], offsets: Tensor | None = None, ids: Tensor | None = None
    ) -> None:
        self._sizes: tuple[int, ...] | None = check_arg("GroupSizes", "sizes", sizes, _SIZES)
        self._count = len(self._sizes)
        self._host: Callable[[], Sequence[int]] | None = None
        self.total = sum(self._sizes)
        self.offsets = offsets
        self.ids = ids

    @classmethod
    def on_device(
        cls,
        offsets: Tensor,
        ids: Tensor | None = None,
        *,
        total: int,
        host: Callable[[], Sequence[int]] | None = None,
    ) -> GroupSizes:
        """Sizes known on the device only: ``offsets`` (``int32``, ``[groups]``, ending at
        ``total``), optional ``ids`` (``[total]``); the host sizes come later, lazily.

        Raises :class:`~moe_overlap.ConfigError` for offsets that are not a 1-D ``int32``
        tensor or ``ids`` not of ``total`` rows (shapes only: nothing is read).
        """
        if offsets.dim() != 1 or offsets.dtype != torch.int32:
            raise ConfigError(
                "GroupSizes.on_device: expected offsets as a 1-D int32 tensor (the cumulative "
                f"sizes), received a {offsets.dim()}-D {offsets.dtype} tensor; pass "
                "sizes.cumsum(0, dtype=torch.int32)"
            )
        if ids is not None and tuple(ids.shape) != (total,):
            raise ConfigError(
                f"GroupSizes.on_device: expected ids of shape [{total}] (one group per row), "
                f"received {list(ids.shape)}"
            )
        out = cls.__new__(cls)
        out._sizes = None
        out._count = offsets.shape[0]
        out._host = host
        out.total = total
        out.offsets = offsets
        out.ids = ids
        return out

    @property
    def has_host_sizes(self) -> bool:
        """Whether the host tuple of sizes exists (made at construction or by a read)."""
        return self._sizes is not None

    @property
    def sizes(self) -> tuple[int, ...]:
        """The sizes on the host (made on first read; see the class docstring).

        Raises :class:`~moe_overlap.ConfigError` when they do not match the group count and
        ``total``.
        """
        if self._sizes is None:
            self._sizes = self._materialize()
        return self._sizes

    def _materialize(self) -> tuple[int, ...]:
        if self._host is not None:
            sizes = tuple(self._host())
        else:
            assert self.offsets is not None  # on_device always sets offsets
            ends = cast("list[int]", self.offsets.cpu().tolist())  # pyright: ignore[reportUnknownMemberType]
            sizes = tuple(b - a for a, b in zip([0, *ends[:-1]], ends, strict=True))
        if len(sizes) != self._count or sum(sizes) != self.total:
            raise ConfigError(
                f"GroupSizes: expected {self._count} sizes summing to {self.total} rows, "
                f"received {list(sizes)} from the host; offsets and host sizes disagree"
            )
        return sizes

    def group_ids(self, device: torch.device) -> Tensor:
        """Each row's group, ``[total]`` (from ``ids`` when given, else from ``offsets`` on
        the device, else from the host sizes)."""
        if self.ids is not None:
            return self.ids
        if self.offsets is not None and self._sizes is None:
            rows = torch.arange(self.total, device=device, dtype=torch.int32)
            return torch.searchsorted(self.offsets, rows, right=True)
        counts = torch.tensor(self.sizes, dtype=torch.int64, device=device)
        groups = torch.arange(self._count, device=device)
        return torch.repeat_interleave(groups, counts, output_size=self.total)

    def device_offsets(self, device: torch.device) -> Tensor:
        """``offsets``, or the host sizes' cumulative sum copied to ``device`` (``int32``)."""
        if self.offsets is not None:
            return self.offsets
        return torch.tensor(self.sizes, dtype=torch.int32, device=device).cumsum(
            0, dtype=torch.int32
        )

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[int]:
        return iter(self.sizes)

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[int]: ...
    def __getitem__(self, index: int | slice) -> int | Sequence[int]:
        return self.sizes[index]

    def __repr__(self) -> str:
        if self._sizes is None:
            return f"GroupSizes(<on the device>, groups={self._count}, total={self.total})"
        return f"GroupSizes({list(self._sizes)})"


@dataclass(frozen=True, slots=True)
class GroupedKernel:
    """One GEMM per group: rows of ``x`` come grouped, ``groups[g]`` rows for group ``g``.

    ``W`` has shape ``[G, O, I]``. A group may have zero rows (its weight grad is zero). On
    a Hopper GPU in bf16 each of the three products is one ``torch._grouped_mm`` reading
    the device offsets of the :class:`GroupSizes` (the weight grad in its 2-D x 2-D form,
    the groups along the reduced rows), so nothing is read on the host; elsewhere each is
    one GEMM per group, split by the host sizes. Delayed and immediate weight grads are this
    one :meth:`wgrad`, hence bit-identical.

    ``x`` may also be ``[G, C, I]``: every group padded to the same ``C`` rows (capacity
    padding); then all three products are one batched GEMM and the sizes are unused.
    ``transposed``: ``W`` is stored ``[G, I, O]`` (``y = x @ W[g]``), as some transformers
    families store their experts.
    """

    groups: GroupSizes
    transposed: bool = False

    @classmethod
    def of(cls, sizes: Sequence[int], *, transposed: bool = False) -> GroupedKernel:
        groups = sizes if isinstance(sizes, GroupSizes) else GroupSizes(sizes)
        return cls(groups, transposed)

    @property
    def sizes(self) -> tuple[int, ...]:
        """The host sizes (made on first read: see :class:`GroupSizes`)."""
        return self.groups.sizes

    def _w_OI(self, weight: Tensor) -> Tensor:
        """The weight as ``[G, O, I]`` (a view)."""
        return weight.transpose(-2, -1) if self.transposed else weight

    def forward(self, x: Tensor, weight: Tensor) -> Tensor:
        w_OI = self._w_OI(weight)
        if x.dim() == 3:
            return torch.bmm(x, w_OI.transpose(-2, -1))
        if _grouped_mm_usable(x, w_OI):
            return grouped_mm(x, w_OI.transpose(-2, -1), offs=self.groups.device_offsets(x.device))
        parts = torch.split(x, list(self.sizes), dim=0)
        return torch.cat([F.linear(p, w_OI[g]) for g, p in enumerate(parts)], dim=0)

    def dgrad(self, grad_y: Tensor, weight: Tensor) -> Tensor:
        w_OI = self._w_OI(weight)
        if grad_y.dim() == 3:
            return torch.bmm(grad_y, w_OI)
        if _grouped_mm_usable(grad_y, w_OI):
            return grouped_mm(
                grad_y,
                w_OI if self.transposed else w_OI.contiguous(),
                offs=self.groups.device_offsets(grad_y.device),
            )
        parts = torch.split(grad_y, list(self.sizes), dim=0)
        return torch.cat([p.matmul(w_OI[g]) for g, p in enumerate(parts)], dim=0)

    def wgrad(self, x: Tensor, grad_y: Tensor) -> Tensor:
        if x.dim() == 3:
            if self.transposed:
                return torch.bmm(x.transpose(-2, -1), grad_y)
            return torch.bmm(grad_y.transpose(-2, -1), x)
        if grad_y.dtype == x.dtype and _grouped_mm_dims_usable(x, grad_y.shape[-1], x.shape[-1]):
            # [O, N] x [N, I], the groups along the reduced N: [G, O, I], zeros for an empty
            # group; the form torch's own _grouped_mm backward uses for a 3-D weight's grad.
            x_NI, gy_NO = x.contiguous(), grad_y.contiguous()
            offs = self.groups.device_offsets(x.device)
            if self.transposed:
                return grouped_mm(x_NI.t(), gy_NO, offs=offs)
            return grouped_mm(gy_NO.t(), x_NI, offs=offs)
        xs = torch.split(x, list(self.sizes), dim=0)
        gys = torch.split(grad_y, list(self.sizes), dim=0)
        if self.transposed:
            return torch.stack([xi.t().matmul(gy) for xi, gy in zip(xs, gys, strict=True)])
        return torch.stack([gy.t().matmul(xi) for xi, gy in zip(xs, gys, strict=True)])


@dataclass(frozen=True, slots=True)
class PendingItem:
    """One backward's owed weight gradient: ``kernel.wgrad(x, grad_y)``.

    ``keep`` is whatever must stay alive until the gradient is computed (a CUDA graph's
    lease on the static buffers ``x`` and ``grad_y`` live in), else ``None``. ``autocast``
    is the autocast state the module's forward ran under, which :meth:`wgrad` computes it
    under, as the immediate weight gradient is (``None``: under the caller's).
    """

    x: Tensor
    grad_y: Tensor
    kernel: MatmulKernel
    keep: object = None
    autocast: AutocastState | None = None

    def wgrad(self) -> Tensor:
        """``kernel.wgrad(x, grad_y)`` under :attr:`autocast`."""
        if self.autocast is None:
            return self.kernel.wgrad(self.x, self.grad_y)
        with self.autocast.restored():
            return self.kernel.wgrad(self.x, self.grad_y)


class DelayedWgradModule(nn.Module):
    """Base of the delayable linears: owns ``weight`` and the queue of pending wgrads.

    A :class:`~moe_overlap.WgradLayer`. ``label`` names the module in error messages (the
    model sets it to the module's qualified name). :attr:`calls_per_backward` (default 1):
    how many times the module runs per forward pass. ``delay_wgrad`` says the module may
    delay; it does only while claimed (see the module doc), so every backward outside a
    schedule that runs its ``backward_dw()`` leaves its gradient in ``.grad``.
    """

    weight: nn.Parameter

    def __init__(self, weight: nn.Parameter, *, delay_wgrad: bool) -> None:
        super().__init__()
        w = type(self).__name__
        self.weight = check_arg(w, "weight", weight, _PARAMETER)
        self.delay_wgrad = check_arg(w, "delay_wgrad", delay_wgrad, BOOL)
        self.label = type(self).__name__
        self._pending: deque[PendingItem] = deque()
        self._calls = 1

    @property
    def calls_per_backward(self) -> int:
        """How many times the module runs in one forward pass (so how many weight gradients
        one backward pass queues): a chunked dispatcher's experts run once per chunk.
        :meth:`backward_dw` computes that many, sums them in the order autograd sums the
        gradients of a weight used several times, and accumulates the sum once, so delayed
        and immediate weight gradients stay bit-identical. Default 1."""
        return self._calls

    @calls_per_backward.setter
    def calls_per_backward(self, calls: int) -> None:
        self._calls = check_arg(self.label, "calls_per_backward", calls, POSITIVE)

    @property
    def pending_wgrad(self) -> int:
        """How many backward passes wait for their weight gradient."""
        return len(self._pending)

    def _apply_kernel(self, x: Tensor, kernel: MatmulKernel) -> Tensor:
        weight = self.weight  # a parametrization computes it anew at every read
        if not weight.is_leaf and self.delay_wgrad and wgrad_claimed(self):
            raise ConfigError(
                f"{self.label}: expected a leaf weight (an nn.Parameter) to accumulate a "
                "delayed weight gradient into, received a computed one (a parametrization: "
                "torch.nn.utils.parametrize, weight_norm, spectral_norm): backward_dw() "
                "would write the gradient to that computed tensor and the parameters it is "
                "computed from would get none, where plain backward() reaches them. Build "
                "the model without delayed weight gradients (delay_wgrad_compute=False), or "
                "remove the parametrization"
            )
        return _delayable_matmul(x, weight, kernel, self)

    def defer_wgrad(
        self,
        x: Tensor,
        grad_y: Tensor,
        kernel: MatmulKernel,
        keep: object = None,
        autocast: AutocastState | None = None,
    ) -> None:
        """Queue ``kernel.wgrad(x, grad_y)`` for a later :meth:`backward_dw`, to compute
        under ``autocast`` (default: the current autocast state of ``x``'s device type,
        which the module's backward set to its forward's)."""
        if autocast is None:
            autocast = AutocastState.of(x.device.type)
        self._pending.append(PendingItem(x, grad_y, kernel, keep, autocast))

    def take_pending_since(self, count: int) -> list[PendingItem]:
        """Remove and return the items queued after the first ``count`` (a graph capture's)."""
        taken: list[PendingItem] = []
        while len(self._pending) > count:
            taken.append(self._pending.pop())
        taken.reverse()
        return taken

    def oldest_pending(self) -> PendingItem | None:
        """The item :meth:`backward_dw` would compute next, or ``None``."""
        return self._pending[0] if self._pending else None

    def pop_pending(self) -> PendingItem:
        """Remove the oldest item without computing it (its owner computes it instead)."""
        return self._pending.popleft()

    def backward_dw(self) -> None:
        """Compute and accumulate the oldest pending weight gradient (the oldest
        :attr:`calls_per_backward`, summed, when that is above 1).

        A frozen weight (``requires_grad`` false) has none to compute: backward queues
        nothing for it and this is a no-op. Raises :class:`~moe_overlap.WgradError` when
        wgrad is not delayed or nothing is pending (``backward_dw`` called twice for one
        backward).
        """
        if not self.delay_wgrad:
            raise WgradError(
                f"{self.label}: backward_dw expected delayed weight gradients "
                "(config.delay_wgrad_compute=True, matching ScheduleOptions), received a "
                "module built with delay_wgrad=False"
            )
        if not self._pending and not self.weight.requires_grad:
            return
        if not self._pending:
            raise WgradError(
                f"{self.label}: backward_dw expected a pending weight gradient (one per "
                "backward), received none: called twice, before backward, or after a "
                "backward no schedule claimed the module for (that one computed the weight "
                "gradient at once); run the backward inside moe_overlap.wgrad.claim_wgrad("
                "module) to delay it"
            )
        calls = self._calls
        if calls > 1:
            self._backward_dw_calls(calls)
            return
        item = self._pending.popleft()
        with torch.no_grad():  # no graph behind the gradient, whoever calls this
            grad_w = item.wgrad()
            accumulate_grad(self.weight, _as_grad_dtype(self.weight, grad_w))

    def _backward_dw_calls(self, calls: int) -> None:
        """One backward pass's ``calls`` weight gradients: summed in the order they were
        queued (autograd's order of summing a weight's gradients), accumulated once."""
        if len(self._pending) < calls:
            raise WgradError(
                f"{self.label}: backward_dw expected {calls} pending weight gradients (one per "
                f"call of the module in a backward pass, calls_per_backward={calls}), "
                f"received {len(self._pending)}: the module ran fewer times than "
                "calls_per_backward says, or backward_dw was called twice"
            )
        with torch.no_grad():  # no graph behind the gradient, whoever calls this
            total: Tensor | None = None
            for _ in range(calls):
                item = self._pending.popleft()
                # each cast before the sum, as autograd casts every part it then sums
                grad_w = _as_grad_dtype(self.weight, item.wgrad())
                total = grad_w if total is None else total + grad_w
            assert total is not None
            accumulate_grad(self.weight, total)

    def discard_wgrad(self) -> None:
        """Drop pending weight gradients (after a failed step)."""
        self._pending.clear()

    def __deepcopy__(self, memo: dict[int, object]) -> Self:
        """A copy with its own empty queue, claimed by nothing (a claim names objects).

        Raises :class:`~moe_overlap.WgradError` while weight gradients are pending: the copy
        would not owe them and its ``.grad`` would lack them.
        """
        if self._pending:
            raise WgradError(
                f"{self.label}: deepcopy expected no delayed weight gradient pending, received "
                f"{len(self._pending)}: the copy's .grad would lack them; run backward_dw() "
                "(moe_overlap.blocks.finish_wgrad(model)) or discard_wgrad() before copying"
            )
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return copied


def _as_grad_dtype(param: Tensor, grad: Tensor) -> Tensor:
    """``grad`` in the dtype ``param``'s gradient takes, as autograd casts a gradient
    before accumulating it: ``param.grad_dtype`` where torch has it (``None`` there: any
    dtype, unchanged), else ``param.dtype``. A weight gradient computed under
    ``torch.autocast`` comes out in the autocast dtype."""
    want = cast("torch.dtype | None", getattr(param, "grad_dtype", param.dtype))
    return grad if want is None or grad.dtype == want else grad.to(want)


def accumulate_grad(param: nn.Parameter, grad: Tensor) -> None:
    """What ``AccumulateGrad`` does for a dense grad: cast to the parameter's gradient
    dtype (as autograd does), assign first, add in place after.

    ``grad`` becomes ``param.grad`` when there is none (pass a tensor nothing else
    writes), laid out as autograd lays out a first gradient (torch's gradient layout
    contract): with ``param``'s strides for a dense non-overlapping ``param`` (a copy when
    ``grad``'s differ), contiguous for any other. A ``grad`` of another shape than
    ``param`` (which ``add_`` would broadcast) is a :class:`~moe_overlap.ConfigError`.
    """
    if not isinstance(cast(object, param), Tensor):
        raise refuse("accumulate_grad: param", "an nn.Parameter", param)
    if not isinstance(cast(object, grad), Tensor) or grad.shape != param.shape:
        raise refuse(
            "accumulate_grad: grad", f"a Tensor of the parameter's shape {list(param.shape)}", grad
        )
    grad = _as_grad_dtype(param, grad)
    if param.grad is None:
        param.grad = _laid_out_like(param, grad)
    else:
        param.grad.add_(grad)


def _laid_out_like(param: Tensor, grad: Tensor) -> Tensor:
    """``grad`` as ``AccumulateGrad`` stores a parameter's first gradient: as it is when it
    obeys the layout contract, else copied into ``param``'s strides (dense non-overlapping
    ``param``) or into a contiguous tensor (any other)."""
    if not _non_overlapping_and_dense(param):
        return grad if grad.is_contiguous() else grad.contiguous()
    sizes, want, have = param.shape, param.stride(), grad.stride()
    # size-1 dims: any stride but 0 (a 0 there is a broadcast view)
    if all(h == w if n != 1 else h != 0 for n, w, h in zip(sizes, want, have, strict=True)):
        return grad
    out = torch.empty_strided(sizes, want, dtype=grad.dtype, device=grad.device)
    return out.copy_(grad)


def _non_overlapping_and_dense(t: Tensor) -> bool:
    """Whether ``t``'s elements fill its storage span exactly once in some dim order
    (torch's ``is_non_overlapping_and_dense``): size-1 dims aside, the strides sorted
    ascending are 1 and the running products of the sizes."""
    dims = sorted((s, n) for n, s in zip(t.shape, t.stride(), strict=True) if n >= 2)
    want = 1
    for stride, size in dims:
        if stride != want:
            return False
        want *= size
    return True


class _DelayableMatmul(torch.autograd.Function):
    """``kernel.forward(x, weight)``; backward defers the weight grad when the owner says so."""

    @staticmethod
    def forward(
        ctx: Any,  # torch's FunctionCtx declares no fields; we add our own
        x: Tensor,
        weight: Tensor,
        kernel: MatmulKernel,
        owner: DelayedWgradModule,
    ) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.kernel = kernel
        ctx.owner = owner
        ctx.autocast = AutocastState.of(x.device.type)  # as torch.amp.custom_fwd records it
        return kernel.forward(x, weight)

    @staticmethod
    def backward(
        ctx: Any,  # see forward
        *grad_outputs: Tensor,
    ) -> tuple[Tensor | None, Tensor | None, None, None]:
        (grad_y,) = grad_outputs
        x: Tensor
        weight: Tensor
        x, weight = ctx.saved_tensors
        kernel: MatmulKernel = ctx.kernel
        owner: DelayedWgradModule = ctx.owner
        needs_x: bool = ctx.needs_input_grad[0]
        needs_w: bool = ctx.needs_input_grad[1]
        autocast: AutocastState = ctx.autocast
        grad_w: Tensor | None = None
        # Under the forward's autocast state, as torch.amp.custom_bwd runs a backward: a
        # forward under autocast and a backward outside it (torch's recommended use) give
        # a bfloat16 grad_y here, multiplied by the float32 weight as autocast casts it.
        with autocast.restored():
            grad_x = kernel.dgrad(grad_y, weight) if needs_x else None
            if needs_w:
                if owner.delay_wgrad and wgrad_claimed(owner):
                    owner.defer_wgrad(x, grad_y, kernel, autocast=autocast)
                else:  # nothing will run backward_dw for it: now, as autograd accumulates it
                    grad_w = kernel.wgrad(x, grad_y)
        return grad_x, grad_w, None, None


# Function.apply is untyped; give it its signature once, here.
_delayable_matmul = cast(
    "Callable[[Tensor, Tensor, MatmulKernel, DelayedWgradModule], Tensor]",
    _DelayableMatmul.apply,  # pyright: ignore[reportUnknownMemberType]
)


class DelayedWgradLinear(DelayedWgradModule):
    """``y = x @ W^T`` (no bias), ``W`` of shape ``[out_features, in_features]``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        delay_wgrad: bool,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ) -> None:
        w = "DelayedWgradLinear"
        in_features = check_arg(w, "in_features", in_features, POSITIVE)
        out_features = check_arg(w, "out_features", out_features, POSITIVE)
        dtype = check_arg(w, "dtype", dtype, FLOAT_DTYPE)
        device = check_arg(w, "device", device, OPT_DEVICE)
        weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        super().__init__(weight, delay_wgrad=delay_wgrad)
        self.in_features = in_features
        self.out_features = out_features

    def forward(self, x: Tensor) -> Tensor:
        return self._apply_kernel(x, _DENSE)


_DENSE = DenseKernel()


class DelayedWgradGroupedLinear(DelayedWgradModule):
    """One linear per group (expert): ``W`` of shape ``[groups, out_features, in_features]``
    (``[groups, in_features, out_features]`` when ``transposed``)."""

    def __init__(
        self,
        groups: int,
        in_features: int,
        out_features: int,
        *,
        delay_wgrad: bool,
        transposed: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ) -> None:
        w = "DelayedWgradGroupedLinear"
        groups = check_arg(w, "groups", groups, POSITIVE)
        in_features = check_arg(w, "in_features", in_features, POSITIVE)
        out_features = check_arg(w, "out_features", out_features, POSITIVE)
        transposed = check_arg(w, "transposed", transposed, BOOL)
        dtype = check_arg(w, "dtype", dtype, FLOAT_DTYPE)
        device = check_arg(w, "device", device, OPT_DEVICE)
        shape = (
            (groups, in_features, out_features)
            if transposed
            else (groups, out_features, in_features)
        )
        weight = nn.Parameter(torch.empty(*shape, dtype=dtype, device=device))
        super().__init__(weight, delay_wgrad=delay_wgrad)
        self.groups = groups
        self.transposed = transposed
        self.in_features = in_features

    def forward(self, x_NI: Tensor, sizes: Sequence[int]) -> Tensor:
        """``x_NI`` rows grouped by group, ``sizes[g]`` rows each (zero allowed); or
        ``[groups, C, in_features]``, each group padded to ``C`` rows (``sizes`` unused)."""
        if x_NI.dim() == 3:
            if x_NI.shape[0] != self.groups:
                raise ConfigError(
                    f"{self.label}: expected padded input [groups={self.groups}, C, "
                    f"{self.in_features}], received {list(x_NI.shape)}"
                )
        elif len(sizes) != self.groups or _total(sizes) != x_NI.shape[0]:
            shown = sizes if isinstance(sizes, GroupSizes) else list(sizes)
            raise ConfigError(
                f"{self.label}: expected {self.groups} group sizes summing to the "
                f"{x_NI.shape[0]} rows of the input, received {shown}; pass the rows "
                "per group in order, zero for an empty group"
            )
        return self._apply_kernel(x_NI, GroupedKernel.of(sizes, transposed=self.transposed))


def _total(sizes: Sequence[int]) -> int:
    """The rows ``sizes`` covers; a :class:`GroupSizes` knows it without its host sizes."""
    return sizes.total if isinstance(sizes, GroupSizes) else sum(sizes)


def _delayed(model: nn.Module) -> Iterator[DelayedWgradModule]:
    if not isinstance(cast(object, model), nn.Module):
        raise refuse("the model", "an nn.Module", model, error=IntegrationError)
    for module in model.modules():
        if isinstance(module, DelayedWgradModule):
            yield module


def finish_wgrad(model: nn.Module) -> None:
    """Run every pending ``backward_dw`` of ``model`` (e.g. after a backward run inside
    :func:`~moe_overlap.wgrad.claim_wgrad`; a plain ``backward()`` leaves none)."""
    for module in _delayed(model):
        while module.pending_wgrad:
            module.backward_dw()


def discard_wgrad(model: nn.Module) -> None:
    """Drop every pending weight gradient of ``model`` (after a failed step; zero grads too)."""
    for module in _delayed(model):
        module.discard_wgrad()
