"""A Megatron-Core ``HybridModel``: the steps its own ``forward`` takes around its decoder.

``GPTModel`` has ``_preprocess`` and ``_postprocess`` methods the adapter calls;
``HybridModel.forward`` takes the same steps inline. :func:`preprocess` and
:func:`postprocess` take them on the model's own submodules and methods, in its order, for
the training path (no inference context, no packed sequences, no multi-token prediction):
the embedding unless given hidden states; the rotary table from ``rotary_pos_emb``; then,
after the decoder's layers and its final norm (:func:`final_norm`), the output layer (with
the shared embedding weight when tied), ``_scale_logits`` and ``compute_language_model_loss``.
The adapter compares them with the model's own ``forward`` at construction (a probe model,
:func:`probe_model`, sharing the model's weights), so a Megatron-Core release that changes
its ``forward`` is refused, not followed silently.

Legend: ``S`` sequence, ``B`` batch, ``H`` hidden.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from torch import Tensor, nn

from moe_overlap import ConfigError
from moe_overlap.adapters._torch_private import with_children

__all__ = [
    "ATTENTION",
    "final_norm",
    "postprocess",
    "preprocess",
    "probe_model",
    "refuse_hybrid",
]

ATTENTION = frozenset({"*", "+"})
"""The ``hybrid_layer_pattern`` symbols of attention layers (self-attention, MLA)."""

_REFUSED: dict[str, tuple[str, str]] = {
    "M": (
        "a Mamba layer",
        "it is not a TransformerLayer the adapter can run or split, and its mixer needs the "
        "mamba_ssm and causal_conv1d CUDA kernels",
    ),
    "G": (
        "a gated delta net layer",
        "its recurrent mixer (GatedDeltaNet) needs CUDA kernels the adapter is not tested with",
    ),
    "D": (
        "a DeepSeek sparse attention layer",
        "its indexer and sparse attention are not tested with the adapter",
    ),
}
"""Layer symbols the adapter refuses: what the layer is, and why."""


def refuse_hybrid(model: nn.Module, layers: Sequence[tuple[str, nn.Module]]) -> None:
    """Raise :class:`~moe_overlap.ConfigError` for a ``HybridModel`` layer the adapter cannot
    run (Mamba, gated delta net, sparse attention) or multi-token prediction."""
    m: Any = model
    w = "MegatronMoEAdapter: HybridModel"
    pattern: object = getattr(m, "hybrid_layer_pattern", None)
    if bool(getattr(m, "mtp_process", False)):
        raise ConfigError(
            f"{w}: expected no multi-token prediction, received hybrid_layer_pattern "
            f"{pattern!r} with MTP depths after '/' (the adapter does not run MTP layers); "
            "build the model with a pattern without '/'"
        )
    found: object = getattr(m.decoder, "layer_type_list", None)
    got = type(found).__name__
    types = cast("list[object]", found) if isinstance(found, list) else None
    if types is None or len(types) != len(layers):
        raise ConfigError(
            f"{w}.decoder.layer_type_list: expected one hybrid_layer_pattern symbol per layer "
            f"({len(layers)}), as HybridStack records them, received {got}"
        )
    for (name, layer), symbol in zip(layers, types, strict=True):
        if isinstance(symbol, str) and symbol in _REFUSED:
            what, why = _REFUSED[symbol]
            raise ConfigError(
                f"{w}.{name} ({type(layer).__name__}, {symbol!r} in hybrid_layer_pattern "
                f"{pattern!r}): expected an attention ('*' or '+'), MLP ('-') or MoE ('E') "
                f"layer, received {what}: {why}; build the model with a hybrid_layer_pattern "
                "of '*', '+', '-' and 'E' layers"
            )


def preprocess(
    model: nn.Module,
    input_ids: Tensor | None,
    position_ids: Tensor | None,
    decoder_input: Tensor | None,
) -> tuple[Tensor | None, Tensor | None]:
    """``(decoder input [S, B, H], rotary table)`` as ``HybridModel.forward`` makes them:
    the embedding of ``input_ids`` unless ``decoder_input`` is given (a later pipeline
    stage), the rotary table for its length (rope or YaRN; none with MLA, which makes its
    own)."""
    m: Any = model
    if decoder_input is None and bool(m.pre_process):
        decoder_input = cast("Tensor", m.embedding(input_ids=input_ids, position_ids=position_ids))
    rotary: Tensor | None = None
    kind: object = m.position_embedding_type
    if kind == "rope" and not bool(m.config.multi_latent_attention):
        length: object = m.rotary_pos_emb.get_rotary_seq_len(
            None, m.decoder, decoder_input, m.config, None
        )
        rotary = cast("Tensor", m.rotary_pos_emb(length, packed_seq=False))
    elif kind == "yarn":
        length = m.rotary_pos_emb.get_rotary_seq_len(None, m.decoder, decoder_input, m.config, None)
        rotary, _ = cast("tuple[Tensor, object]", m.rotary_pos_emb(length, packed_seq=False))
    return decoder_input, rotary


def final_norm(decoder: nn.Module) -> nn.Module | None:
    """The decoder's final norm where its ``forward`` applies one (``post_process`` and
    ``post_layer_norm``)."""
    d: Any = decoder
    if bool(getattr(d, "post_process", False)) and bool(getattr(d, "post_layer_norm", False)):
        norm: object = getattr(d, "final_norm", None)
        return norm if isinstance(norm, nn.Module) else None
    return None


def postprocess(model: nn.Module, hidden_states: Tensor, labels: Tensor | None) -> Tensor:
    """After the decoder, as ``HybridModel.forward``: the output layer (the word embedding's
    weight when tied), ``_scale_logits``; the per-token loss ``[B, S]`` with ``labels``,
    else the logits ``[B, S, V]``."""
    m: Any = model
    weight: object = (
        m.shared_embedding_or_output_weight()
        if bool(m.share_embeddings_and_output_weights)
        else None
    )
    logits, _ = cast(
        "tuple[Tensor, object]",
        m.output_layer(hidden_states, weight=weight, runtime_gather_output=None),
    )
    logits = cast("Tensor", m._scale_logits(logits))
    if labels is None:
        return logits.transpose(0, 1).contiguous()
    return cast("Tensor", m.compute_language_model_loss(labels, logits))


def probe_model(model: nn.Module, layer: nn.Module) -> nn.Module:
    """``model`` with one decoder layer, ``layer``: a shallow copy sharing the model's
    embedding, rotary table, final norm and output layer (and their weights), for the
    self-check's comparison with the model's own ``forward``. The model is not changed."""
    decoder = with_children(model.get_submodule("decoder"), {"layers": nn.ModuleList([layer])})
    return with_children(model, {"decoder": decoder})
