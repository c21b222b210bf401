"""A small model written for the engine tests, through the public Protocols only.

Legend for tensor names: ``B`` batch, ``S`` sequence, ``H`` hidden, ``T`` tokens (B*S),
``K`` top-k, ``E`` experts, ``R`` routed rows (T*K), ``V`` vocabulary.

Every layer has a plain path (``forward``) and slot functions that compute the same
operations in the same order, so the schedule's results can be compared bit for bit with
plain ``loss.backward()``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe_overlap import (
    CudaGraphModule,
    Microbatch,
    PreprocessOutput,
    SlotContext,
    WgradError,
    WgradLayer,
    WgradScope,
)


@dataclass(frozen=True, kw_only=True)
class ToyConfig:
    """Layer config; also the free-input config the engine reads."""

    hidden: int = 16
    vocab: int = 32
    num_experts: int = 4
    top_k: int = 2
    shared_expert: bool = False
    moe_token_dispatcher_type: str = "alltoall"
    moe_flex_dispatcher_backend: str | None = None
    fp8: str | None = None
    fp4: str | None = None
    cuda_graph_modules: tuple[CudaGraphModule, ...] = ()
    mtp_num_layers: int | None = None


class _LinearFn(torch.autograd.Function):
    """y = x W^T; the weight grad is computed now or kept for ``backward_dw``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, owner: object) -> Tensor:
        ctx.save_for_backward(x, w)
        ctx.owner = owner
        return x @ w.t()

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Tensor) -> tuple[Tensor, Tensor | None, None]:
        (g,) = grad_outputs
        x, w = ctx.saved_tensors
        owner = ctx.owner
        assert isinstance(owner, DelayedLinear)
        gx = g @ w
        if owner.delay:
            owner.pending.append((x, g))
            return gx, None, None
        return gx, wgrad(x, g), None


def wgrad(x: Tensor, g: Tensor) -> Tensor:
    """The weight gradient, one expression for the immediate and the delayed path."""
    return g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1])


