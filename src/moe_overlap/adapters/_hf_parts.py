"""Find the parts of a transformers 5 MoE causal LM, by the structure its families share.

A ``*ForCausalLM`` has ``model`` (``embed_tokens``, ``layers``, ``norm``, ``rotary_emb``),
``lm_head``, ``loss_function`` and ``config``. Each decoder layer has ``input_layernorm``,
``self_attn``, ``post_attention_layernorm`` and ``mlp``; the ``mlp`` of a sparse layer has
a ``gate`` (a top-k router returning ``(router_logits, top_k_weights, top_k_index)``) and
``experts`` holding the fused 3-D weights ``gate_up_proj`` ``[E, 2F, D]`` (gate rows then
up rows) and ``down_proj`` ``[E, D, F]``, and may have a ``shared_expert`` gated by
``sigmoid(shared_expert_gate(x))`` (Qwen2-MoE). Anything else in ``mlp`` is a dense MLP.

Everything is read once, checked, and typed here, so the rest of the adapter never touches
an untyped attribute. A model that does not fit raises :class:`~moe_overlap.ConfigError`
naming the member, what was expected and what was found.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, cast

from torch import Tensor, nn

from moe_overlap import ConfigError

__all__ = [
    "AttentionKind",
    "LayerParts",
    "MoEParts",
    "ModelParts",
    "child",
    "config_value",
    "find_parts",
    "parameter",
]

AttentionKind = Literal["full_attention", "sliding_attention"]
LossFunction = Callable[..., Tensor]


def child(module: nn.Module, name: str) -> nn.Module:
    """``module.name`` as a module, or :class:`~moe_overlap.ConfigError`."""
    value: object = getattr(module, name, None)
    if not isinstance(value, nn.Module):
        raise ConfigError(
            f"{type(module).__name__}.{name}: expected a torch.nn.Module, "
            f"received {type(value).__name__}"
        )
    return value


def optional_child(module: nn.Module, name: str) -> nn.Module | None:
    value: object = getattr(module, name, None)
    return value if isinstance(value, nn.Module) else None


def parameter(module: nn.Module, name: str, ndim: int) -> nn.Parameter:
    """``module.name`` as a parameter with ``ndim`` dimensions, or :class:`~moe_overlap.ConfigError`."""
    value: object = getattr(module, name, None)
    if not isinstance(value, nn.Parameter) or value.dim() != ndim:
        got = (
            f"a {value.dim()}-D parameter"
            if isinstance(value, nn.Parameter)
            else type(value).__name__
        )
        raise ConfigError(
            f"{type(module).__name__}.{name}: expected a {ndim}-D parameter, received {got}"
        )
    return value


def config_value(config: object, name: str, kind: type[int] | type[float] | type[bool]) -> object:
    """``config.name``, checked to be a ``kind`` (an int is a float too)."""
    value: object = getattr(config, name, None)
    ok = isinstance(value, kind) or (kind is float and isinstance(value, int))
    if not ok or (kind is not bool and isinstance(value, bool)):
        raise ConfigError(
            f"{type(config).__name__}.{name}: expected a {kind.__name__}, "
            f"received {type(value).__name__} {value!r}"
        )
    return value


def _int(config: object, name: str) -> int:
    return cast(int, config_value(config, name, int))


@dataclass(frozen=True, slots=True, kw_only=True)
class MoEParts:
    """A sparse MLP block: router, routed experts, optional gated shared expert."""

    block: nn.Module
    router: nn.Module
    experts: nn.Module
    shared_expert: nn.Module | None
    shared_expert_gate: nn.Module | None
    num_experts: int
    top_k: int
    act_fn: Callable[[Tensor], Tensor]


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerParts:
    """One decoder layer, split as the schedule needs it."""

    index: int
    input_norm: nn.Module
    attention: nn.Module
    post_norm: nn.Module
    mlp: nn.Module
    moe: MoEParts | None
    attention_kind: AttentionKind


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelParts:
    """The whole causal LM."""

    embed: nn.Module
    layers: tuple[LayerParts, ...]
    norm: nn.Module
    rotary: nn.Module
    lm_head: nn.Module
    loss_function: LossFunction
    vocab_size: int
    hf_config: object
    router_aux_loss_coef: float
    output_router_logits: bool


def _experts_layout_ok(experts: nn.Module) -> None:
    """transformers' ``use_experts_implementation`` flags; only the Mixtral layout is read."""
    expected = {
        "is_transposed": False,
        "is_concatenated": True,
        "has_bias": False,
        "has_gate": True,
        "has_post_expert_norm": False,
    }
    for flag, want in expected.items():
        got: object = getattr(experts, flag, want)
        if got != want:
            raise ConfigError(
                f"{type(experts).__name__}.{flag}: the adapter supports fused [gate; up] "
                f"expert weights without bias or post-norm; expected {flag}={want}, "
                f"received {got!r}"
            )


