"""Building blocks: RMSNorm, rotary embedding, causal self-attention, SwiGLU MLP.

Legend: ``B`` batch, ``S`` sequence, ``D`` hidden, ``H`` heads, ``E`` head dim (``D/H``),
``T`` tokens (``B*S``), ``F`` feed-forward hidden.
"""

from __future__ import annotations

import math
from typing import Literal, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe_overlap.args import (
    BOOL,
    FLOAT_DTYPE,
    OPT_DEVICE,
    POSITIVE,
    TENSOR,
    OneOf,
    Real,
    check_arg,
    refuse,
)
from moe_overlap.blocks._delayed_linear import DelayedWgradLinear
from moe_overlap.blocks._recompute import recompute

_IMPL: OneOf[Literal["math", "sdpa"]] = OneOf(("math", "sdpa"))

__all__ = [
    "RMSNorm",
    "RotaryTables",
    "SelfAttention",
    "SwiGLUMLP",
    "apply_rotary",
    "rotary_tables",
    "swiglu",
]


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32, scaled by a learned weight.

    ``recompute``: recomputed in backward instead of storing its float32 intermediates.
    """

    def __init__(
        self,
        dim: int,
        *,
        eps: float,
        recompute: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        w = "RMSNorm"
        dim = check_arg(w, "dim", dim, POSITIVE)
        self.eps = check_arg(w, "eps", eps, Real(above=0))
        self.recompute = check_arg(w, "recompute", recompute, BOOL)
        dtype = check_arg(w, "dtype", dtype, FLOAT_DTYPE)
        device = check_arg(w, "device", device, OPT_DEVICE)
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: Tensor) -> Tensor:
        return recompute(self._norm, x) if self.recompute else self._norm(x)

    def _norm(self, x: Tensor) -> Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


def swiglu(gate_up: Tensor) -> Tensor:
    """``silu(gate) * up`` of ``[gate, up]`` concatenated on the last dim."""
    if not isinstance(cast(object, gate_up), Tensor):
        raise refuse("swiglu: gate_up", "a Tensor", gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


RotaryTables = tuple[Tensor, Tensor, Tensor]
"""``(freqs_BSE, cos_B1SE, sin_B1SE)``: what ``_preprocess`` hands the layers."""


def rotary_tables(
    position_ids_BS: Tensor, head_dim: int, base: float, dtype: torch.dtype
) -> RotaryTables:
    """Rotary angles for each position, and their cosine and sine (broadcast over heads)."""
    w = "rotary_tables"
    check_arg(w, "position_ids_BS", position_ids_BS, TENSOR)
    head_dim = check_arg(w, "head_dim", head_dim, POSITIVE)
    if head_dim % 2:
        raise refuse(f"{w}: head_dim", "an even int >= 2 (rotary rotates pairs)", head_dim)
    base = check_arg(w, "base", base, Real(above=0))
    dtype = check_arg(w, "dtype", dtype, FLOAT_DTYPE)
    exponent = torch.arange(0, head_dim, 2, device=position_ids_BS.device, dtype=torch.float32)
    inv_freq = 1.0 / (base ** (exponent / head_dim))
    half_BSe = position_ids_BS.to(torch.float32)[..., None] * inv_freq
    freqs_BSE = torch.cat([half_BSe, half_BSe], dim=-1)
    cos = freqs_BSE.cos().to(dtype)[:, None]
    sin = freqs_BSE.sin().to(dtype)[:, None]
    return freqs_BSE, cos, sin


def apply_rotary(x_BHSE: Tensor, cos_B1SE: Tensor, sin_B1SE: Tensor) -> Tensor:
    """Rotate pairs ``(x_i, x_{i+E/2})`` by the position's angle."""
    for name, t in (("x_BHSE", x_BHSE), ("cos_B1SE", cos_B1SE), ("sin_B1SE", sin_B1SE)):
        if not isinstance(cast(object, t), Tensor):
            raise refuse(f"apply_rotary: {name}", "a Tensor", t)
    a, b = x_BHSE.chunk(2, dim=-1)
    rotated = torch.cat([-b, a], dim=-1)
    return x_BHSE * cos_B1SE + rotated * sin_B1SE


