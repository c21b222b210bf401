"""On CUDA in bf16: torchtitan's DeepSeek-V3 ``debugmodel`` (all 6 blocks, torchtitan's real
flex attention) through ``TorchtitanMoEAdapter``, as built, under torchtitan's
``SelectiveAC`` and with one MTP layer: ``combined_1f1b`` serial, overlapped and
fill/drain, with and without delayed weight gradients, bit-identical to the adapter's
plain path (losses, gradients, ``tokens_per_expert_E``).

Flex attention is compiled without torchtitan's max-autotune (``compile_flex``: the
same kernels, default configs). Deterministic settings (``torch.use_deterministic_algorithms``), real compute and comm
streams. Skipped without a GPU or without an importable torchtitan. On a torch older than
torchtitan 0.3.0 wants (the H200 image's 2.11), ``benchmarks/titan_compat.py`` adds
placeholders for the names it lacks, as the benchmark does.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import sys
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from torch import Tensor, nn

from moe_overlap import Microbatch, StreamPair, combined_1f1b, make_streams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MICROBATCHES, BATCH, SEQ = 4, 2, 256


VARIANTS = ("blocks", "selective_ac", "mtp")
"""The registry's model as built; with torchtitan's ``SelectiveAC`` applied; built with
``num_mtp_layers=1``."""


@pytest.fixture(scope="module")
def titan_ready() -> None:
    try:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
        compat: Any = importlib.import_module("titan_compat")
        compat.import_torchtitan()
        compat.compile_flex(autotune=False)  # torchtitan's max-autotune: minutes per shape
    except ImportError as exc:
        pytest.skip(f"torchtitan does not import: {exc}")


@pytest.fixture(scope="module", params=VARIANTS)
def base(request: pytest.FixtureRequest, titan_ready: None) -> nn.Module:
    del titan_ready
    variant = str(request.param)
    deepseek_v3: Any = importlib.import_module("torchtitan.models.deepseek_v3")
    mtp = 1 if variant == "mtp" else 0
    config = deepseek_v3.model_registry("debugmodel", num_mtp_layers=mtp).model
    config = dataclasses.replace(config, layers=list(config.layers))
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = cast(nn.Module, config.build())
    cast(Any, model).init_states(buffer_device=torch.device("cuda"))
    for p in model.parameters():  # buffers stay: the RoPE cache is complex
        p.data = p.data.to(torch.bfloat16)
    if variant == "selective_ac":
        from torchtitan.distributed.activation_checkpoint import SelectiveAC

        SelectiveAC(SelectiveAC.Config()).apply(model)
    return model


def _microbatches(model: nn.Module) -> list[Microbatch]:
    g = torch.Generator().manual_seed(1)
    vocab = int(cast(Any, model).config.vocab_size)
    out = []
    for _ in range(MICROBATCHES):
        ids = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g).cuda()
        out.append(
            Microbatch(
                input_ids=ids[:, :-1].contiguous(),
                labels=ids[:, 1:].contiguous(),
                position_ids=torch.arange(SEQ, device="cuda").expand(BATCH, SEQ).contiguous(),
            )
        )
    return out


def _state(model: nn.Module) -> dict[str, Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    out |= {n: b.clone() for n, b in model.named_buffers() if n.endswith("tokens_per_expert_E")}
    return out


def _run(base: nn.Module, kind: str, delay: bool) -> tuple[list[Tensor], dict[str, Tensor]]:
    from moe_overlap.adapters.torchtitan import TorchtitanMoEAdapter
    from moe_overlap.blocks import finish_wgrad

    model = copy.deepcopy(base)
    adapter = TorchtitanMoEAdapter(model, delay_wgrad_compute=delay, self_check=kind == "plain")
    mbs = _microbatches(model)
    if kind == "plain":
        losses = []
        for mb in mbs:
            assert mb.input_ids is not None
            loss = adapter.forward(mb.input_ids, mb.position_ids, labels=mb.labels)
            torch.autograd.backward(loss)
            if delay:
                finish_wgrad(model)
            losses.append(loss.detach())
    else:
        pair = make_streams(torch.device("cuda"))
        losses = combined_1f1b(
            adapter,
            mbs,
            overlap=kind != "serial",
            fill_drain=kind == "fill_drain",
            streams=pair if kind != "serial" else StreamPair(comp=pair.comp, comm=pair.comp),
            options=adapter.schedule_options(),
        )
    torch.cuda.synchronize()
    return losses, _state(model)


@pytest.mark.parametrize("delay", [False, True], ids=["wgrad", "delayed_wgrad"])
def test_bf16_flex_schedule_is_bit_identical_to_plain(base: nn.Module, delay: bool) -> None:
    found = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        plain_losses, plain = _run(base, "plain", delay)
        assert all(torch.isfinite(x) for x in plain_losses)
        for kind in ("serial", "overlapped", "fill_drain"):
            losses, got = _run(base, kind, delay)
            where = f"{kind} (delay_wgrad_compute={delay}) vs plain"
            assert all(torch.equal(a, b) for a, b in zip(losses, plain_losses, strict=True)), (
                f"{where}: losses {losses} vs {plain_losses}"
            )
            assert got.keys() == plain.keys(), where
            differ = [k for k in plain if not torch.equal(got[k], plain[k])]
            assert not differ, f"{where}: {len(differ)} of {len(plain)} differ: {differ[:5]}"
    finally:
        torch.use_deterministic_algorithms(found)  # as found: the suite's fixture turns it on


def _own(base: nn.Module) -> tuple[list[Tensor], dict[str, Tensor]]:
    """torchtitan's own forward and ``backward()`` per microbatch (no adapter), with the
    adapter's default loss (torchtitan's ``cross_entropy_loss`` over the labelled tokens)."""
    from torchtitan.components.loss import cross_entropy_loss

    model = copy.deepcopy(base)
    losses = []
    for mb in _microbatches(model):
        assert mb.labels is not None
        # As torchtitan's trainer: the flex attention masks built from the positions.
        masks = cast(Any, model).get_attention_masks(mb.position_ids)
        logits = model(mb.input_ids, attention_masks=masks, positions=mb.position_ids)
        loss = cross_entropy_loss(logits, mb.labels) / (mb.labels != -100).sum()
        torch.autograd.backward(loss)
        losses.append(loss.detach())
    torch.cuda.synchronize()
    return losses, _state(model)


def test_bf16_flex_schedule_is_bit_identical_to_torchtitans_own(base: nn.Module) -> None:
    """The overlapped schedule against torchtitan's own model (not the adapter's plain
    path), bf16 and flex attention on the GPU, deterministic algorithms: losses, gradients
    and token counts bit for bit (MTP: its own loss is ``MTPLoss``, compared on CPU by
    ``tests/adapters/test_torchtitan_mtp.py``)."""
    if any(n.startswith("mtp_layers.") for n, _ in base.named_parameters()):
        pytest.skip("MTP trains with MTPLoss, not the plain cross-entropy")
    found = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        own_losses, own = _own(base)
        losses, got = _run(base, "overlapped", False)
        assert all(torch.equal(a, b) for a, b in zip(losses, own_losses, strict=True)), (
            f"losses {losses} vs torchtitan's {own_losses}"
        )
        assert got.keys() == own.keys()
        differ = {
            k: float((got[k].float() - own[k].float()).abs().max())
            for k in own
            if not torch.equal(got[k], own[k])
        }
        assert not differ, f"{len(differ)} of {len(own)} differ from torchtitan's: {differ}"
    finally:
        torch.use_deterministic_algorithms(found)
