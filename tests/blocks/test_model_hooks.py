"""MegatronHooks: the Megatron-named _preprocess / _postprocess on top of embed / rotary / output."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

from moe_overlap import (
    ConfigError,
    IntegrationError,
    Microbatch,
    WgradLayer,
    WgradScope,
    combined_1f1b,
)
from moe_overlap.blocks import DenseSlots, MegatronHooks, Rotary, SlotContext
from tests.engine.test_parity import assert_same
from tests.engine.toy_model import (
    ToyConfig,
    ToyDecoder,
    ToyLayer,
    grads,
    make_microbatches,
    rms_norm,
)

CONFIG = ToyConfig()


class HookedModel(MegatronHooks, nn.Module):
    """The toy model's layers behind MegatronHooks instead of hand-written hooks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.config = CONFIG
        self.pre_process = True
        self.post_process = True
        self.embedding = nn.Embedding(CONFIG.vocab, CONFIG.hidden)
        self.decoder = ToyDecoder([ToyLayer(CONFIG, moe=False), ToyLayer(CONFIG, moe=True)])
        self.head = nn.Linear(CONFIG.hidden, CONFIG.vocab, bias=False)
        self.seen: list[int] = []

    def embed(self, input_ids: Tensor) -> Tensor:
        out: Tensor = self.embedding(input_ids)
        return out

    def on_microbatch(self, decoder_input: Tensor) -> None:
        self.seen.append(decoder_input.shape[0])

    def rotary(self, decoder_input: Tensor, position_ids: Tensor | None) -> Rotary:
        if position_ids is None:
            return Rotary()
        freqs = torch.arange(1, CONFIG.hidden + 1) * 0.37
        return Rotary(emb=torch.sin(position_ids[0].float().unsqueeze(-1) * freqs))

    def output(
        self, hidden_states: Tensor, labels: Tensor | None, loss_mask: Tensor | None
    ) -> Tensor:
        logits: Tensor = self.head(rms_norm(hidden_states))
        if labels is None:
            return logits
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())

    def forward(self, mb: Microbatch) -> Tensor:
        pre = self._preprocess(mb.input_ids, mb.position_ids)
        h = pre.decoder_input
        for layer in self.decoder.layers:
            assert isinstance(layer, ToyLayer)
            h = layer(h, pre.rotary_pos_emb)
        return self._postprocess(h, mb.input_ids, mb.position_ids, mb.labels, None, None, None)


def test_the_schedule_through_the_hooks_is_bit_identical() -> None:
    ref = HookedModel()
    model = copy.deepcopy(ref)
    mbs = make_microbatches(3, CONFIG)
    ref_losses = []
    for mb in mbs:
        loss = ref(mb)
        loss.backward()
        ref_losses.append(loss.detach())
    losses = combined_1f1b(model, mbs)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True))
    assert_same(grads(model), grads(ref))
    assert model.seen == [2, 2, 2]  # on_microbatch once per microbatch


def test_preprocess_passes_decoder_input_and_fills_rotary() -> None:
    model = HookedModel()
    x = torch.randn(2, 8, CONFIG.hidden)
    pos = torch.arange(8).expand(2, 8)
    out = model._preprocess(None, pos, decoder_input=x)
    assert out.decoder_input is x
    assert out.rotary_pos_emb is not None and out.rotary_pos_cos is None
    logits = model._postprocess(x, None, None, None, None, None, None)
    assert logits.shape == (2, 8, CONFIG.vocab)


def test_preprocess_refuses_what_it_cannot_do() -> None:
    model = HookedModel()
    with pytest.raises(ConfigError, match=r"HookedModel\._preprocess: expected input_ids or "):
        model._preprocess(None, None)
    with pytest.raises(ConfigError, match=r"packed sequences are not supported.*received object"):
        model._preprocess(torch.zeros(1, 2, dtype=torch.long), None, packed_seq_params=object())


def test_undefined_embed_and_output_name_the_method() -> None:
    class Bare(MegatronHooks):
        pass

    with pytest.raises(IntegrationError, match=r"Bare\.embed: expected the model to define embed"):
        Bare()._preprocess(torch.zeros(1, 2, dtype=torch.long), None)
    with pytest.raises(
        IntegrationError, match=r"Bare\.output: expected the model to define output"
    ):
        Bare()._postprocess(torch.zeros(1), None, None, None, None, None, None)


# --- issue 24, part wgrad: DenseSlots' plain path ---------------------------------------------


class _DenseToy(DenseSlots, nn.Module):
    """A dense layer on DenseSlots: its two slots, nothing else."""

    config = CONFIG

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(CONFIG.hidden, CONFIG.hidden, bias=False)

    def slot_pre_dispatch(self, node: SlotContext, inputs: tuple[Tensor, ...], /) -> Tensor:
        (x,) = inputs
        return x + torch.tanh(self.proj(rms_norm(x)))

    def slot_mlp(self, node: SlotContext, inputs: tuple[Tensor, ...], /) -> tuple[Tensor, ...]:
        (h,) = inputs
        return (h * 2.0,)  # a 1-tuple: the layer's output

    def pre_dispatch_wgrad(self) -> list[WgradScope]:
        return []

    def mlp_wgrad(self) -> list[WgradLayer]:
        return []


class _PlainHooked(HookedModel):
    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.decoder.layers = nn.ModuleList(layers)

    def forward(self, mb: Microbatch) -> Tensor:
        assert mb.input_ids is not None
        return self.plain_forward(mb.input_ids, mb.position_ids, labels=mb.labels)


def test_dense_slots_run_plain_is_the_schedules_two_slots() -> None:
    """plain_forward over DenseSlots layers equals the schedule bit for bit."""
    model = _PlainHooked([_DenseToy(), _DenseToy()])
    ref = copy.deepcopy(model)
    mbs = make_microbatches(3, CONFIG, seed=3)
    for mb in mbs:
        ref(mb).backward()
    combined_1f1b(model, mbs)
    assert_same(grads(model), grads(ref))


def test_a_layer_without_run_plain_is_named() -> None:
    """A layer without a plain path, or DenseSlots without its slots: the library's error."""
    mb = make_microbatches(1, CONFIG)[0]
    toy = _PlainHooked([ToyLayer(CONFIG, moe=False)])  # slots, but no run_plain
    with pytest.raises(
        IntegrationError,
        match=r"_PlainHooked\.plain_forward: decoder\.layers\[0\] \(ToyLayer\): expected a "
        r"run_plain\(x, chunk_state\) method .* mix in blocks\.MoESlots or blocks\.DenseSlots",
    ):
        toy(mb)

    class NoMlp(DenseSlots, nn.Module):
        def slot_pre_dispatch(self, node: SlotContext, inputs: tuple[Tensor, ...], /) -> Tensor:
            return inputs[0]

    with pytest.raises(
        IntegrationError,
        match=r"NoMlp\.run_plain: DenseSlots runs the layer's slot_pre_dispatch then its "
        r"slot_mlp .*without \['slot_mlp'\]",
    ):
        _PlainHooked([NoMlp()])(mb)

    class TwoOutputs(_DenseToy):
        def slot_mlp(self, node: SlotContext, inputs: tuple[Tensor, ...], /) -> tuple[Tensor, ...]:
            return inputs[0], inputs[0]

    with pytest.raises(IntegrationError, match=r"TwoOutputs\.run_plain: .*received a tuple of 2"):
        _PlainHooked([TwoOutputs()])(mb)
