"""On CUDA in bf16, Megatron-Core unpatched: a ``GPTModel`` (local spec, a dense layer then
MoE layers with shared experts, all-to-all dispatcher) through ``MegatronMoEAdapter``:
``combined_1f1b`` serial, overlapped, fill/drain and with recomputed slots on real compute
and comm streams, bit-identical to the same model's own forward and ``backward()``
(deterministic algorithms). Skipped without a GPU or without an importable Megatron-Core.
"""

from __future__ import annotations

import dataclasses
import importlib
import socket
from collections.abc import Iterator
from typing import Any, Literal, cast

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe_overlap import Microbatch, ScheduleOptions, StreamPair, combined_1f1b, make_streams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
    pytest.mark.filterwarnings("ignore::FutureWarning:megatron"),
]

MICROBATCHES, BATCH, SEQ, VOCAB = 4, 2, 256, 512


@pytest.fixture(scope="module")
def parallel_state() -> Iterator[Any]:
    """Megatron-Core's model-parallel state on one rank (TP = PP = EP = 1), put back after."""
    try:
        ps: Any = importlib.import_module("megatron.core.parallel_state")
    except ImportError as exc:
        pytest.skip(f"Megatron-Core does not import: {exc}")
    started = not dist.is_initialized()
    if started:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    try:
        yield ps
    finally:
        ps.destroy_model_parallel()
        if started:
            dist.destroy_process_group()


def _build(seed: int = 0) -> nn.Module:
    specs: Any = importlib.import_module("megatron.core.models.gpt.gpt_layer_specs")
    gpt: Any = importlib.import_module("megatron.core.models.gpt.gpt_model")
    tc: Any = importlib.import_module("megatron.core.transformer.transformer_config")
    rnd: Any = importlib.import_module("megatron.core.tensor_parallel.random")
    config = tc.TransformerConfig(
        num_layers=4,
        hidden_size=256,
        num_attention_heads=8,
        ffn_hidden_size=512,
        num_moe_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=256,
        moe_shared_expert_intermediate_size=256,
        moe_layer_freq=[0, 1, 1, 1],
        moe_token_dispatcher_type="alltoall",
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
    )
    torch.manual_seed(seed)
    rnd.model_parallel_cuda_manual_seed(seed)
    model: nn.Module = gpt.GPTModel(
        config=config,
        transformer_layer_spec=specs.get_gpt_decoder_block_spec(
            config, use_transformer_engine=False
        ),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
    )
    # Megatron-Core keeps the local norms' weights in fp32 under params_dtype=bf16 and
    # casts the whole model in its Float16Module; CUDA's layer_norm takes no mixed dtypes.
    return model.to(device="cuda", dtype=torch.bfloat16)


def _pair() -> tuple[nn.Module, nn.Module]:
    """Two models with the same weights (the second loads the first's state dict)."""
    model, ref = _build(), _build()
    ref.load_state_dict(model.state_dict())
    return model, ref


def _microbatches() -> list[Microbatch]:
    g = torch.Generator().manual_seed(1)
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool, device="cuda").triu(1)
    mask = causal.expand(BATCH, 1, SEQ, SEQ)
    out = []
    for _ in range(MICROBATCHES):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g).cuda()
        out.append(
            Microbatch(
                input_ids=ids[:, :-1].contiguous(),
                labels=ids[:, 1:].contiguous(),
                position_ids=torch.arange(SEQ, device="cuda").expand(BATCH, SEQ).contiguous(),
                attention_mask=mask,
            )
        )
    return out


def _own(model: nn.Module, mbs: list[Microbatch]) -> list[Tensor]:
    """The model's own forward (per-token loss) and ``backward()``, the adapter's default
    loss (the mean over the tokens)."""
    losses = []
    for mb in mbs:
        per_token = model(mb.input_ids, mb.position_ids, mb.attention_mask, labels=mb.labels)
        loss = per_token.float().sum() / per_token.numel()
        loss.backward()
        losses.append(loss.detach())
    torch.cuda.synchronize()
    return losses


