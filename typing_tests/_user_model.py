"""The guide's user model (``docs/integrate.md``) with type annotations (shared fixtures).

Type-checked here, run there: ``tests/test_docs.py`` runs the guide's code and checks that
every class of the guide is in this file, identical but for annotations and docstrings, so
change both together. ``check_positive.py`` asserts these satisfy the Protocols;
``check_negative.py`` varies them one member at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import Parameter

from moe_overlap import (
    CudaGraphModule,
    PreprocessOutput,
    SlotContext,
    WgradLayer,
    WgradScope,
)


@dataclass(frozen=True, kw_only=True)
class UserConfig:
    """One frozen config: the model's (``mtp_num_layers``) and the free-input fields."""

    mtp_num_layers: int | None = None
    moe_token_dispatcher_type: str = "alltoall"
    moe_flex_dispatcher_backend: str | None = None
    fp8: str | None = None
    fp4: str | None = None
    cuda_graph_modules: tuple[CudaGraphModule, ...] = ()


class UserLayer(nn.Module):
    """A schedulable MoE layer: attention stand-in, top-1 router, two experts."""

    def __init__(self, config: UserConfig) -> None:
        super().__init__()
        self.config = config
        self.is_moe = True
        self.num_local_experts: int | None = 2
        self.attn = nn.Linear(8, 8, bias=False)
        self.router = nn.Linear(8, 2, bias=False)
        self.expert = nn.ModuleList([nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)])

    def attention(self, x: Tensor) -> Tensor:
        return x + self.attn(x)  # type: ignore[no-any-return]  # a module call is Any

    def route(self, h: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        tokens = h.flatten(0, 1)
        probs, choice = torch.softmax(self.router(tokens), dim=-1).max(dim=-1)
        order = torch.argsort(choice, stable=True)
        return tokens[order], probs[order], order, torch.bincount(choice, minlength=2)

    def experts(self, rows: Tensor, probs: Tensor, counts: Tensor) -> Tensor:
        chunks = torch.split(rows, counts.tolist())  # pyright: ignore[reportUnknownMemberType, reportUnknownArgumentType]
        out = torch.cat([expert(c) for expert, c in zip(self.expert, chunks, strict=True)])
        return out * probs.unsqueeze(-1)

    def unpermute(self, out: Tensor, order: Tensor, residual: Tensor) -> Tensor:
        return residual + torch.zeros_like(out).index_copy(0, order, out).view_as(residual)

    def forward(self, x: Tensor) -> Tensor:
        h = self.attention(x)
        rows, probs, order, counts = self.route(h)
        return self.unpermute(self.experts(rows, probs, counts), order, h)

    def slot_pre_dispatch(
        self, node: SlotContext, inputs: tuple[Tensor, ...], /
    ) -> tuple[Tensor, ...]:
        (x,) = inputs
        h = self.attention(x)
        rows, probs, order, counts = self.route(h)
        node.layer_state.residual = node.detach(h)
        node.layer_state.tokens_per_expert = counts
        node.layer_state.stash("order", order)
        return rows, probs

    def slot_dispatch(self, node: SlotContext, inputs: tuple[Tensor, ...], /) -> Tensor:
        rows, probs = inputs
        node.layer_state.dispatched_probs = node.detach(probs.clone())
        return rows.clone()

    def slot_mlp(self, node: SlotContext, inputs: tuple[Tensor, ...], /) -> Tensor:
        (rows,) = inputs
        state = node.layer_state
        assert state.dispatched_probs is not None
        assert state.tokens_per_expert is not None
        return self.experts(rows.clone(), state.dispatched_probs, state.tokens_per_expert)

    def slot_combine(self, node: SlotContext, inputs: tuple[Tensor, ...], /) -> Tensor:
        state = node.layer_state
        assert state.residual is not None
        return self.unpermute(inputs[0], state.take("order", Tensor), state.residual)

    def pre_dispatch_wgrad(self) -> Sequence[WgradScope]:
        return []

    def mlp_wgrad(self) -> Sequence[WgradLayer]:
        return []


class DelayedMatmul(torch.autograd.Function):
    """``x @ weight.T`` whose weight gradient waits in ``owner.pending``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, owner: DelayedLinear) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.owner = owner
        return x @ weight.t()

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor, None, None]:
        (grad,) = grads
        x, weight = ctx.saved_tensors
        ctx.owner.pending.append((x, grad))
        return grad @ weight, None, None


class DelayedLinear(nn.Linear):
    """A linear layer whose weight gradient is computed in ``backward_dw``."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)  # pyright: ignore[reportUnknownMemberType]
        self.pending: list[tuple[Tensor, Tensor]] = []

    @property
    def pending_wgrad(self) -> int:
        return len(self.pending)

    def forward(self, input: Tensor) -> Tensor:
        return DelayedMatmul.apply(input, self.weight, self)  # type: ignore[no-any-return, no-untyped-call]  # pyright: ignore[reportUnknownMemberType, reportUnknownVariableType]

    def backward_dw(self) -> None:
        for x, grad in self.pending:
            dw = grad.flatten(0, -2).t() @ x.flatten(0, -2)
            self.weight.grad = dw if self.weight.grad is None else self.weight.grad + dw
        self.pending.clear()


class DelayedUserLayer(UserLayer):
    """``UserLayer`` with the weight gradients of its attention and experts delayed."""

    def __init__(self, config: UserConfig) -> None:
        super().__init__(config)
        self.attn = DelayedLinear(8, 8)
        self.expert = nn.ModuleList([DelayedLinear(8, 8), DelayedLinear(8, 8)])

    def pre_dispatch_wgrad(self) -> Sequence[WgradScope]:
        assert isinstance(self.attn, DelayedLinear)
        return [WgradScope(CudaGraphModule.attn, self.attn)]

    def mlp_wgrad(self) -> Sequence[WgradLayer]:
        return [m for m in self.expert if isinstance(m, DelayedLinear)]


class UserDecoder(nn.Module):
    """``decoder``: its layers, the pipeline input and an optional final norm."""

    def __init__(self, layers: Sequence[UserLayer]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.input_tensor: Tensor | None = None
        self.final_layernorm: Callable[[Tensor], Tensor] | None = None


class UserModel(nn.Module):
    """A model with Megatron's hook names; unused ``_postprocess`` keywords in ``**kwargs``."""

    microbatch_inputs = frozenset({"labels"})  # what it reads besides input_ids

    def __init__(self, config: UserConfig, layer: type[UserLayer] = UserLayer) -> None:
        super().__init__()
        self.pre_process = True
        self.post_process = True
        self.config = config
        self.embedding = nn.Embedding(16, 8)
        self.decoder = UserDecoder([layer(config), layer(config)])
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 16, bias=False)

    def _preprocess(
        self,
        input_ids: Tensor | None,
        position_ids: Tensor | None,
        *,
        decoder_input: Tensor | None = None,
        packed_seq_params: object | None = None,
        padding_mask: Tensor | None = None,
    ) -> PreprocessOutput:
        if decoder_input is None:  # the first pipeline stage embeds the tokens
            return PreprocessOutput(self.embedding(input_ids), padding_mask=padding_mask)
        return PreprocessOutput(decoder_input, padding_mask=padding_mask)

    def _postprocess(
        self,
        hidden_states: Tensor,
        input_ids: Tensor | None,
        position_ids: Tensor | None,
        labels: Tensor | None,
        rotary_pos_emb: Tensor | None,
        rotary_pos_cos: Tensor | None,
        rotary_pos_sin: Tensor | None,
        **kwargs: object,
    ) -> Tensor:
        logits = self.head(self.norm(hidden_states))
        assert labels is not None
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())

    def forward(self, input_ids: Tensor, labels: Tensor) -> Tensor:
        h = self._preprocess(input_ids, None).decoder_input
        for layer in self.decoder.layers:
            h = layer(h)
        return self._postprocess(h, input_ids, None, labels, None, None, None)


class ShortUserModel(nn.Module):
    """The shortest spelling: keywords the model ignores are taken by ``**kwargs: object``."""

    def __init__(self, config: UserConfig) -> None:
        super().__init__()
        self.pre_process = True
        self.post_process = True
        self.config = config
        self.decoder = UserDecoder([UserLayer(config)])
        self.embedding = nn.Embedding(16, 8)

    def _preprocess(
        self, input_ids: Tensor | None, position_ids: Tensor | None, **kwargs: object
    ) -> tuple[Tensor, None, None, None, None, None]:
        assert input_ids is not None
        embedded: Tensor = self.embedding(input_ids)
        return (embedded, None, None, None, None, None)

    def _postprocess(self, hidden_states: Tensor, *args: Tensor | None, **kwargs: object) -> Tensor:
        return hidden_states.sum()


class UserWgrad:
    """A ``WgradLayer`` that is not a module: any ``backward_dw`` plus ``parameters``."""

    def __init__(self, weight: Parameter) -> None:
        self.weight = weight

    def backward_dw(self) -> None:
        pass

    def parameters(self) -> Iterator[Parameter]:
        yield self.weight
