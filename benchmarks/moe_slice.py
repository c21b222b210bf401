"""A DeepSeek-V3-like MoE layer slice for one GPU, with a host-loopback all-to-all.

One GPU has no peer, so the expert-parallel all-to-all is emulated (the library's
:class:`~moe_overlap.blocks.HostLoopback`): dispatch and combine move the permuted tokens
device -> pinned host -> device on the stream they run on (the copy engines, no SMs), the
same bytes a rank of an EP all-to-all sends and receives. The rank plays EP rank 0 of ``num_experts // local_experts`` ranks: the rows routed to the
other ranks' experts (``remote_fraction`` of the buffer) go through the host, the local
rows are copied on the device. The rank's own routed rows stand in for the rows the other
ranks would send it, so the local experts see a real EP rank's load.

Dispatch is capacity-padded (Megatron's ``moe_pad_expert_input_to_capacity``): every
shape is fixed, so no slot synchronizes the host with the GPU.

Legend for tensor names: ``S`` tokens of a microbatch (one sequence), ``H`` hidden, ``K``
top-k, ``E`` local experts, ``C`` capacity per local expert, ``P`` slots (``E*C``), ``N``
heads, ``D`` head dim, ``F`` expert FFN size, ``G`` global experts, ``J`` source ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe_overlap import (
    CudaGraphModule,
    Microbatch,
    PreprocessOutput,
    SlotContext,
    WgradLayer,
    WgradScope,
)
from moe_overlap.blocks import (
    GraphedBlock,
    GroupedExperts,
    HostLoopback,
    LoopbackMode,
    MegatronHooks,
    loopback,
    recompute,
    save_matmuls,
)

__all__ = [
    "LoopbackMode",
    "MoESliceLayer",
    "MoESliceModel",
    "SliceConfig",
    "expert_positions",
    "make_microbatches",
]


@dataclass(frozen=True, kw_only=True)
class SliceConfig:
    """Sizes of the slice; also the free-input configuration the schedule reads."""

    hidden: int = 4096
    ffn: int = 2048
    tokens: int = 4096
    num_layers: int = 4
    num_experts: int = 64
    local_experts: int = 8
    top_k: int = 8
    head_dim: int = 128
    capacity_factor: float = 1.0
    chunks: int = 4
    """Pieces a transfer is cut into so device->host and host->device overlap (duplex)."""
    loopback: LoopbackMode = LoopbackMode.HOST
    # FreeInputConfig / model-config fields
    moe_token_dispatcher_type: str = "alltoall"
    moe_flex_dispatcher_backend: str | None = None
    fp8: str | None = None
    fp4: str | None = None
    cuda_graph_modules: tuple[object, ...] = ()
    mtp_num_layers: int | None = None

    @property
    def ep_size(self) -> int:
        return self.num_experts // self.local_experts

    @property
    def remote_fraction(self) -> float:
        """Share of the dispatched rows that leave the rank in a real EP all-to-all."""
        return (self.ep_size - 1) / self.ep_size

    @property
    def capacity(self) -> int:
        """Rows per local expert, a multiple of the number of source ranks."""
        rows = self.tokens * self.top_k / self.local_experts * self.capacity_factor
        j = self.ep_size
        return max(j, math.ceil(rows / j) * j)

    @property
    def slots(self) -> int:
        return self.local_experts * self.capacity

    def a2a_bytes(self, dtype: torch.dtype) -> int:
        """Bytes one dispatch (or combine) sends off-rank."""
        return self.remote_rows() * self.hidden * _itemsize(dtype)

    def remote_rows(self) -> int:
        return round(self.slots * self.remote_fraction)

    def make_loopback(self) -> HostLoopback:
        """The emulated all-to-all: the remote rows through the host, duplex in chunks."""
        return HostLoopback(remote_rows=self.remote_rows(), chunks=self.chunks, mode=self.loopback)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def expert_positions(expert_R: Tensor, num_experts: int) -> Tensor:
    """Position of each routed row among the rows of its expert, in row order.

    The same result as ``one_hot(expert_R).cumsum(0) - 1`` gathered at ``expert_R``, from a
    stable sort instead: a cumulative sum down ``R`` rows of only ``E`` columns ran one slow
    scan kernel (first device round: 96 ms of 791). Deterministic (no atomics).
    """
    sorted_R, order_R = torch.sort(expert_R, stable=True)
    arange = torch.arange(num_experts, dtype=sorted_R.dtype, device=sorted_R.device)
    start_E = torch.searchsorted(sorted_R, arange)
    rank_R = torch.arange(sorted_R.numel(), device=sorted_R.device)
    pos_sorted_R = rank_R - start_E.index_select(0, sorted_R)
    return torch.empty_like(pos_sorted_R).scatter_(0, order_R, pos_sorted_R)


def _param(*shape: int, scale: float, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(_randn(shape, scale, dtype, device))


def _randn(shape: Sequence[int], scale: float, dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.randn(*shape, dtype=torch.float32, device=device).mul_(scale).to(dtype)


class MoESliceLayer(nn.Module):
    """Attention (QKV, SDPA, out projection) + top-k router + capacity-padded local experts.

    Implements :class:`moe_overlap.SchedulableLayer`. The routed experts are the library's
    :class:`~moe_overlap.blocks.GroupedExperts` on capacity-padded rows (one batched GEMM
    each); their weight gradients are delayed (``mlp_wgrad``) while
    :meth:`MoESliceModel.set_delay_wgrad` says so; attention's never are.
    """

    def __init__(
        self, config: SliceConfig, mover: HostLoopback, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        h, f, e = config.hidden, config.ffn, config.local_experts
        self.cfg = config
        self.loopback = mover
        self.norm1 = nn.Parameter(torch.ones(h, dtype=dtype, device=device))
        self.norm2 = nn.Parameter(torch.ones(h, dtype=dtype, device=device))
        self.qkv = _param(3 * h, h, scale=h**-0.5, dtype=dtype, device=device)
        self.proj = _param(h, h, scale=h**-0.5, dtype=dtype, device=device)
        self.router = _param(config.num_experts, h, scale=h**-0.5, dtype=dtype, device=device)
        self.experts = GroupedExperts(
            e, h, f, expert_offset=0, delay_wgrad=False, dtype=dtype, device=device
        )
        with torch.no_grad():
            self.experts.fc1.weight.copy_(_randn((e, 2 * f, h), h**-0.5, dtype, device))
            self.experts.fc2.weight.copy_(_randn((e, h, f), f**-0.5, dtype, device))
        # Opt-in recompute (MoESliceModel.set_recompute): attention selectively (matrix
        # products kept), the routed experts whole (only their input kept).
        self.recompute = False
        # Opt-in CUDA graphs of the static-shape parts (MoESliceModel.set_graphs).
        self.use_graphs = False
        self.attn_graph = GraphedBlock(
            self._attn_block, [self], CudaGraphModule.attn, label="MoESliceLayer attention"
        )
        self.graph_router = False
        self.router_graph = GraphedBlock(
            self._router_block, [self], CudaGraphModule.moe_router, label="MoESliceLayer router"
        )

    @property
    def delay_wgrad(self) -> bool:
        return self.experts.fc1.delay_wgrad

    def set_delay_wgrad(self, delay: bool) -> None:
        self.experts.fc1.delay_wgrad = self.experts.fc2.delay_wgrad = delay

    # --- SchedulableLayer members -----------------------------------------------------------
    @property
    def config(self) -> SliceConfig:
        return self.cfg

    @property
    def is_moe(self) -> bool:
        return True

    @property
    def num_local_experts(self) -> int | None:
        return self.cfg.local_experts

    def pre_dispatch_wgrad(self) -> Sequence[WgradScope]:
        return []

    def mlp_wgrad(self) -> Sequence[WgradLayer]:
        # Listed only while delaying: the layer is what tells the schedule to run wgrad.
        return [self.experts] if self.delay_wgrad else []

    def slot_pre_dispatch(
        self, node: SlotContext, inputs: tuple[Tensor, ...], /
    ) -> Tensor | tuple[Tensor, ...]:
        (x_SH,) = inputs
        if self.use_graphs:
            (a_SH,) = self.attn_graph(x_SH)
            route = self.router_graph if self.graph_router else self._router_block
            t_SH, top_SK, idx_SK = route(a_SH)
        elif self.recompute:
            a_SH = recompute(self._attn_block, x_SH, policy=save_matmuls)
            t_SH, top_SK, idx_SK = self._router_block(a_SH)
        else:
            a_SH = self._attn_block(x_SH)
            t_SH, top_SK, idx_SK = self._router_block(a_SH)
        rows_PH, probs_P, token_of_slot_P = self._route(t_SH, top_SK, idx_SK)
        node.layer_state.residual = node.detach(a_SH)
        node.layer_state.dispatched_probs = node.detach(probs_P)
        node.layer_state.stash("token_of_slot", token_of_slot_P)
        return rows_PH

    def slot_dispatch(
        self, node: SlotContext, inputs: tuple[Tensor, ...], /
    ) -> Tensor | tuple[Tensor, ...]:
        (rows_PH,) = inputs
        return loopback(rows_PH, self.loopback)

    def slot_mlp(
        self, node: SlotContext, inputs: tuple[Tensor, ...], /
    ) -> Tensor | tuple[Tensor, ...]:
        (recv_PH,) = inputs
        cfg = self.cfg
        e, c, h, j = cfg.local_experts, cfg.capacity, cfg.hidden, cfg.ep_size
        # The all-to-all delivers rows source-rank-major; sort them expert-major (a fresh
        # buffer, as Megatron's sort_chunks_by_idxs makes, so the input can be freed).
        x_ECH = recv_PH.view(j, e, c // j, h).transpose(0, 1).reshape(e, c, h)
        # padded: every expert has C rows
        y_ECH: Tensor = (
            recompute(self.experts, x_ECH, ()) if self.recompute else self.experts(x_ECH, ())
        )
        return y_ECH.view(e, j, c // j, h).transpose(0, 1).reshape(e * c, h)

    def slot_combine(
        self, node: SlotContext, inputs: tuple[Tensor, ...], /
    ) -> Tensor | tuple[Tensor, ...]:
        (y_PH,) = inputs
        state = node.layer_state
        residual_SH, probs_P = state.residual, state.dispatched_probs
        assert residual_SH is not None
        assert probs_P is not None
        token_of_slot_P = state.take("token_of_slot", Tensor)
        back_PH = loopback(y_PH, self.loopback)
        weighted_PH = back_PH * probs_P.unsqueeze(-1).to(back_PH.dtype)
        s, h = residual_SH.shape
        out_SH = residual_SH.new_zeros(s + 1, h).index_add(0, token_of_slot_P, weighted_PH)
        state.residual = None
        state.dispatched_probs = None
        return residual_SH + out_SH[:s]

    # --- the math -------------------------------------------------------------------------
    def _attn_block(self, x_SH: Tensor) -> Tensor:
        return x_SH + self.attention(x_SH)

    def _router_block(self, a_SH: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The normed rows, the top-k gate probabilities and experts."""
        t_SH = F.rms_norm(a_SH, (a_SH.shape[-1],), self.norm2)
        probs_SG = torch.softmax(F.linear(t_SH, self.router).float(), dim=-1)
        top_SK, idx_SK = torch.topk(probs_SG, self.cfg.top_k, dim=-1)
        return t_SH, top_SK, idx_SK

    def attention(self, x_SH: Tensor) -> Tensor:
        """RMS norm, QKV, causal SDPA, out projection (no residual)."""
        s, h = x_SH.shape
        n, d = h // self.cfg.head_dim, self.cfg.head_dim
        t_SH = F.rms_norm(x_SH, (h,), self.norm1)
        # 4-D [batch=1, heads, seq, dim] views with a unit-stride last dim: the layout the
        # fused (flash / memory-efficient) SDPA kernels take. 3-D inputs made PyTorch fall
        # back to its fp32 math path (first device round: 252 of 791 ms).
        qkv_3BNSD = F.linear(t_SH, self.qkv).view(1, s, 3, n, d).permute(2, 0, 3, 1, 4)
        o_BNSD = F.scaled_dot_product_attention(
            qkv_3BNSD[0], qkv_3BNSD[1], qkv_3BNSD[2], is_causal=True
        )
        return F.linear(o_BNSD.transpose(1, 2).reshape(s, h), self.proj)

    def _route(self, t_SH: Tensor, top_SK: Tensor, idx_SK: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Rows in dispatch order, their gate probabilities, and the token of each slot.

        Slot of the ``p``-th row for local expert ``e``: ``[p // (C/J), e, p % (C/J)]`` in a
        ``[J, E, C/J]`` buffer (source-rank-major, as an all-to-all receives it). Rows past
        an expert's capacity are dropped; empty slots read a zero row (token ``S``).
        """
        cfg = self.cfg
        s, h = t_SH.shape
        e, c, k, j = cfg.local_experts, cfg.capacity, cfg.top_k, cfg.ep_size
        cj = c // j
        expert_R = (idx_SK % e).reshape(-1)  # R = S*K routed rows
        pos_R = expert_positions(expert_R, e)
        slot_R = (pos_R // cj) * (e * cj) + expert_R * cj + pos_R % cj
        slot_R = torch.where(pos_R < c, slot_R, torch.full_like(slot_R, e * c))
        n_rows = s * k
        row_of_slot = torch.full((e * c + 1,), n_rows, dtype=torch.long, device=t_SH.device)
        row_of_slot.scatter_(0, slot_R, torch.arange(n_rows, device=t_SH.device))
        row_of_slot_P = row_of_slot[: e * c]
        token_of_slot_P = row_of_slot_P // k
        tokens_SH = torch.cat([t_SH, t_SH.new_zeros(1, h)])
        probs_R = torch.cat([top_SK.reshape(-1), top_SK.new_zeros(1)])
        return (
            tokens_SH.index_select(0, token_of_slot_P),
            probs_R.index_select(0, row_of_slot_P),
            token_of_slot_P,
        )


class SliceDecoder(nn.Module):
    """The decoder block the schedule reads: layers, pipeline input, no final norm."""

    def __init__(self, layers: Sequence[MoESliceLayer]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.input_tensor: Tensor | None = None
        self.final_layernorm: Callable[[Tensor], Tensor] | None = None


class MoESliceModel(MegatronHooks, nn.Module):
    """``num_layers`` MoE slice layers between a scaling 'embedding' and a square loss.

    Implements :class:`moe_overlap.PreprocessableModel`. The microbatch's
    ``decoder_input`` stands in for embedded tokens.
    """

    def __init__(
        self, config: SliceConfig, *, dtype: torch.dtype, device: torch.device, seed: int = 0
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)  # pyright: ignore[reportUnknownMemberType] - unannotated
        self.config = config
        self.pre_process = True
        self.post_process = True
        self.loopback = config.make_loopback()
        self.embed_scale = nn.Parameter(torch.ones(config.hidden, dtype=dtype, device=device))
        layers = [
            MoESliceLayer(config, self.loopback, dtype, device) for _ in range(config.num_layers)
        ]
        self.decoder = SliceDecoder(layers)

    def set_loopback(self, mode: LoopbackMode) -> None:
        self.loopback.mode = mode

    def set_graphs(self, on: bool, *, router: bool = False) -> None:
        """Run each layer's attention (and, with ``router``, its norm and router) as CUDA
        graphs (on) or eagerly (off)."""
        for layer in self.decoder.layers:
            assert isinstance(layer, MoESliceLayer)
            layer.use_graphs = on
            layer.graph_router = router

    def graph_captures(self) -> int:
        """How many graph copies the layers have captured so far."""
        layers = [m for m in self.decoder.layers if isinstance(m, MoESliceLayer)]
        return sum(g.stats.captures for m in layers for g in (m.attn_graph, m.router_graph))

    def drop_graphs(self) -> None:
        """Free the captured graphs' memory (the next graphed step captures again)."""
        for layer in self.decoder.layers:
            assert isinstance(layer, MoESliceLayer)
            layer.attn_graph.reset()
            layer.router_graph.reset()

    def set_recompute(self, on: bool) -> None:
        """Recompute each layer's attention (selectively) and routed experts in backward."""
        for layer in self.decoder.layers:
            assert isinstance(layer, MoESliceLayer)
            if on and (layer.use_graphs or layer.delay_wgrad):
                raise ValueError("MoESliceModel.set_recompute: not with graphs or delayed wgrad")
            layer.recompute = on

    def set_delay_wgrad(self, delay: bool) -> None:
        """Delay the experts' weight gradients (match ``ScheduleOptions.delay_wgrad_compute``)."""
        for layer in self.decoder.layers:
            assert isinstance(layer, MoESliceLayer)
            layer.set_delay_wgrad(delay)

    def _preprocess(
        self,
        input_ids: Tensor | None,
        position_ids: Tensor | None,
        *,
        decoder_input: Tensor | None = None,
        packed_seq_params: object | None = None,
        padding_mask: Tensor | None = None,
    ) -> PreprocessOutput:
        assert decoder_input is not None, "MoESliceModel takes decoder_input"
        return PreprocessOutput(decoder_input * self.embed_scale, None, None, None, None, None)

    def output(
        self, hidden_states: Tensor, labels: Tensor | None, loss_mask: Tensor | None
    ) -> Tensor:
        """The loss: mean square of the last hidden states (no labels needed)."""
        del labels, loss_mask
        return hidden_states.float().square().mean()


def make_microbatches(
    n: int, config: SliceConfig, *, dtype: torch.dtype, device: torch.device, seed: int = 1
) -> list[Microbatch]:
    """``n`` microbatches of random hidden states ``[tokens, hidden]`` (never zeros)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [
        Microbatch(
            decoder_input=torch.randn(config.tokens, config.hidden, generator=g).to(
                device=device, dtype=dtype
            )
        )
        for _ in range(n)
    ]