class DelayedLinear(nn.Module):
    """A bias-free linear layer whose weight gradient can be delayed (a WgradLayer)."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in) / n_in**0.5)
        self.delay = False
        self.pending: list[tuple[Tensor, Tensor]] = []

    @property
    def pending_wgrad(self) -> int:
        return len(self.pending)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = _LinearFn.apply(x, self.weight, self)  # type: ignore[no-untyped-call]
        return out

    def backward_dw(self) -> None:
        if not self.pending:
            raise WgradError("DelayedLinear.backward_dw: no pending weight gradient")
        for x, g in self.pending:
            dw = wgrad(x, g)
            if self.weight.grad is None:
                self.weight.grad = dw
            else:
                self.weight.grad += dw
        self.pending.clear()


class WgradGroup(nn.Module):
    """Several delayed linears behind one ``backward_dw`` (a WgradLayer)."""

    def __init__(self, linears: Sequence[DelayedLinear]) -> None:
        super().__init__()
        self.linears = nn.ModuleList(linears)

    def backward_dw(self) -> None:
        for lin in self.linears:
            assert isinstance(lin, DelayedLinear)
            lin.backward_dw()


def rms_norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


@dataclass(frozen=True)
class Route:
    """Routing metadata handed from pre-dispatch to combine."""

    token_of_row_R: Tensor
    counts_E: list[int] = field(default_factory=list[int])


class ToyLayer(nn.Module):
    """A dense or MoE layer; implements SchedulableLayer."""

    def __init__(self, config: ToyConfig, *, moe: bool) -> None:
        super().__init__()
        h = config.hidden
        self.config = config
        self.is_moe = moe
        self.num_local_experts: int | None = config.num_experts if moe else None
        self.delay = False  # the wgrad lists below are empty unless set_delay(True)
        self.attn = DelayedLinear(h, h)
        if moe:
            self.router = nn.Linear(h, config.num_experts, bias=False)
            ups = [DelayedLinear(h, 2 * h) for _ in range(config.num_experts)]
            downs = [DelayedLinear(2 * h, h) for _ in range(config.num_experts)]
            self.up = nn.ModuleList(ups)
            self.down = nn.ModuleList(downs)
            self.experts = WgradGroup([*ups, *downs])
            self.shared = DelayedLinear(h, h) if config.shared_expert else None
        else:
            self.fc1 = DelayedLinear(h, 2 * h)
            self.fc2 = DelayedLinear(2 * h, h)
            self.dense_mlp = WgradGroup([self.fc1, self.fc2])

    def set_delay(self, delay: bool) -> None:
        self.delay = delay
        for m in self.modules():
            if isinstance(m, DelayedLinear):
                m.delay = delay

    # --- the math, shared by the plain path and the slots -------------------------------
    def _attention(self, x_BSH: Tensor, rot_SH: Tensor | None) -> Tensor:
        y = self.attn(rms_norm(x_BSH))
        if rot_SH is not None:
            y = y * (1.0 + 0.1 * rot_SH)
        return x_BSH + torch.tanh(y)

    def _route(self, a_BSH: Tensor) -> tuple[Tensor, Tensor, Route, Tensor | None]:
        tokens_TH = rms_norm(a_BSH).reshape(-1, a_BSH.shape[-1])
        probs_TE = torch.softmax(self.router(tokens_TH), dim=-1)
        top_TK, idx_TK = torch.topk(probs_TE, self.config.top_k, dim=-1)
        order_R = torch.argsort(idx_TK.reshape(-1), stable=True)
        token_of_row_R = order_R // self.config.top_k
        counts = torch.bincount(idx_TK.reshape(-1), minlength=self.config.num_experts)
        rows_RH = tokens_TH.index_select(0, token_of_row_R)
        probs_R = top_TK.reshape(-1).index_select(0, order_R)
        shared = self.shared(tokens_TH) if self.shared is not None else None
        return rows_RH, probs_R, Route(token_of_row_R, counts.tolist()), shared

    @staticmethod
    def _dispatch(rows_RH: Tensor) -> Tensor:
        return rows_RH.clone()  # the all-to-all's receive buffer (EP=1)

    def _experts(self, rows_RH: Tensor, probs_R: Tensor, route: Route) -> Tensor:
        local_RH = rows_RH.index_select(
            0, torch.arange(rows_RH.shape[0], device=rows_RH.device)
        )  # local sort
        outs: list[Tensor] = []
        start = 0
        for e, n in enumerate(route.counts_E):
            chunk = local_RH[start : start + n]
            outs.append(self.down[e](F.silu(self.up[e](chunk))))
            start += n
        return torch.cat(outs) * probs_R.unsqueeze(-1)

    @staticmethod
    def _combine(
        y_RH: Tensor, route: Route, residual_BSH: Tensor, shared_TH: Tensor | None
    ) -> Tensor:
        out_TH = torch.zeros(
            residual_BSH.shape[0] * residual_BSH.shape[1],
            y_RH.shape[-1],
            dtype=y_RH.dtype,
            device=y_RH.device,
        ).index_add(0, route.token_of_row_R, y_RH)
        if shared_TH is not None:
            out_TH = out_TH + shared_TH
        return residual_BSH + out_TH.reshape(residual_BSH.shape)

    def _dense_mlp(self, a_BSH: Tensor) -> Tensor:
        y: Tensor = self.fc2(F.silu(self.fc1(rms_norm(a_BSH))))
        return a_BSH + y

    def forward(self, x_BSH: Tensor, rot_SH: Tensor | None) -> Tensor:
        a = self._attention(x_BSH, rot_SH)
        if not self.is_moe:
            return self._dense_mlp(a)
        rows, probs, route, shared = self._route(a)
        y = self._experts(self._dispatch(rows), probs.clone(), route)
        return self._combine(y, route, a, shared)

    # --- SchedulableLayer -----------------------------------------------------------------
    def slot_pre_dispatch(
        self, node: SlotContext, inputs: tuple[Tensor, ...], /
    ) -> Tensor | tuple[Tensor, ...]:
        (x,) = inputs
        a = self._attention(x, node.chunk_state.rotary_pos_emb)
        if not self.is_moe:
            return a
        rows, probs, route, shared = self._route(a)
        node.layer_state.residual = node.detach(a)
        if shared is not None:
            node.layer_state.shared_expert_output = node.detach(shared)
        node.layer_state.stash("route", route)
        return rows, probs

    def slot_dispatch(
        self, node: SlotContext, inputs: tuple[Tensor, ...], /
    ) -> Tensor | tuple[Tensor, ...]:
        rows, probs = inputs
        node.layer_state.dispatched_probs = node.detach(probs.clone())
        return self._dispatch(rows)

    def slot_mlp(
        self, node: SlotContext, inputs: tuple[Tensor, ...], /
    ) -> Tensor | tuple[Tensor, ...]:
        (x,) = inputs
        if not self.is_moe:
            return self._dense_mlp(x)
        probs = node.layer_state.dispatched_probs
        assert probs is not None
        return self._experts(x, probs, node.layer_state.take("route", Route))

    def slot_combine(
        self, node: SlotContext, inputs: tuple[Tensor, ...], /
    ) -> Tensor | tuple[Tensor, ...]:
        (y,) = inputs
        state = node.layer_state
        assert state.residual is not None
        out = self._combine(
            y, state.take("route", Route), state.residual, state.shared_expert_output
        )
        state.residual = None
        state.shared_expert_output = None
        return out

    def pre_dispatch_wgrad(self) -> Sequence[WgradScope]:
        if not self.delay:
            return []
        parts = [WgradScope(CudaGraphModule.attn, self.attn)]
        if self.is_moe and self.shared is not None:
            parts.append(WgradScope(CudaGraphModule.moe_router, self.shared))
        return parts

    def mlp_wgrad(self) -> Sequence[WgradLayer]:
        if not self.delay:
            return []
        return [self.experts] if self.is_moe else [self.dense_mlp]


class ToyMtpLayer(ToyLayer):
    """A dense layer with an MTP post-process slot (a projection of its output)."""

    def __init__(self, config: ToyConfig) -> None:
        super().__init__(config, moe=False)
        self.mtp_proj = DelayedLinear(config.hidden, config.hidden)

    def forward(self, x_BSH: Tensor, rot_SH: Tensor | None) -> Tensor:
        return self._mtp(super().forward(x_BSH, rot_SH))

    def _mtp(self, h: Tensor) -> Tensor:
        y: Tensor = self.mtp_proj(h)
        return h + 0.5 * y

    def pre_dispatch_wgrad(self) -> Sequence[WgradScope]:
        # As Megatron-Core adds the MTP projection to the pre-dispatch wgrad list.
        if not self.delay:
            return []
        return [*super().pre_dispatch_wgrad(), WgradScope(CudaGraphModule.attn, self.mtp_proj)]

    def slot_mtp_post_process(
        self, node: SlotContext, inputs: tuple[Tensor, ...], /
    ) -> Tensor | tuple[Tensor, ...]:
        (h,) = inputs
        return self._mtp(h)


class ToyDecoder(nn.Module):
    def __init__(self, layers: Sequence[ToyLayer]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.input_tensor: Tensor | None = None
        self.final_layernorm: Callable[[Tensor], Tensor] | None = None


class ToyModel(nn.Module):
    """Embedding, layers, output layer, cross-entropy; a PreprocessableModel."""

    def __init__(self, config: ToyConfig, kinds: str, *, seed: int = 0) -> None:
        """``kinds``: one letter per layer, ``d`` dense, ``m`` MoE, ``t`` MTP-style."""
        super().__init__()
        torch.manual_seed(seed)
        self.config = config
        self.pre_process = True
        self.post_process = True
        self.embedding = nn.Embedding(config.vocab, config.hidden)
        layers: list[ToyLayer] = []
        for k in kinds:
            if k == "t":
                layers.append(ToyMtpLayer(config))
            else:
                layers.append(ToyLayer(config, moe=k == "m"))
        self.decoder = ToyDecoder(layers)
        self.output = nn.Linear(config.hidden, config.vocab, bias=False)
        self.freq = 0.37

    def set_delay(self, delay: bool) -> None:
        for layer in self.decoder.layers:
            assert isinstance(layer, ToyLayer)
            layer.set_delay(delay)

    def _rotary(self, position_ids: Tensor | None) -> Tensor | None:
        if position_ids is None:
            return None
        h = self.config.hidden
        freqs = torch.arange(1, h + 1, device=position_ids.device) * self.freq
        rot = torch.sin(position_ids[0].float().unsqueeze(-1) * freqs)
        return rot.to(self.embedding.weight.dtype)

    def _preprocess(
        self,
        input_ids: Tensor | None,
        position_ids: Tensor | None,
        *,
        decoder_input: Tensor | None = None,
        packed_seq_params: object | None = None,
        padding_mask: Tensor | None = None,
    ) -> tuple[object, ...]:
        if decoder_input is None:
            assert input_ids is not None
            decoder_input = self.embedding(input_ids)
        assert decoder_input is not None
        return PreprocessOutput(decoder_input, self._rotary(position_ids), None, None, None, None)

    def _postprocess(
        self,
        hidden_states: Tensor,
        input_ids: Tensor | None,
        position_ids: Tensor | None,
        labels: Tensor | None,
        rotary_pos_emb: Tensor | None,
        rotary_pos_cos: Tensor | None,
        rotary_pos_sin: Tensor | None,
        *,
        mtp_in_postprocess: bool | None = None,
        loss_mask: Tensor | None = None,
        decoder_input: Tensor | None = None,
        attention_mask: Tensor | None = None,
        packed_seq_params: object | None = None,
        sequence_len_offset: Tensor | int | None = None,
        runtime_gather_output: bool | None = None,
        extra_block_kwargs: Mapping[str, object] | None = None,
        output_processor: Callable[..., object] | None = None,
        output_processor_context: object | None = None,
    ) -> Tensor:
        logits: Tensor = self.output(rms_norm(hidden_states))
        if labels is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

    def forward(self, mb: Microbatch) -> Tensor:
        """The plain path: same operations, one autograd graph."""
        out = self._preprocess(mb.input_ids, mb.position_ids)
        h = out[0]
        assert isinstance(h, Tensor)
        rot = self._rotary(mb.position_ids)
        for layer in self.decoder.layers:
            assert isinstance(layer, ToyLayer)
            h = layer(h, rot)
        norm = self.decoder.final_layernorm  # where Megatron-Core's decoder applies it
        if norm is not None:
            h = norm(h)
        return self._postprocess(h, mb.input_ids, mb.position_ids, mb.labels, rot, None, None)

    @property
    def pending_wgrad(self) -> int:
        """Weight gradients the model's delayed linears still owe (a PendingWgrad)."""
        return sum(len(m.pending) for m in self.modules() if isinstance(m, DelayedLinear))


def make_microbatches(
    n: int, config: ToyConfig, *, batch: int = 2, seq: int = 8, seed: int = 1
) -> list[Microbatch]:
    g = torch.Generator().manual_seed(seed)
    out: list[Microbatch] = []
    for _ in range(n):
        ids = torch.randint(0, config.vocab, (batch, seq), generator=g)
        labels = torch.randint(0, config.vocab, (batch, seq), generator=g)
        pos = torch.arange(seq).unsqueeze(0).expand(batch, seq)
        out.append(Microbatch(input_ids=ids, position_ids=pos, labels=labels))
    return out


def plain_step(model: ToyModel, mbs: Sequence[Microbatch]) -> list[Tensor]:
    """Reference: ``loss.backward()`` per microbatch, in order."""
    losses = []
    for mb in mbs:
        loss = model(mb)
        loss.backward()
        losses.append(loss.detach())
    return losses


def grads(model: nn.Module) -> dict[str, Tensor | None]:
    return {
        n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()
    }


def params(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    return iter(model.named_parameters())
