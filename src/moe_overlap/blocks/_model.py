"""``PreprocessableModel``'s two Megatron-named hooks, on top of what a model defines.

Megatron-Core's ``GPTModel._preprocess`` / ``_postprocess`` take 6 and 19 parameters; the
schedule calls them by those names. :class:`MegatronHooks` implements both once: a model
says how it embeds token ids (:meth:`~MegatronHooks.embed`), which rotary tables it uses
(:meth:`~MegatronHooks.rotary`) and what it computes from the last hidden states
(:meth:`~MegatronHooks.output`: the loss with labels, usually the logits without).
"""

# No ``from __future__ import annotations``: the NamedTuple's field types must be real objects
# at run time for debug mode's checks.

from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple, Protocol, cast

from torch import Tensor

from moe_overlap import (
    ChunkState,
    ConfigError,
    IntegrationError,
    Microbatch,
    PreprocessOutput,
    ScheduleOptions,
)
from moe_overlap.inputs import check_inputs

__all__ = ["MegatronHooks", "Rotary"]


class Rotary(NamedTuple):
    """The rotary tables a model hands its layers (through the chunk state); all optional."""

    emb: Tensor | None = None
    cos: Tensor | None = None
    sin: Tensor | None = None


class StageRange:
    """Mixin: a pipeline stage's place, layers ``layers_range`` of a model's ``n``.

    ``pre_process`` when the range starts at 0, ``post_process`` when it ends at ``n``;
    the two stage flags :class:`~moe_overlap.PreprocessableModel` asks for. A stage
    without layers passes its input on (between two stages only).
    """

    layers_range: range

    def set_range(self, layers: range, n: int, where: str) -> None:
        """Check ``layers`` (``range(a, b)``, ``0 <= a <= b <= n``; ``a < b`` where
        ``a == 0`` or ``b == n``) and keep it."""
        if not isinstance(cast(object, layers), range) or layers.step != 1:
            raise ConfigError(f"{where}: expected layers as range(a, b), received {layers!r}")
        if not 0 <= layers.start <= layers.stop <= n:
            raise ConfigError(
                f"{where}: expected layers as range(a, b) with 0 <= a <= b <= {n} (the "
                f"model's layers), received {layers!r}"
            )
        if not layers and layers.start in (0, n):
            first = layers.start == 0
            held = "the embedding" if first else "the final norm and output layer"
            flag, layer = ("pre_process", 0) if first else ("post_process", n - 1)
            raise ConfigError(
                f"{where}: expected layers as range(a, b) with a < b at either end of the "
                f"model (range(0, b), range(a, {n})), received {layers!r}: a stage without "
                f"layers there would hold {held}, as the stage of layer {layer} does (both "
                f"{flag}); give the stage at least one layer"
            )
        self.layers_range = layers
        self._stage_n = n

    @property
    def pre_process(self) -> bool:
        return self.layers_range.start == 0

    @property
    def post_process(self) -> bool:
        return self.layers_range.stop == self._stage_n

    def extra_repr(self) -> str:
        r = self.layers_range
        held = f"{r.start}..{r.stop - 1}" if r else f"none (at {r.start})"
        return f"layers={held}, pre_process={self.pre_process}, post_process={self.post_process}"


class PlainLayer(Protocol):
    """A layer with a plain path (the slots' operations without a schedule)."""

    def run_plain(self, x: Tensor, chunk_state: ChunkState) -> Tensor: ...


