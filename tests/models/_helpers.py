"""Shared by the reference-model tests and the EP worker: data and the parity check."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from moe_overlap import Microbatch, combined_1f1b
from moe_overlap.blocks import finish_wgrad
from moe_overlap.engine._plain_check import first_step_outcome
from moe_overlap.models import GPTMoEConfig, GPTMoEModel, MoELayer
from moe_overlap.wgrad import check_wgrad_done

SMALL = GPTMoEConfig(
    vocab_size=64,
    hidden_size=32,
    num_layers=3,
    first_k_dense=1,
    num_attention_heads=2,
    ffn_hidden_size=48,
    num_experts=4,
    moe_ffn_hidden_size=16,
    moe_router_topk=2,
)

GPU_BF16 = GPTMoEConfig(
    hidden_size=256,
    num_layers=3,
    num_attention_heads=4,
    num_experts=8,
    moe_ffn_hidden_size=128,
    moe_shared_expert_hidden_size=128,
    dtype=torch.bfloat16,
)
"""The GPU tests' model: bf16, every layer MoE with a shared expert."""


@contextmanager
def deterministic_cuda() -> Iterator[None]:
    """``torch.use_deterministic_algorithms`` for the block (cuBLAS workspace set), the mode
    found put back after."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    found = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(found)


def assert_same_grads(a: nn.Module, b: nn.Module) -> None:
    """Every parameter of ``a`` has a gradient bit-identical to ``b``'s (after a sync)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        assert torch.equal(p.grad, q.grad), name


def assert_matches_plain(
    scheduled: GPTMoEModel, plain: GPTMoEModel, mbs: Sequence[Microbatch], losses: Sequence[Tensor]
) -> None:
    """``plain`` trained per microbatch with ``backward()`` (its delayed wgrad finished)
    gives the schedule's ``losses`` and ``scheduled``'s gradients, bit for bit."""
    for mb, got in zip(mbs, losses, strict=True):
        assert mb.input_ids is not None
        loss = plain(mb.input_ids, labels=mb.labels)
        loss.backward()
        finish_wgrad(plain)
        assert torch.equal(got, loss.detach().float())
    assert_same_grads(scheduled, plain)


def microbatches(
    n: int, *, vocab: int, batch: int = 2, seq: int = 16, seed: int = 0, padded: bool = False
) -> list[Microbatch]:
    """Random next-token microbatches with a loss mask that drops the first position.

    ``padded``: row 0 left-padded (a microbatch-dependent length), the last row
    right-padded by 3, as ``padding_mask`` (kept out of ``loss_mask``), and an attention
    mask hiding key 2 from the second half of row 0's queries.
    """
    gen = torch.Generator().manual_seed(seed)
    out: list[Microbatch] = []
    for i in range(n):
        ids = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
        mask = torch.ones(batch, seq)
        mask[:, 0] = 0.0
        mb = Microbatch(
            input_ids=ids[:, :-1],
            position_ids=torch.arange(seq).expand(batch, seq),
            labels=ids[:, 1:],
            loss_mask=mask,
        )
        if padded:
            masks = padding(batch, seq, left=3 + i % 3, mask=mask)
            mb = dataclasses.replace(
                mb,
                padding_mask=masks["padding_mask"],
                attention_mask=masks["attention_mask"],
                loss_mask=masks["loss_mask"],
            )
        out.append(mb)
    return out