class SelfAttention(nn.Module):
    """Causal multi-head self-attention with rotary embedding; fused QKV and output projection.

    ``forward(x, cos, sin, blocked=None, dead=None)``: without ``blocked``, causal
    attention; with it (a bool ``[B or 1, 1, S, S]``, ``True`` where a query must not attend
    a key, causality included, from :func:`~moe_overlap.blocks.blocked_keys`), only the
    keys it leaves; the queries marked in ``dead`` (``[B or 1, 1, S, 1]``: no key left) get
    a zero output. Both impls (``math``, ``sdpa``) honour it.

    A :class:`~moe_overlap.WgradLayer`: ``backward_dw`` runs both projections' delayed
    weight gradients. ``recompute_core``: softmax(QK^T)V recomputed in backward.
    """

    def __init__(
        self,
        hidden: int,
        heads: int,
        *,
        impl: Literal["math", "sdpa"],
        delay_wgrad: bool,
        recompute_core: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        w = "SelfAttention"
        hidden = check_arg(w, "hidden", hidden, POSITIVE)
        heads = check_arg(w, "heads", heads, POSITIVE)
        head_dim, rem = divmod(hidden, heads)
        if rem or head_dim % 2:
            raise refuse(
                f"{w}: hidden",
                f"a multiple of heads={heads} with an even head dim (rotary rotates pairs)",
                hidden,
            )
        impl = check_arg(w, "impl", impl, _IMPL)
        delay_wgrad = check_arg(w, "delay_wgrad", delay_wgrad, BOOL)
        recompute_core = check_arg(w, "recompute_core", recompute_core, BOOL)
        dtype = check_arg(w, "dtype", dtype, FLOAT_DTYPE)
        device = check_arg(w, "device", device, OPT_DEVICE)
        self.heads = heads
        self.impl = impl
        self.recompute_core = recompute_core
        self.qkv = DelayedWgradLinear(
            hidden, 3 * hidden, delay_wgrad=delay_wgrad, dtype=dtype, device=device
        )
        self.proj = DelayedWgradLinear(
            hidden, hidden, delay_wgrad=delay_wgrad, dtype=dtype, device=device
        )

    def forward(
        self,
        x_BSD: Tensor,
        cos: Tensor,
        sin: Tensor,
        blocked: Tensor | None = None,
        dead: Tensor | None = None,
    ) -> Tensor:
        B, S, D = x_BSD.shape
        H = self.heads
        E = D // H
        qkv = self.qkv(x_BSD).view(B, S, 3, H, E).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        masks = () if blocked is None else (blocked,)
        core = self._core
        ctx_BHSE = (
            recompute(core, q, k, v, *masks) if self.recompute_core else core(q, k, v, *masks)
        )
        if dead is not None:
            ctx_BHSE = ctx_BHSE.masked_fill(dead, 0.0)
        out_BSD = ctx_BHSE.transpose(1, 2).reshape(B, S, D)
        out: Tensor = self.proj(out_BSD)
        return out

    def _core(self, q: Tensor, k: Tensor, v: Tensor, blocked: Tensor | None = None) -> Tensor:
        """softmax(QK^T / sqrt(E)) V per head, causal, or without the ``blocked`` keys."""
        if self.impl == "sdpa":
            if blocked is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=~blocked)
        S, E = q.shape[-2], q.shape[-1]
        scores = q.matmul(k.transpose(-2, -1)) * (1.0 / math.sqrt(E))
        if blocked is None:
            blocked = ~torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(blocked, float("-inf"))
        weights = torch.softmax(scores.float(), dim=-1).to(v.dtype)
        return weights.matmul(v)

    def backward_dw(self) -> None:
        """Delayed weight gradients of the output projection, then of QKV."""
        self.proj.backward_dw()
        self.qkv.backward_dw()


class SwiGLUMLP(nn.Module):
    """``fc2(silu(gate) * up)`` with ``[gate, up] = fc1(x)``: the dense MLP and shared expert.

    A :class:`~moe_overlap.WgradLayer`. ``recompute_activation``: ``silu(gate) * up``
    recomputed in backward.
    """

    def __init__(
        self,
        hidden: int,
        ffn: int,
        *,
        delay_wgrad: bool,
        recompute_activation: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        w = "SwiGLUMLP"
        hidden = check_arg(w, "hidden", hidden, POSITIVE)
        ffn = check_arg(w, "ffn", ffn, POSITIVE)
        delay_wgrad = check_arg(w, "delay_wgrad", delay_wgrad, BOOL)
        recompute_activation = check_arg(w, "recompute_activation", recompute_activation, BOOL)
        dtype = check_arg(w, "dtype", dtype, FLOAT_DTYPE)
        device = check_arg(w, "device", device, OPT_DEVICE)
        self.recompute_activation = recompute_activation
        self.fc1 = DelayedWgradLinear(
            hidden, 2 * ffn, delay_wgrad=delay_wgrad, dtype=dtype, device=device
        )
        self.fc2 = DelayedWgradLinear(
            ffn, hidden, delay_wgrad=delay_wgrad, dtype=dtype, device=device
        )

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x)
        act = recompute(swiglu, h) if self.recompute_activation else swiglu(h)
        out: Tensor = self.fc2(act)
        return out

    def backward_dw(self) -> None:
        """Delayed weight gradients of ``fc2``, then ``fc1``."""
        self.fc2.backward_dw()
        self.fc1.backward_dw()
