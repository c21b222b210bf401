"""What a mixture-of-experts model costs one rank for one microbatch: FLOPs, HBM bytes,
all-to-all bytes and saved activations of each schedule node.

The counts are analytic and approximate: SwiGLU MLPs and experts (three matrices each),
balanced routing (every rank's experts receive ``tokens * top_k`` rows per microbatch), no
tensor or context parallelism (each rank holds the whole attention and dense weights and
``num_experts / ep`` experts), causal attention with a fused kernel. Elementwise work (norms,
activations, residuals) enters the byte counts only; biases, rotary tables and norm weights'
gradients are left out.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple, Protocol, cast

import torch

from moe_overlap.args import (
    NON_NEGATIVE,
    POSITIVE,
    Instance,
    Int,
    Items,
    OneOf,
    Opt,
    Spec,
    check_arg,
    check_fields,
    refuse,
)
from moe_overlap.engine import ConfigError, Direction, MoeOverlapError, Slot

from ._presets import MODEL_PRESETS

__all__ = ["PRESETS", "LayerKind", "ModelSpec"]

LayerKind = Literal["moe", "dense", "pre", "post"]
"""A node's owner: an MoE layer, a dense layer, the pre-process (embedding) or the
post-process (final norm, LM head, loss)."""

_LAYER_KINDS: tuple[LayerKind, ...] = ("moe", "dense", "pre", "post")


if TYPE_CHECKING:

    class _ToDict(Protocol):
        """A configuration object with ``to_dict()`` (a transformers ``PretrainedConfig``);
        for the annotation only: the check reads the attribute."""

        def to_dict(self) -> Mapping[str, object]:
            """The configuration as a mapping of its fields."""
            ...

else:
    # Opaque at run time: debug mode's beartype cannot check a Protocol that is not
    # runtime-checkable (and one that is needs a rule table); from_hf_config checks it.
    _ToDict = object


class _Matmul(NamedTuple):
    """One matrix multiply of a node: ``rows`` token rows through ``copies`` weight
    matrices of ``fan_in x fan_out`` held by the rank (the rows spread over the copies)."""

    rows: float
    fan_in: int
    fan_out: int
    copies: int = 1


class _Parts(NamedTuple):
    """What one node does in forward: its matmuls, whether it holds the attention core,
    and the bytes its elementwise work reads and writes."""

    matmuls: tuple[_Matmul, ...] = ()
    core: bool = False
    elementwise_bytes: float = 0.0


_SLOTS_OF: dict[LayerKind, tuple[Slot, ...]] = {
    "moe": (Slot.PRE_DISPATCH, Slot.DISPATCH, Slot.MLP, Slot.COMBINE),
    "dense": (Slot.PRE_DISPATCH, Slot.MLP),
    "pre": (Slot.PRE_PROCESS,),
    "post": (Slot.POST_PROCESS,),
}

_DIRECTIONS = (Direction.FORWARD, Direction.BACKWARD, Direction.WGRAD)

_GRAD_ACCUM_BYTES = 8
"""Bytes per parameter a weight-gradient GEMM moves for its gradient: an fp32 main-grad
read and written (accumulation)."""

_MLA = ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """The shape of a mixture-of-experts transformer and of its microbatch, for planning.

    Layers ``0 .. first_k_dense-1`` are dense; after them every ``moe_layer_freq``-th layer
    is MoE (layer ``l >= first_k_dense`` is MoE when ``(l - first_k_dense + 1) %
    moe_layer_freq == 0``; Qwen's ``decoder_sparse_step``), the others dense. Dense layers
    have a SwiGLU MLP ``ffn_hidden_size`` wide; MoE layers ``num_experts`` routed experts
    (``top_k`` per token) and ``shared_experts`` shared ones, each a SwiGLU MLP
    ``moe_ffn_hidden_size`` wide, and a linear router.

    Attention is grouped-query (``num_kv_heads`` key/value heads, ``None``: one per query
    head; ``head_dim`` ``None``: ``hidden_size / num_attention_heads``), or DeepSeek's
    multi-head latent attention when ``kv_lora_rank`` is set: then ``qk_nope_head_dim``,
    ``qk_rope_head_dim`` and ``v_head_dim`` are required, ``q_lora_rank`` optional (``None``:
    queries projected directly), and ``num_kv_heads`` and ``head_dim`` are not read.

    A microbatch is ``micro_batch_size`` sequences of ``seq_len`` tokens; weights and
    activations take ``dtype_bytes`` bytes per element. Every field is checked at
    construction (:class:`~moe_overlap.ConfigError` naming the field, what it expects and
    what it received).
    """

    name: str = "model"
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    ffn_hidden_size: int
    moe_ffn_hidden_size: int
    num_experts: int
    top_k: int
    shared_experts: int = 0
    first_k_dense: int = 0
    moe_layer_freq: int = 1
    vocab_size: int
    seq_len: int
    micro_batch_size: int = 1
    dtype_bytes: int = 2
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    qk_nope_head_dim: int | None = None
    v_head_dim: int | None = None

    def __post_init__(self) -> None:
        check_fields(self, _FIELDS)
        where = "ModelSpec"
        if self.top_k > self.num_experts:
            raise refuse(
                f"{where}.top_k",
                f"an int in [1, num_experts={self.num_experts}]",
                self.top_k,
                field=True,
            )
        if self.first_k_dense > self.num_layers:
            raise refuse(
                f"{where}.first_k_dense",
                f"an int in [0, num_layers={self.num_layers}]",
                self.first_k_dense,
                field=True,
            )
        if self.is_mla:
            for key in ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
                if getattr(self, key) is None:
                    raise refuse(
                        f"{where}.{key}",
                        "an int >= 1 with kv_lora_rank set (multi-head latent attention)",
                        None,
                        field=True,
                        hint="give every MLA dimension, or leave kv_lora_rank None",
                    )
            return
        for key in _MLA:
            if getattr(self, key) is not None:
                raise refuse(
                    f"{where}.{key}",
                    "None without kv_lora_rank (it is a multi-head latent attention size)",
                    getattr(self, key),
                    field=True,
                    hint="set kv_lora_rank too for DeepSeek's attention, or leave it None",
                )
        kv = self.num_kv_heads
        if kv is not None and self.num_attention_heads % kv:
            raise refuse(
                f"{where}.num_kv_heads",
                f"a divisor of num_attention_heads={self.num_attention_heads}",
                kv,
                field=True,
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise refuse(
                f"{where}.hidden_size",
                f"a multiple of num_attention_heads={self.num_attention_heads} when head_dim "
                "is None",
                self.hidden_size,
                field=True,
                hint="give head_dim",
            )

    # ----------------------------------------------------------------- shape

    @property
    def tokens(self) -> int:
        """Tokens of one microbatch: ``seq_len * micro_batch_size``."""
        return self.seq_len * self.micro_batch_size

    @property
    def is_mla(self) -> bool:
        """Whether attention is multi-head latent attention (``kv_lora_rank`` set)."""
        return self.kv_lora_rank is not None

    def is_moe(self, layer: int) -> bool:
        """Whether global layer ``layer`` is an MoE layer."""
        layer = check_arg(
            "ModelSpec.is_moe", "layer", layer, Int(0, self.num_layers - 1, max_name="num_layers-1")
        )
        after = layer - self.first_k_dense
        return after >= 0 and (after + 1) % self.moe_layer_freq == 0

    @property
    def moe_layers(self) -> int:
        """How many layers are MoE."""
        return (self.num_layers - self.first_k_dense) // self.moe_layer_freq

    @property
    def dense_layers(self) -> int:
        """How many layers are dense."""
        return self.num_layers - self.moe_layers

    def layer_kind(self, layer: int) -> LayerKind:
        """``"moe"`` or ``"dense"``: what global layer ``layer`` is."""
        return "moe" if self.is_moe(layer) else "dense"

    def _heads(self) -> tuple[int, int, int, int]:
        """``(query heads, key/value heads, q/k head dim, v head dim)`` as the attention
        core sees them (MLA's keys and values expanded to one per query head)."""
        nh = self.num_attention_heads
        if self.is_mla:
            nope = cast(int, self.qk_nope_head_dim)
            rope = cast(int, self.qk_rope_head_dim)
            return nh, nh, nope + rope, cast(int, self.v_head_dim)
        hd = self.head_dim if self.head_dim is not None else self.hidden_size // nh
        kv = self.num_kv_heads if self.num_kv_heads is not None else nh
        return nh, kv, hd, hd

    def _attention_weights(self) -> tuple[tuple[int, int], ...]:
        """``(fan_in, fan_out)`` of each attention projection."""
        h = self.hidden_size
        nh, kv, qk, v = self._heads()
        if not self.is_mla:
            return ((h, nh * qk), (h, kv * qk), (h, kv * v), (nh * v, h))
        kv_lora = cast(int, self.kv_lora_rank)
        rope = cast(int, self.qk_rope_head_dim)
        nope = cast(int, self.qk_nope_head_dim)
        q_lora = self.q_lora_rank
        queries = ((h, q_lora), (q_lora, nh * qk)) if q_lora is not None else ((h, nh * qk),)
        return (*queries, (h, kv_lora + rope), (kv_lora, nh * (nope + v)), (nh * v, h))

    def _attention_norm_width(self) -> int:
        """Width of the norms inside attention (MLA's latent norms), 0 without."""
        if not self.is_mla:
            return 0
        return (self.q_lora_rank or 0) + cast(int, self.kv_lora_rank)

    # ---------------------------------------------------------------- params

    def _attention_params(self) -> int:
        return sum(i * o for i, o in self._attention_weights()) + self._attention_norm_width()

    def _expert_params(self) -> int:
        return 3 * self.hidden_size * self.moe_ffn_hidden_size

    def _layer_params(self, kind: LayerKind, routed: int) -> int:
        h = self.hidden_size
        common = self._attention_params() + 2 * h  # two norms
        if kind == "dense":
            return common + 3 * h * self.ffn_hidden_size
        router = h * self.num_experts
        return common + router + (routed + self.shared_experts) * self._expert_params()

    def _embedding_params(self) -> int:
        # Embedding and LM head untied, plus the final norm.
        return 2 * self.vocab_size * self.hidden_size + self.hidden_size

    def total_params(self) -> int:
        """Every parameter, approximately: attention projections (and MLA's latent norms),
        two norms a layer, SwiGLU MLPs and experts (three matrices each), routers, the
        embedding and an untied LM head, the final norm; no biases, no multi-token
        prediction layers."""
        return (
            self.dense_layers * self._layer_params("dense", 0)
            + self.moe_layers * self._layer_params("moe", self.num_experts)
            + self._embedding_params()
        )

    def active_params(self) -> int:
        """Parameters one token goes through (:meth:`total_params` with ``top_k`` routed
        experts a MoE layer instead of all; the embedding counted whole)."""
        return (
            self.dense_layers * self._layer_params("dense", 0)
            + self.moe_layers * self._layer_params("moe", self.top_k)
            + self._embedding_params()
        )

    def rank_params(self, ep: int) -> int:
        """Parameters one rank of an ``ep``-wide expert-parallel group holds (its
        ``num_experts / ep`` experts and everything else whole)."""
        ep = self._check_ep("ModelSpec.rank_params", ep)
        local = self.num_experts // ep
        return (
            self.dense_layers * self._layer_params("dense", 0)
            + self.moe_layers * self._layer_params("moe", local)
            + self._embedding_params()
        )

    def _check_ep(self, where: str, ep: int) -> int:
        ep = check_arg(where, "ep", ep, POSITIVE)
        if self.num_experts % ep:
            raise refuse(
                f"{where}: ep",
                f"a divisor of num_experts={self.num_experts} (each rank holds the same "
                "number of experts)",
                ep,
            )
        return ep

    # ------------------------------------------------------------------ nodes

    def _parts(self, kind: LayerKind, slot: Slot, ep: int) -> _Parts:
        t = float(self.tokens)
        h = self.hidden_size
        d = self.dtype_bytes
        if slot in (Slot.DISPATCH, Slot.COMBINE):
            return _Parts()
        if kind == "pre":
            return _Parts(elementwise_bytes=2 * t * h * d)  # gather rows, write them
        if kind == "post":
            v = self.vocab_size
            # final norm in/out; fp32 logits written, read by the loss
            return _Parts((_Matmul(t, h, v),), elementwise_bytes=2 * t * h * d + 2 * t * v * 4)
        norm = 2 * t * h * d  # read x, write norm(x)
        residual = 3 * t * h * d  # read two, write one
        if slot is Slot.PRE_DISPATCH:
            matmuls = tuple(_Matmul(t, i, o) for i, o in self._attention_weights())
            latent = 2 * t * self._attention_norm_width() * d
            elementwise = norm + latent + residual
            if kind == "moe":
                e = self.num_experts
                matmuls += (_Matmul(t, h, e),)
                elementwise += norm + 2 * t * e * 4  # pre-MLP norm; fp32 softmax/top-k
            return _Parts(matmuls, core=True, elementwise_bytes=elementwise)
        if kind == "dense":
            f = self.ffn_hidden_size
            swiglu = 3 * t * f * d
            return _Parts(
                (_Matmul(t, h, 2 * f), _Matmul(t, f, h)),
                elementwise_bytes=norm + swiglu + residual,
            )
        f = self.moe_ffn_hidden_size
        rows = t * self.top_k
        local = self.num_experts // ep
        matmuls = (_Matmul(rows, h, 2 * f, local), _Matmul(rows, f, h, local))
        elementwise = 3 * rows * f * d + rows * h * d + residual  # SwiGLU, weighted sum
        s = self.shared_experts
        if s:
            matmuls += (_Matmul(t, h, 2 * f * s), _Matmul(t, f * s, h))
            elementwise += 3 * t * f * s * d
        return _Parts(matmuls, elementwise_bytes=elementwise)

    def _checked_node(
        self, where: str, kind: LayerKind, slot: Slot, direction: Direction
    ) -> tuple[LayerKind, Slot, Direction]:
        kind = check_arg(where, "layer_kind", kind, OneOf(_LAYER_KINDS))
        slot = check_arg(where, "slot", slot, OneOf(_SLOTS_OF[kind]))
        direction = check_arg(where, "direction", direction, OneOf(_DIRECTIONS))
        return kind, slot, direction

    def _core_flops(self) -> float:
        """Forward FLOPs of causal attention's core (``QK^T`` and ``PV``, half the square)."""
        nh, _, qk, v = self._heads()
        return 2.0 * self.tokens * self.seq_len * nh * (qk + v) / 2

    def _core_bytes(self) -> float:
        """Forward bytes of a fused attention kernel: ``q, k, v`` read, the output and the
        fp32 log-sum-exp written."""
        nh, kv, qk, v = self._heads()
        t = float(self.tokens)
        return t * (nh * qk + kv * qk + kv * v + nh * v) * self.dtype_bytes + t * nh * 4

    def node_flops(self, layer_kind: LayerKind, slot: Slot, direction: Direction) -> float:
        """FLOPs one rank spends on one node of one microbatch, with balanced routing.

        Attention projections ``2 T fan_in fan_out`` each, the causal core ``2 T s heads
        (qk_dim + v_dim) / 2`` (``s`` the sequence length), the router ``2 T H E``, routed
        experts ``2 T top_k 3 H F_moe``, shared experts ``2 T shared 3 H F_moe``, a dense MLP
        ``2 T 3 H F``, the LM head ``2 T H V``. ``FORWARD`` is those; ``BACKWARD`` the
        input-gradient GEMMs (as many FLOPs as the forward GEMMs) plus twice the core's
        forward; ``WGRAD`` the weight-gradient GEMMs (as many as the forward GEMMs). The
        pre-dispatch node holds attention and, in MoE layers, the router; the MLP node the
        experts or the dense MLP; dispatch, combine and the embedding take 0 FLOPs.
        """
        kind, slot, direction = self._checked_node(
            "ModelSpec.node_flops", layer_kind, slot, direction
        )
        parts = self._parts(kind, slot, 1)
        gemm = sum(2.0 * m.rows * m.fan_in * m.fan_out for m in parts.matmuls)
        core = self._core_flops() if parts.core else 0.0
        if direction is Direction.FORWARD:
            return gemm + core
        if direction is Direction.BACKWARD:
            return gemm + 2 * core
        return gemm

    def node_bytes(
        self, layer_kind: LayerKind, slot: Slot, direction: Direction, *, ep: int = 1
    ) -> float:
        """HBM bytes one rank reads and writes for one node of one microbatch, roughly:
        the roofline's memory term.

        ``FORWARD``: each GEMM reads its weights (the rank's ``num_experts / ep`` experts
        for routed experts) and its input rows and writes its output rows; a fused
        attention core reads ``q, k, v`` and writes its output and log-sum-exp; norms,
        SwiGLU, residual adds, the router's softmax and the loss read and write their
        tensors once. ``BACKWARD``: each GEMM as in forward (weights and output gradient
        read, input gradient written), the core and elementwise work twice their forward.
        ``WGRAD``: each GEMM reads its input rows and output gradient and reads and writes
        an fp32 gradient accumulator (8 bytes a parameter). Dispatch and combine move their
        bytes over links, not HBM: 0 here (see :meth:`a2a_bytes`).
        """
        where = "ModelSpec.node_bytes"
        kind, slot, direction = self._checked_node(where, layer_kind, slot, direction)
        ep = self._check_ep(where, ep)
        parts = self._parts(kind, slot, ep)
        d = self.dtype_bytes
        total = 0.0
        for m in parts.matmuls:
            weights = float(m.copies * m.fan_in * m.fan_out)
            rows = m.rows * (m.fan_in + m.fan_out) * d
            if direction is Direction.WGRAD:
                total += rows + weights * _GRAD_ACCUM_BYTES
            else:
                total += rows + weights * d
        if direction is Direction.WGRAD:
            return total
        scale = 1.0 if direction is Direction.FORWARD else 2.0
        core = self._core_bytes() if parts.core else 0.0
        return total + scale * (core + parts.elementwise_bytes)

    def a2a_bytes(self, ep: int) -> float:
        """Bytes one rank sends (and receives) in one dispatch, and in one combine, of a
        microbatch: its ``tokens * top_k`` rows of ``hidden_size`` elements but the share
        that stays on the rank, ``T top_k H dtype_bytes (ep - 1) / ep`` (0 at ``ep=1``)."""
        ep = check_arg("ModelSpec.a2a_bytes", "ep", ep, POSITIVE)
        rows = self.tokens * self.top_k
        return rows * self.hidden_size * self.dtype_bytes * (ep - 1) / ep

    def activation_bytes(self, layer_kind: LayerKind) -> float:
        """Bytes of activations one microbatch keeps alive in one layer (or the pre- or
        post-process) from its forward to its backward, without recomputation.

        A layer saves: the attention norm's input and output, MLA's latent projections and
        their norms' outputs, ``q, k, v``, the attention output and its fp32 log-sum-exp,
        the pre-MLP norm's input and output. A dense layer adds its MLP's gate/up output
        (``T 2F``) and SwiGLU output (``T F``); a MoE layer the router's fp32
        probabilities (``T E``) and int32 top-k indices, the dispatched rows (``T top_k H``),
        the experts' gate/up and SwiGLU outputs (``T top_k 3 F_moe``), the expert outputs
        the combine weighs (``T top_k H``), and the shared experts' intermediates
        (``T shared 3 F_moe``). The pre-process keeps the embedding output (``T H``); the
        post-process the final norm's input and output and the fp32 logits (``T V 4``).
        """
        kind = check_arg(
            "ModelSpec.activation_bytes", "layer_kind", layer_kind, OneOf(_LAYER_KINDS)
        )
        t = float(self.tokens)
        h = self.hidden_size
        d = self.dtype_bytes
        if kind == "pre":
            return t * h * d
        if kind == "post":
            return 2 * t * h * d + t * self.vocab_size * 4
        nh, kv, qk, v = self._heads()
        attention = 2 * t * h * d  # norm input and output
        if self.is_mla:
            q_lora = self.q_lora_rank or 0
            latent = cast(int, self.kv_lora_rank) + cast(int, self.qk_rope_head_dim)
            attention += 2 * t * (q_lora + latent) * d
        attention += t * (nh * qk + kv * qk + kv * v + nh * v) * d + t * nh * 4
        attention += 2 * t * h * d  # pre-MLP norm input and output
        if kind == "dense":
            return attention + 3 * t * self.ffn_hidden_size * d
        f = self.moe_ffn_hidden_size
        rows = t * self.top_k
        router = t * self.num_experts * 4 + rows * 4
        experts = rows * h * d + 3 * rows * f * d + rows * h * d
        shared = 3 * t * self.shared_experts * f * d
        return attention + router + experts + shared

    # ----------------------------------------------------------- constructors

    @classmethod
    def from_hf_config(
        cls,
        config: "Mapping[str, object] | _ToDict",
        *,
        seq_len: int,
        micro_batch_size: int = 1,
        name: str | None = None,
    ) -> "ModelSpec":
        """The spec of a Hugging Face MoE configuration (a mapping, or an object with
        ``to_dict()`` such as a transformers ``PretrainedConfig``; a ``text_config`` inside
        is read when the top level has no layers).

        Reads ``num_hidden_layers``, ``hidden_size``, ``num_attention_heads``,
        ``num_key_value_heads``, ``head_dim``, ``intermediate_size`` (the dense MLP width;
        also the experts' when there is no ``moe_intermediate_size``, as in Mixtral),
        ``moe_intermediate_size``, the expert count (``n_routed_experts``, ``num_experts``
        or ``num_local_experts``), ``num_experts_per_tok``, ``n_shared_experts`` (DeepSeek)
        or ``shared_expert_intermediate_size`` (Qwen2-MoE: converted to a count of
        ``moe_intermediate_size``-wide experts, rounded to the nearest, at least 1; its
        sigmoid gate is left out), the MoE layer pattern (``first_k_dense_replace`` and
        ``moe_layer_freq``, DeepSeek's; ``decoder_sparse_step`` and ``mlp_only_layers``,
        Qwen's: the pattern must be a dense prefix then every k-th layer), ``vocab_size``,
        the MLA sizes, and ``dtype`` or ``torch_dtype`` for ``dtype_bytes`` (2 when absent
        or ``"auto"``). A configuration without experts is refused.
        """
        where = "ModelSpec.from_hf_config"
        cfg = _as_mapping(where, "config", config)
        inner = cfg.get("text_config")
        if "num_hidden_layers" not in cfg and inner is not None:
            cfg = _as_mapping(where, "config['text_config']", inner)
        read = _Reader(where, cfg)
        experts = read.first(("n_routed_experts", "num_experts", "num_local_experts"))
        if experts in (None, 0):
            raise ConfigError(
                f"{where}: not a mixture-of-experts config (no n_routed_experts, num_experts "
                f"or num_local_experts; model_type {cfg.get('model_type')!r}): the planner "
                "models MoE layers; pass a ModelSpec for anything else"
            )
        num_experts = read.check(read.first_key, experts, POSITIVE)
        layers = read.get("num_hidden_layers", POSITIVE)
        hidden = read.get("hidden_size", POSITIVE)
        heads = read.get("num_attention_heads", POSITIVE)
        moe_ffn = read.optional("moe_intermediate_size", POSITIVE)
        ffn = read.optional("intermediate_size", POSITIVE)
        if moe_ffn is None:
            if ffn is None:
                raise read.missing("moe_intermediate_size or intermediate_size")
            moe_ffn = ffn
        shared = read.optional("n_shared_experts", NON_NEGATIVE)
        if shared is None:
            width = read.optional("shared_expert_intermediate_size", NON_NEGATIVE)
            shared = 0 if not width else max(1, round(width / moe_ffn))
        mla = read.optional("kv_lora_rank", POSITIVE) is not None
        pattern = _moe_pattern(read, layers)
        first_k, freq = _prefix_and_step(where, pattern, layers)
        spec = cls(
            name=name if name is not None else _default_name(cfg),
            num_layers=layers,
            hidden_size=hidden,
            num_attention_heads=heads,
            num_kv_heads=None if mla else read.optional("num_key_value_heads", POSITIVE),
            head_dim=None if mla else read.optional("head_dim", POSITIVE),
            ffn_hidden_size=ffn if ffn is not None else moe_ffn,
            moe_ffn_hidden_size=moe_ffn,
            num_experts=num_experts,
            top_k=read.get("num_experts_per_tok", POSITIVE),
            shared_experts=shared,
            first_k_dense=first_k,
            moe_layer_freq=freq,
            vocab_size=read.get("vocab_size", POSITIVE),
            seq_len=seq_len,
            micro_batch_size=micro_batch_size,
            dtype_bytes=_dtype_bytes(where, cfg),
            q_lora_rank=read.optional("q_lora_rank", POSITIVE) if mla else None,
            kv_lora_rank=read.optional("kv_lora_rank", POSITIVE),
            qk_rope_head_dim=read.optional("qk_rope_head_dim", POSITIVE) if mla else None,
            qk_nope_head_dim=read.optional("qk_nope_head_dim", POSITIVE) if mla else None,
            v_head_dim=read.optional("v_head_dim", POSITIVE) if mla else None,
        )
        made = [spec.is_moe(layer) for layer in range(layers)]
        if made != pattern:
            raise _pattern_error(where, cfg, pattern)
        return spec

    @classmethod
    def preset(cls, name: str, *, seq_len: int = 4096, micro_batch_size: int = 1) -> "ModelSpec":
        """A published model's spec, from its public configuration: one of
        :data:`PRESETS`."""
        where = "ModelSpec.preset"
        name = check_arg(
            where,
            "name",
            name,
            OneOf(PRESETS, hint="or build a ModelSpec"),
        )
        return ModelSpec(
            name=name, seq_len=seq_len, micro_batch_size=micro_batch_size, **MODEL_PRESETS[name]
        )


# --------------------------------------------------------------------------- fields

_NAME: Spec[str] = Instance(str, "a string")
_OPT_POSITIVE: Spec[int | None] = Opt(POSITIVE)

_FIELDS: dict[str, Spec[object]] = {
    "name": _NAME,
    "num_layers": POSITIVE,
    "hidden_size": POSITIVE,
    "num_attention_heads": POSITIVE,
    "num_kv_heads": _OPT_POSITIVE,
    "head_dim": _OPT_POSITIVE,
    "ffn_hidden_size": POSITIVE,
    "moe_ffn_hidden_size": POSITIVE,
    "num_experts": POSITIVE,
    "top_k": POSITIVE,
    "shared_experts": NON_NEGATIVE,
    "first_k_dense": NON_NEGATIVE,
    "moe_layer_freq": POSITIVE,
    "vocab_size": POSITIVE,
    "seq_len": POSITIVE,
    "micro_batch_size": POSITIVE,
    "dtype_bytes": OneOf((1, 2, 4), hint="1 for fp8, 2 for bf16/fp16, 4 for fp32"),
    "q_lora_rank": _OPT_POSITIVE,
    "kv_lora_rank": _OPT_POSITIVE,
    "qk_rope_head_dim": _OPT_POSITIVE,
    "qk_nope_head_dim": _OPT_POSITIVE,
    "v_head_dim": _OPT_POSITIVE,
}


# ----------------------------------------------------------------- config reading

_ABSENT = object()


def _as_mapping(where: str, what: str, value: object) -> Mapping[str, object]:
    if isinstance(value, Mapping):
        return cast(Mapping[str, object], value)
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        out: object = to_dict()
        if isinstance(out, Mapping):
            return cast(Mapping[str, object], out)
    raise refuse(
        f"{where}: {what}",
        "a mapping or an object with to_dict() (a transformers PretrainedConfig)",
        value,
    )


class _Reader:
    """Reads keys of a configuration mapping, naming the key in errors."""

    def __init__(self, where: str, cfg: Mapping[str, object]) -> None:
        self.where = where
        self.cfg = cfg
        self.first_key = ""

    def check(self, key: str, value: object, spec: Spec[int]) -> int:
        return check_arg(self.where, f"config[{key!r}]", value, spec)

    def missing(self, keys: str) -> ConfigError:
        return ConfigError(
            f"{self.where}: config has no {keys} (model_type {self.cfg.get('model_type')!r}); "
            "pass a ModelSpec built by hand"
        )

    def get(self, key: str, spec: Spec[int]) -> int:
        value = self.cfg.get(key, _ABSENT)
        if value is _ABSENT or value is None:
            raise self.missing(repr(key))
        return self.check(key, value, spec)

    def optional(self, key: str, spec: Spec[int]) -> int | None:
        value = self.cfg.get(key)
        return None if value is None else self.check(key, value, spec)

    def first(self, keys: tuple[str, ...]) -> object:
        for key in keys:
            value = self.cfg.get(key)
            if value is not None:
                self.first_key = key
                return value
        return None


_LAYER_LIST = Items(NON_NEGATIVE, expects="a list of layer indices (ints >= 0)")


def _moe_pattern(read: _Reader, layers: int) -> list[bool]:
    """Which layers the configuration makes MoE, by DeepSeek's rule (``first_k_dense_replace``,
    ``moe_layer_freq``) and Qwen's (``mlp_only_layers``, ``decoder_sparse_step``) together:
    each family's keys default to "every layer"."""
    k0 = read.optional("first_k_dense_replace", NON_NEGATIVE) or 0
    freq = read.optional("moe_layer_freq", POSITIVE) or 1
    step = read.optional("decoder_sparse_step", POSITIVE) or 1
    raw = read.cfg.get("mlp_only_layers")
    only: set[int] = set()
    if raw is not None:
        only = set(check_arg(read.where, "config['mlp_only_layers']", raw, _LAYER_LIST))
    return [
        layer >= k0 and layer % freq == 0 and layer not in only and (layer + 1) % step == 0
        for layer in range(layers)
    ]


def _prefix_and_step(where: str, pattern: list[bool], layers: int) -> tuple[int, int]:
    """``(first_k_dense, moe_layer_freq)`` that may reproduce ``pattern`` (the caller
    compares); a ConfigError when no layer is MoE."""
    moe = [layer for layer, is_moe in enumerate(pattern) if is_moe]
    if not moe:
        raise ConfigError(
            f"{where}: not a mixture-of-experts config: none of its {layers} layers is MoE "
            "(first_k_dense_replace, moe_layer_freq, decoder_sparse_step or mlp_only_layers "
            "leave every layer dense); pass a ModelSpec for anything else"
        )
    step = moe[1] - moe[0] if len(moe) > 1 else 1
    return max(0, moe[0] - step + 1), step


def _pattern_error(where: str, cfg: Mapping[str, object], pattern: list[bool]) -> MoeOverlapError:
    only = cfg.get("mlp_only_layers")
    if only:
        return refuse(
            f"{where}: config['mlp_only_layers']",
            "empty or a dense prefix [0, ..., k-1] (ModelSpec expresses a dense prefix, then "
            "every k-th layer MoE)",
            only,
            hint="pass a ModelSpec",
        )
    return ConfigError(
        f"{where}: config's MoE layers {_listed(pattern)} are not a dense prefix then every "
        "k-th layer (what ModelSpec expresses); pass a ModelSpec"
    )


def _listed(pattern: list[bool]) -> str:
    moe = [layer for layer, is_moe in enumerate(pattern) if is_moe]
    return str(moe) if len(moe) <= 8 else f"[{', '.join(map(str, moe[:8]))}, ...]"


def _default_name(cfg: Mapping[str, object]) -> str:
    for key in ("_name_or_path", "model_type"):
        value = cfg.get(key)
        if isinstance(value, str) and value:
            return value
    return "model"


_DTYPE_BYTES = {
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "float32": 4,
    "float": 4,
}


def _dtype_bytes(where: str, cfg: Mapping[str, object]) -> int:
    key = "dtype" if cfg.get("dtype") is not None else "torch_dtype"
    value = cfg.get(key)
    if value is None or value == "auto":
        return 2
    if isinstance(value, torch.dtype):
        value = str(value)
    if isinstance(value, str):
        size = _DTYPE_BYTES.get(value.removeprefix("torch."))
        if size is not None:
            return size
    raise refuse(
        f"{where}: config[{key!r}]",
        f"a dtype among {sorted(_DTYPE_BYTES)} (or 'auto', None)",
        value,
        hint="or build a ModelSpec with dtype_bytes",
    )


PRESETS: tuple[str, ...] = tuple(MODEL_PRESETS)
"""The names :meth:`ModelSpec.preset` knows."""
