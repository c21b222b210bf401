"""A transformers MoE causal LM as a :class:`~moe_overlap.PreprocessableModel`.

Legend: ``B`` batch, ``S`` sequence, ``D`` hidden, ``V`` vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe_overlap import (
    ConfigError,
    CudaGraphModule,
    ScheduleOptions,
    WgradError,
)
from moe_overlap.adapters._hf_aux import RouterAuxLoss
from moe_overlap.adapters._hf_ep import expert_parameter_names, shard_experts
from moe_overlap.adapters._hf_layers import HFDenseLayer, HFLayer, HFMoELayer
from moe_overlap.adapters._hf_parts import ModelParts, find_parts
from moe_overlap.blocks import MegatronHooks, Rotary, TokenDispatcher

__all__ = ["AdapterConfig", "AdapterDecoder", "TransformersMoEAdapter"]


@dataclass(frozen=True, slots=True, kw_only=True)
class AdapterConfig:
    """The configuration the schedule reads (free-input policy, MTP layers).

    The all-to-all dispatcher, no FP8/FP4, no CUDA graphs, no MTP: the defaults are what
    the adapter implements.
    """

    delay_wgrad_compute: bool = False
    moe_token_dispatcher_type: str = "alltoall"
    moe_flex_dispatcher_backend: str | None = None
    fp8: str | None = None
    fp4: str | None = None
    cuda_graph_modules: tuple[CudaGraphModule, ...] = ()
    mtp_num_layers: int | None = None


class AdapterDecoder:
    """``decoder`` as the schedule sees it: the adapted layers; final norm in post-process."""

    def __init__(self, layers: tuple[HFLayer, ...]) -> None:
        self.layers = layers
        self.input_tensor: Tensor | None = None
        self.final_layernorm: Callable[[Tensor], Tensor] | None = None


def _uniform(parts: ModelParts) -> tuple[int, int]:
    """``(num_experts, top_k)``, the same for every MoE layer (one dispatcher serves all)."""
    shapes = {(p.moe.num_experts, p.moe.top_k) for p in parts.layers if p.moe is not None}
    if len(shapes) > 1:
        raise ConfigError(
            f"TransformersMoEAdapter: expected every MoE layer to have the same experts and "
            f"top-k, received {sorted(shapes)}"
        )
    return shapes.pop() if shapes else (1, 1)


def _label_delayed_modules(model: nn.Module, layers: tuple[HFLayer, ...]) -> None:
    """Name each delayed module after its place in ``model``, for error messages."""
    # torch leaves named_modules() unannotated.
    named = cast("Iterator[tuple[str, nn.Module]]", model.named_modules())
    names = {id(m): n for n, m in named}
    for layer in layers:
        for module in layer.delayed_modules():
            if id(module) in names:
                module.label = names[id(module)]
        if isinstance(layer, HFMoELayer):
            experts = names[id(layer.moe.experts)]
            layer.experts.gate_up.label = f"{experts}.gate_up_proj"
            layer.experts.down.label = f"{experts}.down_proj"


class TransformersMoEAdapter(MegatronHooks):
    """A transformers 5 MoE ``*ForCausalLM`` (Mixtral, Qwen2-MoE, ...) for :func:`~moe_overlap.combined_1f1b`.

    The adapter holds no weights: it reads and trains ``model``'s own parameters, so the
    optimizer takes ``model.parameters()`` and checkpoints stay in transformers' format.

    Args:
        model: the causal LM (``MixtralForCausalLM``, ``Qwen2MoeForCausalLM``, or any
            family with the structure described in :mod:`moe_overlap.adapters.transformers`).
        ep_group: expert-parallel group; ``None`` keeps every expert local. A model holding
            all experts is sharded in place (:func:`shard_experts`); one already sharded is
            taken as is.
        delay_wgrad_compute: delay the weight gradients of the attention projections, the
            shared expert, the dense MLPs and the routed experts to the schedule's
            ``backward_dw`` steps (their ``nn.Linear`` s are swapped, in place, for
            delayable linears sharing the same parameters and ``state_dict`` keys).
        router_aux_loss: add transformers' load-balancing loss times
            ``config.router_aux_loss_coef`` to the loss; ``None`` follows
            ``config.output_router_logits``, as the model's own ``forward`` does.

    ``_postprocess`` returns ``loss_function(logits, labels, vocab_size)``, the model's own
    loss (labels are shifted inside it; use ``-100`` to ignore positions). A ``loss_mask``
    is rejected, as transformers has none.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        ep_group: dist.ProcessGroup | None = None,
        delay_wgrad_compute: bool = False,
        router_aux_loss: bool | None = None,
    ) -> None:
        parts = find_parts(model)
        num_experts, top_k = _uniform(parts)
        self.model = model
        self.parts = parts
        self.config = AdapterConfig(delay_wgrad_compute=delay_wgrad_compute)
        self.dispatcher = TokenDispatcher(num_experts, top_k, group=ep_group)
        if self.dispatcher.ep_size > 1 and self._holds_all_experts():
            shard_experts(model, ep_group)
        self._check_local_experts()
        want_aux = parts.output_router_logits if router_aux_loss is None else router_aux_loss
        has_moe = any(p.moe is not None for p in parts.layers)
        self.aux = (
            RouterAuxLoss(num_experts=num_experts, top_k=top_k, coef=parts.router_aux_loss_coef)
            if want_aux and has_moe
            else None
        )
        layers: list[HFLayer] = []
        for p in parts.layers:
            if p.moe is None:
                layers.append(
                    HFDenseLayer(
                        p, self.config, hf_config=parts.hf_config, delay_wgrad=delay_wgrad_compute
                    )
                )
            else:
                layers.append(
                    HFMoELayer(
                        p,
                        self.config,
                        hf_config=parts.hf_config,
                        delay_wgrad=delay_wgrad_compute,
                        dispatcher=self.dispatcher,
                        aux=self.aux,
                    )
                )
        self.decoder = AdapterDecoder(tuple(layers))
        _label_delayed_modules(model, self.decoder.layers)

    def _local_rows(self) -> set[int]:
        return {
            layer.moe.experts.get_parameter("gate_up_proj").shape[0]
            for layer in self.parts.layers
            if layer.moe is not None
        }

    def _holds_all_experts(self) -> bool:
        return self._local_rows() == {self.dispatcher.num_experts}

    def _check_local_experts(self) -> None:
        rows = self._local_rows()
        if rows and rows != {self.dispatcher.local_experts}:
            raise ConfigError(
                f"TransformersMoEAdapter: expected {self.dispatcher.local_experts} local experts "
                f"per MoE layer (EP size {self.dispatcher.ep_size}), received {sorted(rows)}"
            )

    @property
    def pre_process(self) -> bool:
        return True

    @property
    def post_process(self) -> bool:
        return True

    def schedule_options(
        self, *, free_input: bool = True, ep_overlap_early_attn_memory_release: bool = False
    ) -> ScheduleOptions:
        """Schedule options matching this adapter (``delay_wgrad_compute`` included)."""
        return ScheduleOptions(
            delay_wgrad_compute=self.config.delay_wgrad_compute,
            free_input=free_input,
            ep_overlap_early_attn_memory_release=ep_overlap_early_attn_memory_release,
        )

    def parameters(self) -> Iterator[nn.Parameter]:
        """The model's parameters (what the optimizer takes)."""
        return self.model.parameters()

    def expert_parameters(self) -> list[nn.Parameter]:
        """The routed experts' weights: sharded under EP, so not averaged like the rest."""
        named = dict(self.model.named_parameters())
        return [named[n] for n in expert_parameter_names(self.model)]

    def pending_wgrad(self) -> int:
        """How many delayed weight gradients wait for ``backward_dw`` (0 after a schedule)."""
        return sum(sum(layer.pending_wgrad().values()) for layer in self.decoder.layers)

    def discard_wgrad(self) -> None:
        """Drop every pending delayed weight gradient.

        After a failed :func:`~moe_overlap.combined_1f1b` step (zero the gradients too):
        the next step's ``_preprocess`` refuses to start while any is pending.
        """
        for layer in self.decoder.layers:
            layer.discard_wgrad()

    # --- MegatronHooks: what _preprocess / _postprocess are built on ----------------------
    def embed(self, input_ids: Tensor) -> Tensor:
        """The transformers model's token embedding."""
        out: Tensor = self.parts.embed(input_ids)
        return out

    def on_microbatch(self, decoder_input: Tensor) -> None:
        """Refuse pending weight gradients; open the aux-loss microbatch."""
        pending = {k: n for layer in self.decoder.layers for k, n in layer.pending_wgrad().items()}
        if pending:
            raise WgradError(
                f"{type(self.model).__name__} adapter: expected no pending weight gradients "
                f"at the start of a microbatch (use schedule_options(); after a failed step, "
                f"discard_wgrad()), received {pending}"
            )
        if self.aux is not None:
            self.aux.begin(decoder_input.device)

    def rotary(self, decoder_input: Tensor, position_ids: Tensor | None) -> Rotary:
        """The transformers model's rotary cos/sin (positions ``0 .. S-1`` by default)."""
        if position_ids is None:
            position_ids = torch.arange(decoder_input.shape[1], device=decoder_input.device)
            position_ids = position_ids.unsqueeze(0)
        cos_sin: tuple[Tensor, Tensor] = self.parts.rotary(decoder_input, position_ids)
        cos, sin = cos_sin
        return Rotary(None, cos, sin)

    def output(
        self, hidden_states: Tensor, labels: Tensor | None, loss_mask: Tensor | None
    ) -> Tensor:
        """Final norm, LM head, the model's loss (+ the router aux loss); logits without labels."""
        aux = self.aux.finish() if self.aux is not None else None
        if loss_mask is not None:
            raise ConfigError(
                "TransformersMoEAdapter: transformers models take no loss_mask; expected None "
                "(set ignored label positions to -100), received a tensor"
            )
        p = self.parts
        logits_BSV: Tensor = p.lm_head(p.norm(hidden_states))
        if labels is None:
            return logits_BSV
        loss = p.loss_function(logits_BSV, labels, p.vocab_size)
        if aux is not None:
            assert self.aux is not None
            loss = loss + self.aux.coef * aux.to(loss.device)
        return loss