class MegatronHooks:
    """Mixin: ``_preprocess`` and ``_postprocess`` with Megatron-Core's names and checks.

    Mix it into the model class (``class MyModel(MegatronHooks, nn.Module)``) and define
    :meth:`output`, plus :meth:`embed` when the model takes token ids and :meth:`rotary`
    when its layers read rotary tables. ``_preprocess`` refuses packed sequences and a call
    with neither ``input_ids`` nor ``decoder_input`` (:class:`~moe_overlap.ConfigError`);
    on a later pipeline stage the schedule passes ``decoder.input_tensor`` as
    ``decoder_input`` and nothing is embedded.
    """

    def plain_forward(
        self,
        x: Tensor,
        position_ids: Tensor | None = None,
        *,
        labels: Tensor | None = None,
        loss_mask: Tensor | None = None,
        attention_mask: Tensor | None = None,
        padding_mask: Tensor | None = None,
    ) -> Tensor:
        """The chunk without a schedule: ``_preprocess``, each layer's ``run_plain``, then
        ``_postprocess`` (the loss with ``labels``, else usually the logits).

        ``x`` is the token ids when the model has ``pre_process`` (a first pipeline
        stage or a whole model), else the hidden states from the previous stage; without
        ``post_process`` the last layer's hidden states are returned. The inputs are
        checked as a plan checks them (:func:`~moe_overlap.inputs.check_inputs`): one the model
        does not read is a :class:`~moe_overlap.ConfigError` here too.
        """
        pre_process = bool(getattr(self, "pre_process", True))
        post_process = bool(getattr(self, "post_process", True))
        input_ids = x if pre_process else None
        cs = ChunkState(
            Microbatch(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=attention_mask,
                decoder_input=None if pre_process else x,
                labels=labels,
                loss_mask=loss_mask,
                padding_mask=padding_mask,
            )
        )
        check_inputs(self, cs, where=f"{type(self).__name__}.plain_forward", what="argument")
        if pre_process:
            pre = self._preprocess(x, position_ids, padding_mask=padding_mask)
        else:
            pre = self._preprocess(None, position_ids, decoder_input=x, padding_mask=padding_mask)
        cs.set_preprocess_output(pre)
        decoder: object = getattr(self, "decoder", None)
        layers = cast("Iterable[object]", getattr(decoder, "layers", ()))
        h = pre.decoder_input
        for i, layer in enumerate(layers):
            run = getattr(layer, "run_plain", None)
            if not callable(run):
                raise IntegrationError(
                    f"{type(self).__name__}.plain_forward: decoder.layers[{i}] "
                    f"({type(layer).__name__}): expected a run_plain(x, chunk_state) method "
                    "(the layer's slots without a schedule), received a layer without it; mix "
                    "in blocks.MoESlots or blocks.DenseSlots, or define it"
                )
            h = cast("PlainLayer", layer).run_plain(h, cs)
        if not post_process:
            return h
        return self._postprocess(
            h,
            input_ids,
            position_ids,
            labels,
            pre.rotary_pos_emb,
            pre.rotary_pos_cos,
            pre.rotary_pos_sin,
            loss_mask=loss_mask,
            decoder_input=pre.decoder_input,
            attention_mask=attention_mask,
        )

    def embed(self, input_ids: Tensor) -> Tensor:
        """The decoder input for ``input_ids`` (the token embedding)."""
        raise IntegrationError(
            f"{type(self).__name__}.embed: expected the model to define embed(input_ids) "
            "to take token ids, or to be given decoder_input"
        )

    def embed_at(self, input_ids: Tensor, position_ids: Tensor | None) -> Tensor:
        """:meth:`embed` for a model whose embedding also reads the positions (the default
        ignores them)."""
        del position_ids
        return self.embed(input_ids)

    def rotary(self, decoder_input: Tensor, position_ids: Tensor | None) -> Rotary:
        """Rotary tables for ``position_ids`` (``None``: the model's default positions)."""
        del decoder_input, position_ids
        return Rotary()

    def schedule_options(
        self, *, free_input: bool = True, ep_overlap_early_attn_memory_release: bool = False
    ) -> ScheduleOptions:
        """Schedule options matching this model (``delay_wgrad_compute`` from its config)."""
        config: object = getattr(self, "config", None)
        delay: object = getattr(config, "delay_wgrad_compute", None)
        return ScheduleOptions(
            delay_wgrad_compute=delay if isinstance(delay, bool) else None,
            free_input=free_input,
            ep_overlap_early_attn_memory_release=ep_overlap_early_attn_memory_release,
        )

    def on_microbatch(self, decoder_input: Tensor) -> None:
        """Called once per microbatch before the rotary tables (checks, per-step state)."""
        del decoder_input

    def output(
        self, hidden_states: Tensor, labels: Tensor | None, loss_mask: Tensor | None
    ) -> Tensor:
        """What the last layer's hidden states become: the scalar loss with ``labels``."""
        raise IntegrationError(
            f"{type(self).__name__}.output: expected the model to define "
            "output(hidden_states, labels, loss_mask) returning the loss"
        )

    def _preprocess(
        self,
        input_ids: Tensor | None,
        position_ids: Tensor | None,
        *,
        decoder_input: Tensor | None = None,
        packed_seq_params: object | None = None,
        padding_mask: Tensor | None = None,
    ) -> PreprocessOutput:
        """Embedding (unless given ``decoder_input``) and rotary tables."""
        name = type(self).__name__
        if packed_seq_params is not None:
            raise ConfigError(
                f"{name}._preprocess: packed sequences are not supported; expected "
                f"packed_seq_params=None, received {type(packed_seq_params).__name__}"
            )
        if decoder_input is None:
            if input_ids is None:
                raise ConfigError(
                    f"{name}._preprocess: expected input_ids or decoder_input, received neither"
                )
            decoder_input = self.embed_at(input_ids, position_ids)
        self.on_microbatch(decoder_input)
        rot = self.rotary(decoder_input, position_ids)
        return PreprocessOutput(decoder_input, rot.emb, rot.cos, rot.sin, None, padding_mask)

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
        """:meth:`output` of the hidden states; the other keywords are Megatron's, unused."""
        return self.output(hidden_states, labels, loss_mask)
