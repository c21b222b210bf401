"""The reference GPT-style MoE model: a :class:`~moe_overlap.PreprocessableModel`.

Legend: ``B`` batch, ``S`` sequence, ``D`` hidden, ``V`` vocabulary, ``T = B*S``.

The final norm is applied in ``_postprocess`` (``decoder.final_layernorm`` is ``None``), so
the last layer needs no special case. The output layer is *not* tied to the embedding: a
tied weight would receive two gradient contributions per microbatch (output layer in
post-process, embedding in pre-process) whose accumulation order into ``.grad`` differs
between the plain backward (one graph: output-layer grad first) and the schedule (the two
halves run in separate backward calls interleaved with another microbatch), and float
addition is not associative across microbatches. Tying them anyway is refused:
:func:`~moe_overlap.combined_1f1b` raises when it returns.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from moe_overlap import ChunkState, ConfigError
from moe_overlap.args import (
    GROUP,
    OPT_DEVICE,
    TENSOR,
    Instance,
    Items,
    Opt,
    Real,
    check_arg,
)
from moe_overlap.blocks import (
    DelayedWgradModule,
    GraphedBlock,
    GroupedExperts,
    MegatronHooks,
    RMSNorm,
    Rotary,
    StageLayers,
    TokenDispatcher,
    TopKRouter,
    check_masks,
    rotary_tables,
)
from moe_overlap.engine import check_wgrad_done
from moe_overlap.models._config import GPTMoEConfig
from moe_overlap.models._layers import DenseLayer, GPTLayer, MoELayer

__all__ = [
    "REFERENCE_INPUTS",
    "Decoder",
    "GPTMoEModel",
    "check_reference_inputs",
    "masked_cross_entropy",
]


REFERENCE_INPUTS = ("position_ids", "attention_mask", "labels", "loss_mask", "padding_mask")
"""What the reference model (and its pipeline stages) read of a microbatch."""


_CONFIG = Instance(GPTMoEConfig, "a GPTMoEConfig")
_GROUP = Opt(GROUP)
_LAYERS: Items[GPTLayer] = Items(
    Instance[GPTLayer]((DenseLayer, MoELayer), "a DenseLayer or MoELayer"), ordered=True
)


class Decoder(nn.Module):
    """The layer stack as the schedule sees it (``layers``, ``input_tensor``, final norm).

    ``layers`` is a :class:`~moe_overlap.blocks.StageLayers` named from ``start``, the
    global index of the first layer (a pipeline stage's ``layers.start``).
    """

    def __init__(self, layers: Iterable[GPTLayer], *, start: int = 0) -> None:
        super().__init__()
        layers = list(check_arg("Decoder", "layers", layers, _LAYERS))
        self.layers = StageLayers(layers, start=start)
        self.input_tensor: Tensor | None = None
        self.final_layernorm: Callable[[Tensor], Tensor] | None = None


class GPTMoEModel(MegatronHooks, nn.Module):
    """A small GPT with dense and MoE layers, schedulable by :func:`~moe_overlap.combined_1f1b`.

    ``forward`` is the plain path (no schedule) computing the same operations, so
    ``model(...).backward()`` per microbatch and the schedule give bit-identical losses
    and gradients. ``ep_group`` shards the experts over its ranks (``None``: all local;
    ``count_group``, the same ranks, carries the dispatch's count exchange, see
    :class:`~moe_overlap.blocks.TokenDispatcher`);
    non-expert parameters are replicated and initialised identically on every rank, and
    global expert ``x`` gets the same initial weights whatever the EP size.

    Inputs (``microbatch_inputs``; anything else a :class:`~moe_overlap.Microbatch` sets is
    refused when the plan is built): ``position_ids``, ``labels``, ``loss_mask``, and the
    masks by Megatron-Core's conventions, checked by :meth:`validate_inputs`: an
    ``attention_mask`` bool ``[B or 1, 1, S or 1, S]`` (``True``: not attended) on top of
    the causal mask, a ``padding_mask`` bool ``[B, S]`` (``True``: padding) whose tokens no
    query attends and the router's aux loss leaves out (they are still routed; the loss
    leaves them out through ``loss_mask``, which is then required). A query with no key
    left gets a zero attention output. See the building blocks' page, "Attention and
    padding masks".
    """

    def __init__(
        self,
        config: GPTMoEConfig,
        *,
        ep_group: dist.ProcessGroup | None = None,
        count_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        w = "GPTMoEModel"
        check_arg(w, "config", config, _CONFIG)
        check_arg(w, "ep_group", ep_group, _GROUP)
        check_arg(w, "count_group", count_group, _GROUP)
        dev = check_arg(w, "device", device, OPT_DEVICE)
        c = config
        self.config = config
        self.dispatcher = TokenDispatcher(
            c.num_experts,
            c.moe_router_topk,
            kind=c.dispatcher,
            group=ep_group,
            count_group=count_group,
            chunks=c.moe_a2a_chunks,
        )
        self.embedding = nn.Embedding(c.vocab_size, c.hidden_size, dtype=c.dtype, device=dev)
        layers: list[GPTLayer] = [
            MoELayer(c, i, self.dispatcher, dev) if c.is_moe_layer(i) else DenseLayer(c, i, dev)
            for i in range(c.num_layers)
        ]
        self.decoder = Decoder(layers)
        self.final_norm = RMSNorm(
            c.hidden_size,
            eps=c.norm_eps,
            recompute="norm" in c.recompute,
            dtype=c.dtype,
            device=dev,
        )
        self.output_layer = nn.Linear(
            c.hidden_size, c.vocab_size, bias=False, dtype=c.dtype, device=dev
        )
        # torch leaves named_modules() unannotated.
        named = cast("Iterator[tuple[str, nn.Module]]", self.named_modules())
        for name, module in named:
            if isinstance(module, DelayedWgradModule):
                module.label = name
        self.reset_parameters()

    @property
    def layer_list(self) -> tuple[GPTLayer, ...]:
        """The layers now (``decoder.layers``: a layer added, removed or replaced after
        construction is the model's, and the schedule's, from the next step on)."""
        return cast("tuple[GPTLayer, ...]", tuple(self.decoder.layers))

    @property
    def pre_process(self) -> bool:
        return True

    @property
    def post_process(self) -> bool:
        return True

    def reset_parameters(self) -> None:
        """Seeded init, identical on every EP rank; norms start at one.

        Expert weights are drawn for all global experts and sliced, so a model sharded
        over ``P`` ranks holds exactly the experts of the unsharded one.
        """
        gen = torch.Generator().manual_seed(self.config.seed)
        std = self.config.init_std
        offset, local = self.dispatcher.expert_offset, self.dispatcher.local_experts
        global_experts = self.config.num_experts
        expert_params = {
            id(p) for m in self.modules() if isinstance(m, GroupedExperts) for p in m.parameters()
        }
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                    continue
                if id(p) in expert_params:
                    full = torch.randn((global_experts, *p.shape[1:]), generator=gen) * std
                    p.copy_(full[offset : offset + local])
                    continue
                p.copy_(torch.randn(p.shape, generator=gen) * std)

    def set_aux_loss_scale(self, scale: float) -> None:
        """Scale the load-balancing loss's gradient like the language-model loss.

        Pass the ``loss_scale`` given to :func:`~moe_overlap.combined_1f1b` (or applied to
        the plain loss), so the auxiliary loss keeps its weight relative to it.
        """
        scale = check_arg("GPTMoEModel.set_aux_loss_scale", "scale", scale, Real())
        for module in self.modules():
            if isinstance(module, TopKRouter):
                module.aux_loss_scale = scale

    def graphed_blocks(self) -> list[GraphedBlock]:
        """Every CUDA-graphed part of the layers (``config.cuda_graph_modules``)."""
        return [block for layer in self.layer_list for block in layer.graphed_blocks()]

    def reset_graphs(self) -> None:
        """Drop the captured CUDA graphs (after moving or re-sharding the parameters); the
        next step captures again."""
        for block in self.graphed_blocks():
            block.reset()

    def embed(self, input_ids: Tensor) -> Tensor:
        """The token embedding."""
        return cast(Tensor, self.embedding(input_ids))

    def on_microbatch(self, decoder_input: Tensor) -> None:
        """No weight gradient may still be pending when a microbatch starts."""
        del decoder_input
        check_wgrad_done(self, when="when a microbatch starts")

    def rotary(self, decoder_input: Tensor, position_ids: Tensor | None) -> Rotary:
        """Rotary tables for ``position_ids`` (``0 .. S-1`` for every row by default)."""
        B, S = decoder_input.shape[:2]
        if position_ids is None:
            position_ids = torch.arange(S, device=decoder_input.device).expand(B, S)
        freqs, cos, sin = rotary_tables(
            position_ids, self.config.head_dim, self.config.rotary_base, self.config.dtype
        )
        return Rotary(freqs, cos, sin)

    def output(
        self, hidden_states: Tensor, labels: Tensor | None, loss_mask: Tensor | None
    ) -> Tensor:
        """Final norm, output layer; with ``labels`` the masked mean cross-entropy (float32).

        Without ``labels``, the logits ``[B, S, V]``.
        """
        logits_BSV: Tensor = self.output_layer(self.final_norm(hidden_states))
        if labels is None:
            return logits_BSV
        return masked_cross_entropy(logits_BSV, labels, loss_mask)

    microbatch_inputs = frozenset(REFERENCE_INPUTS)
    """The microbatch inputs the model reads (:class:`~moe_overlap.inputs.DeclaresInputs`)."""

    def validate_inputs(self, state: ChunkState, /) -> None:
        """The masks' and labels' shapes and dtypes (:func:`check_reference_inputs`)."""
        check_reference_inputs(self, state)

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor | None = None,
        labels: Tensor | None = None,
        loss_mask: Tensor | None = None,
        attention_mask: Tensor | None = None,
        padding_mask: Tensor | None = None,
    ) -> Tensor:
        """The plain path: the loss (or logits without ``labels``) of one microbatch."""
        return self.plain_forward(
            input_ids,
            position_ids,
            labels=labels,
            loss_mask=loss_mask,
            attention_mask=attention_mask,
            padding_mask=padding_mask,
        )


def check_reference_inputs(model: object, state: ChunkState) -> None:
    """Refuse, naming the field, what the reference model cannot take exactly.

    ``input_ids`` integer ``[B, S]``, the masks' dtypes and shapes
    (:func:`~moe_overlap.blocks.check_masks`), ``labels`` (integer) and ``loss_mask`` shaped
    ``[B, S]`` like the tokens, ``position_ids`` ``[B or 1, S]``, and a ``padding_mask``
    with ``labels`` but no ``loss_mask`` on a model with the loss (the loss would count the padded
    positions: pass ``loss_mask``, ``0`` at padding). ``B`` and ``S`` come from the token
    ids or the decoder input; a plan without either (a later pipeline stage given its input
    at run time) is checked by the layers instead. Reads no tensor values.
    """
    where = type(model).__name__
    ids = state.input_ids
    if ids is not None and (ids.dim() != 2 or ids.dtype not in _ID_DTYPES):
        fix = "input_ids.long()" if ids.dim() == 2 else "input_ids[None] for a batch of one"
        raise ConfigError(
            f"{where}: input_ids: expected an int64 (or int32) tensor of token ids [B, S], "
            f"received {_described(ids)}; pass {fix}"
        )
    x = ids if ids is not None else state.decoder_input
    if x is None or x.dim() < 2:
        return
    B, S = x.shape[0], x.shape[1]
    check_masks(state, B, S, where)
    for name in ("labels", "loss_mask"):
        t: Tensor | None = getattr(state, name)
        if t is not None and tuple(t.shape) != (B, S):
            raise ConfigError(
                f"{where}: {name}: expected shape [B, S] = [{B}, {S}] (the tokens'), received "
                f"{_described(t)}"
            )
    labels = state.labels
    if labels is not None and labels.dtype not in _LABEL_DTYPES:
        raise ConfigError(
            f"{where}: labels: expected an int64 (or uint8) tensor of token ids [B, S], "
            f"received {_described(labels)}; pass labels.long()"
        )
    pos = state.position_ids
    if pos is not None and (pos.dim() != 2 or pos.shape[0] not in (1, B) or pos.shape[1] != S):
        raise ConfigError(
            f"{where}: position_ids: expected shape [B or 1, S] = [{B} or 1, {S}] (the "
            f"tokens'), received {_described(pos)}"
        )
    post_process = bool(getattr(model, "post_process", True))
    if (
        post_process
        and state.padding_mask is not None
        and state.labels is not None
        and state.loss_mask is None
    ):
        raise ConfigError(
            f"{where}: padding_mask is set with labels but no loss_mask; padding_mask keeps "
            "padded tokens out of attention and of the router's aux loss, the language-model "
            "loss is loss_mask's (Megatron-Core's convention), so the loss would count the "
            "padded positions: pass loss_mask too (0 at padding, e.g. "
            "(~padding_mask).float())"
        )


_ID_DTYPES = (torch.int64, torch.int32)
"""What the embedding takes as token ids."""
_LABEL_DTYPES = (torch.int64, torch.uint8)
"""What ``cross_entropy`` takes as target ids."""


def _described(t: Tensor) -> str:
    return f"a {str(t.dtype).removeprefix('torch.')} tensor of shape {list(t.shape)}"


def masked_cross_entropy(logits_BSV: Tensor, labels_BS: Tensor, loss_mask: Tensor | None) -> Tensor:
    """Mean token cross-entropy over ``loss_mask`` (all tokens when ``None``), in float32."""
    w = "masked_cross_entropy"
    check_arg(w, "logits_BSV", logits_BSV, TENSOR)
    check_arg(w, "labels_BS", labels_BS, TENSOR)
    check_arg(w, "loss_mask", loss_mask, Opt(TENSOR))
    losses_T = F.cross_entropy(
        logits_BSV.float().reshape(-1, logits_BSV.shape[-1]),
        labels_BS.reshape(-1),
        reduction="none",
    )
    if loss_mask is None:
        return losses_T.mean()
    mask_T = loss_mask.reshape(-1).to(torch.float32)
    return (losses_T * mask_T).sum() / mask_T.sum().clamp(min=1.0)