def _moe_parts(mlp: nn.Module, where: str) -> MoEParts | None:
    router = optional_child(mlp, "gate")
    experts = optional_child(mlp, "experts")
    if router is None or experts is None:
        return None
    _experts_layout_ok(experts)
    gate_up = parameter(experts, "gate_up_proj", 3)
    down = parameter(experts, "down_proj", 3)
    if gate_up.shape[0] != down.shape[0] or gate_up.shape[1] != 2 * down.shape[2]:
        raise ConfigError(
            f"{where}.mlp.experts: expected gate_up_proj [E, 2F, D] and down_proj [E, D, F], "
            f"received {tuple(gate_up.shape)} and {tuple(down.shape)}"
        )
    act: object = getattr(experts, "act_fn", None)
    if not callable(act):
        raise ConfigError(
            f"{where}.mlp.experts.act_fn: expected a callable, received {type(act).__name__}"
        )
    num_experts = _int(router, "num_experts")
    top_k = _int(router, "top_k")
    parameter(router, "weight", 2)
    shared = optional_child(mlp, "shared_expert")
    shared_gate = optional_child(mlp, "shared_expert_gate")
    if (shared is None) != (shared_gate is None):
        raise ConfigError(
            f"{where}.mlp: expected shared_expert and shared_expert_gate together, received "
            f"only {'shared_expert' if shared is not None else 'shared_expert_gate'}"
        )
    return MoEParts(
        block=mlp,
        router=router,
        experts=experts,
        shared_expert=shared,
        shared_expert_gate=shared_gate,
        num_experts=num_experts,
        top_k=top_k,
        act_fn=cast("Callable[[Tensor], Tensor]", act),
    )


def _attention_kind(config: object, index: int) -> AttentionKind:
    """Which mask the layer gets, as the families' ``*Model.forward`` chooses it."""
    layer_types: object = getattr(config, "layer_types", None)
    if isinstance(layer_types, (list, tuple)):
        kinds = cast("list[object] | tuple[object, ...]", layer_types)
        kind = kinds[index]
        if kind not in ("full_attention", "sliding_attention"):
            raise ConfigError(
                f"{type(config).__name__}.layer_types[{index}]: expected 'full_attention' or "
                f"'sliding_attention', received {kind!r}"
            )
        return kind
    if getattr(config, "sliding_window", None) is not None:
        return "sliding_attention"
    return "full_attention"


def find_parts(model: nn.Module) -> ModelParts:
    """Read and check the parts of a transformers MoE ``*ForCausalLM``."""
    name = type(model).__name__
    base = child(model, "model")
    config: object = getattr(model, "config", None)
    if config is None:
        raise ConfigError(f"{name}.config: expected a transformers config, received None")
    layer_list = child(base, "layers")
    if not isinstance(layer_list, nn.ModuleList):
        raise ConfigError(
            f"{name}.model.layers: expected a torch.nn.ModuleList, "
            f"received {type(layer_list).__name__}"
        )
    jitter: object = getattr(config, "router_jitter_noise", 0.0)
    if isinstance(jitter, (int, float)) and jitter > 0:
        raise ConfigError(
            f"{type(config).__name__}.router_jitter_noise: the adapter routes deterministically; "
            f"expected 0, received {jitter}"
        )
    layers: list[LayerParts] = []
    for i, layer in enumerate(layer_list):
        where = f"{name}.model.layers[{i}]"
        mlp = child(layer, "mlp")
        layers.append(
            LayerParts(
                index=i,
                input_norm=child(layer, "input_layernorm"),
                attention=child(layer, "self_attn"),
                post_norm=child(layer, "post_attention_layernorm"),
                mlp=mlp,
                moe=_moe_parts(mlp, where),
                attention_kind=_attention_kind(config, i),
            )
        )
    loss_function: object = getattr(model, "loss_function", None)
    if not callable(loss_function):
        raise ConfigError(
            f"{name}.loss_function: expected a callable, received {type(loss_function).__name__}"
        )
    output_router_logits: object = getattr(config, "output_router_logits", False)
    coef: object = getattr(config, "router_aux_loss_coef", 0.0)
    return ModelParts(
        embed=child(base, "embed_tokens"),
        layers=tuple(layers),
        norm=child(base, "norm"),
        rotary=child(base, "rotary_emb"),
        lm_head=child(model, "lm_head"),
        loss_function=cast(LossFunction, loss_function),
        vocab_size=_int(config, "vocab_size"),
        hf_config=config,
        router_aux_loss_coef=float(coef) if isinstance(coef, (int, float)) else 0.0,
        output_router_logits=bool(output_router_logits),
    )