def padding(batch: int, seq: int, *, left: int, mask: Tensor) -> dict[str, Tensor]:
    """``padding_mask``, ``attention_mask`` and the loss mask without the padding."""
    pad = torch.zeros(batch, seq, dtype=torch.bool)
    pad[0, :left] = True
    pad[-1, seq - 3 :] = True
    attention = torch.zeros(batch, 1, seq, seq, dtype=torch.bool)
    attention[0, 0, seq // 2 :, 2] = True
    return {"padding_mask": pad, "attention_mask": attention, "loss_mask": mask * ~pad}


@dataclass(frozen=True)
class Parity:
    """Outcome of one scheduled-vs-plain comparison."""

    losses_equal: bool
    mismatched: tuple[str, ...]
    missing: tuple[str, ...]
    tokens_per_expert: tuple[int, ...]
    first_step_check: str | None = None
    """What debug mode's first-step check did (``None`` without debug mode)."""

    @property
    def ok(self) -> bool:
        return self.losses_equal and not self.mismatched and not self.missing


def starve(model: GPTMoEModel, experts: tuple[int, ...]) -> None:
    """Bias every router so that ``experts`` receive no tokens."""
    for layer in model.layer_list:
        if isinstance(layer, MoELayer):
            layer.router.expert_bias[list(experts)] = -1e4


def check_parity(
    config: GPTMoEConfig,
    *,
    n_micro: int = 3,
    overlap: bool = True,
    free_input: bool = True,
    starved: tuple[int, ...] = (),
    ep_group: dist.ProcessGroup | None = None,
    count_group: dist.ProcessGroup | None = None,
    data_seed: int = 0,
    loss_scale: float = 1.0,
    padded: bool = False,
    fill_drain: bool = False,
) -> Parity:
    """Run ``combined_1f1b`` and plain per-microbatch backward from the same weights."""
    scheduled = GPTMoEModel(config, ep_group=ep_group, count_group=count_group)
    plain = GPTMoEModel(dataclasses.replace(config, delay_wgrad_compute=False), ep_group=ep_group)
    plain.load_state_dict(scheduled.state_dict())
    starve(scheduled, starved)
    starve(plain, starved)
    data = microbatches(n_micro, vocab=config.vocab_size, seed=data_seed, padded=padded)
    losses = combined_1f1b(
        scheduled,
        data,
        overlap=overlap,
        options=scheduled.schedule_options(free_input=free_input),
        loss_scale=loss_scale,
        fill_drain=fill_drain,
    )
    check_wgrad_done(scheduled)
    ref = []
    with _RoutedCounts(plain) as routed:
        for mb in data:
            assert mb.input_ids is not None
            loss = plain(
                mb.input_ids,
                mb.position_ids,
                mb.labels,
                mb.loss_mask,
                attention_mask=mb.attention_mask,
                padding_mask=mb.padding_mask,
            )
            (loss * loss_scale).backward()
            ref.append(loss.detach())
    mismatched, missing = [], []
    for (name, p), (_, q) in zip(
        scheduled.named_parameters(), plain.named_parameters(), strict=True
    ):
        if p.grad is None or q.grad is None:
            # Every parameter of the reference model takes part in the loss: a grad missing
            # on both sides is a broken backward too, not a match.
            missing.append(name)
        elif not torch.equal(p.grad, q.grad):
            mismatched.append(name)
    return Parity(
        losses_equal=all(torch.equal(a, b) for a, b in zip(losses, ref, strict=True)),
        mismatched=tuple(mismatched),
        missing=tuple(missing),
        tokens_per_expert=routed.counts,
        first_step_check=first_step_outcome(scheduled),
    )


class _RoutedCounts:
    """Tokens per global expert that the first MoE layer's router picks in the first forward.

    A forward hook on the real router input (after attention and norm), so the counts are
    those the dispatcher sends, for this rank's data.
    """

    def __init__(self, model: GPTMoEModel) -> None:
        moe = [layer for layer in model.layer_list if isinstance(layer, MoELayer)]
        self.router = moe[0].router if moe else None
        self.num_experts = model.config.num_experts
        self.counts: tuple[int, ...] = ()
        self._handle: RemovableHandle | None = None

    def __enter__(self) -> _RoutedCounts:
        if self.router is not None:
            self._handle = self.router.register_forward_hook(self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._handle is not None:
            self._handle.remove()

    def _record(self, module: nn.Module, args: object, output: tuple[Tensor, Tensor]) -> None:
        del module, args
        if not self.counts:
            experts = output[1].detach().flatten()
            counts = torch.bincount(experts, minlength=self.num_experts)
            self.counts = tuple(int(c) for c in counts)