@pytest.mark.parametrize("kind", ["serial", "overlapped", "fill_drain", "recompute"])
def test_bf16_schedule_is_bit_identical_to_megatron_s_own(parallel_state: Any, kind: str) -> None:
    from moe_overlap.adapters.megatron import MegatronMoEAdapter

    del parallel_state
    found = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        model, ref = _pair()
        adapter = MegatronMoEAdapter(model)
        mbs = _microbatches()
        want = _own(ref, mbs)
        pair = make_streams(torch.device("cuda"))
        recompute: tuple[Literal["pre_dispatch", "mlp"], ...] = (
            ("pre_dispatch", "mlp") if kind == "recompute" else ()
        )
        got = combined_1f1b(
            adapter,
            mbs,
            overlap=kind != "serial",
            fill_drain=kind == "fill_drain",
            streams=pair if kind != "serial" else StreamPair(comp=pair.comp, comm=pair.comp),
            options=ScheduleOptions(free_input=False, recompute=recompute),
        )
        torch.cuda.synchronize()
        assert all(torch.isfinite(x) for x in want)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), (got, want)
        ref_grads = dict(ref.named_parameters())
        differ = {
            n: float((p.grad.float() - g.float()).abs().max())
            for n, p in model.named_parameters()
            if p.grad is not None
            and (g := ref_grads[n].grad) is not None
            and not torch.equal(p.grad, g)
        }
        missing = [n for n, p in model.named_parameters() if p.grad is None]
        assert not missing, f"no gradient: {missing}"
        assert not differ, f"{kind}: {len(differ)} gradients differ from Megatron's own: {differ}"
    finally:
        torch.use_deterministic_algorithms(found)


def test_dualpipev_on_one_gpu_is_bit_identical() -> None:
    """What Megatron-Core's overlap does not run, on its model: DualPipeV (two stages of one
    rank, bf16, unpatched) prepared by ``prepare_schedule``, against torch's own run of the
    same schedule and of the raw ``GPTModel`` chunks (:mod:`tests.adapters.megatron_pp_worker`)."""
    import json

    pytest.importorskip("megatron.core", reason="Megatron-Core is not installed")
    from tests.gloo_ranks import run_ranks

    (row,) = run_ranks(
        "tests.adapters.megatron_pp_worker",
        world=1,
        timeout=300,
        env={
            "MEGATRON_PP_SCHEDULES": json.dumps(["DualPipeV"]),
            "MEGATRON_PP_DEVICE": "cuda",
            "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
            "PYTHONWARNINGS": "ignore",
        },
    )
    assert row["bit_identical"], row  # prepared schedule vs torch's execution of it
    assert row["vs_megatron_ok"], row  # vs torch's execution of the raw GPTModel chunks
    assert row["pending"] == 0 and int(str(row["grads"])) > 0, row
    assert len(cast("list[float]", row["losses"])) == 4, row


def _on_cuda(mb: Microbatch) -> Microbatch:
    """``mb`` with every tensor field on the GPU."""
    moved: dict[str, Any] = {
        f.name: v.cuda()
        for f in dataclasses.fields(mb)
        if isinstance(v := getattr(mb, f.name), Tensor)
    }
    return dataclasses.replace(mb, **moved)


@pytest.mark.parametrize("kind", ["overlapped", "fill_drain"])
def test_bf16_hybrid_model_is_bit_identical_to_its_own(parallel_state: Any, kind: str) -> None:
    """A ``HybridModel`` (attention, MoE, MLP, MoE layers from Megatron-Core's local modules;
    :mod:`tests.adapters.test_megatron_hybrid`'s builder) on CUDA in bf16, unpatched, against
    its own forward and ``backward()``."""
    from moe_overlap.adapters.megatron import MegatronMoEAdapter
    from tests.adapters._megatron import megatron_step
    from tests.adapters.test_megatron_hybrid import build, microbatches

    del parallel_state
    found = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        rnd: Any = importlib.import_module("megatron.core.tensor_parallel.random")
        rnd.model_parallel_cuda_manual_seed(0)  # the attention forks the CUDA RNG tracker
        model = build(dtype=torch.bfloat16).cuda()
        ref = build(dtype=torch.bfloat16).cuda()
        ref.load_state_dict(model.state_dict())
        adapter = MegatronMoEAdapter(model)
        mbs = [_on_cuda(mb) for mb in microbatches(4)]
        want = megatron_step(ref, mbs)
        got = combined_1f1b(
            adapter,
            mbs,
            fill_drain=kind == "fill_drain",
            streams=make_streams(torch.device("cuda")),
            options=adapter.schedule_options(),
        )
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), (got, want)
        ref_grads = dict(ref.named_parameters())
        for n, p in model.named_parameters():
            g = ref_grads[n].grad
            assert p.grad is not None and g is not None, f"{n}: no gradient"
            assert torch.equal(p.grad, g), f"{kind}: {n} differs from the model's own"
    finally:
        torch.use_deterministic_algorithms(found)
