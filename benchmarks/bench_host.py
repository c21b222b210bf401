"""Host (CPU) cost of the schedule itself: per-node forward + backward with trivial slots.

``PYTHONPATH=src python benchmarks/bench_host.py`` runs in a few seconds on any machine.
Every slot is one tiny tensor op on CPU, so the time is the library's own per-node
overhead (node bookkeeping, events and streams on CPU, step walking, plan building),
which shows regressions without a GPU. Prints microseconds per node execution
(forward or backward) and per layer pair of an overlapped chunk run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from moe_overlap import (
    ChunkState,
    Microbatch,
    PreprocessOutput,
    WgradLayer,
    WgradScope,
    combined_1f1b,
    make_streams,
)
from moe_overlap.blocks import (
    DelayedWgradLinear,
    GroupedExperts,
    MegatronHooks,
    PlainContext,
    TokenDispatcher,
    TopKRouter,
)

if TYPE_CHECKING:  # only here since the issue-25 layout; this file also runs on older trees
    from moe_overlap import SlotContext


@dataclass(frozen=True, kw_only=True)
class TrivialConfig:
    """Free-input and model configuration of the trivial model."""

    moe_token_dispatcher_type: str = "alltoall"
    moe_flex_dispatcher_backend: str | None = None
    fp8: str | None = None
    fp4: str | None = None
    cuda_graph_modules: tuple[object, ...] = ()
    mtp_num_layers: int | None = None


class TrivialLayer(nn.Module):
    """An MoE layer whose four slots are each one tiny add."""

    def __init__(self, config: TrivialConfig) -> None:
        super().__init__()
        self.cfg = config
        # One parameter per slot: a parameter two nodes accumulate is refused (its parts
        # would reach .grad one node at a time, unlike plain backward()).
        self.w = nn.ParameterList([nn.Parameter(torch.ones(())) for _ in range(4)])

    @property
    def config(self) -> TrivialConfig:
        return self.cfg

    @property
    def is_moe(self) -> bool:
        return True

    @property
    def num_local_experts(self) -> int | None:
        return 2

    def op(self, i: int, inputs: tuple[Tensor, ...]) -> Tensor:
        # An add saves no input for backward, so the free-input policy may free inputs.
        (x,) = inputs
        w: Tensor = self.w[i]
        return x + w

    def slot_pre_dispatch(
        self, node: SlotContext, inputs: tuple[Tensor, ...], /
    ) -> Tensor | tuple[Tensor, ...]:
        return self.op(0, inputs)

    def slot_dispatch(
        self, node: SlotContext, inputs: tuple[Tensor, ...], /
    ) -> Tensor | tuple[Tensor, ...]:
        return self.op(1, inputs)

    def slot_mlp(
        self, node: SlotContext, inputs: tuple[Tensor, ...], /
    ) -> Tensor | tuple[Tensor, ...]:
        return self.op(2, inputs)

    def slot_combine(
        self, node: SlotContext, inputs: tuple[Tensor, ...], /
    ) -> Tensor | tuple[Tensor, ...]:
        return self.op(3, inputs)

    def pre_dispatch_wgrad(self) -> Sequence[WgradScope]:
        return []

    def mlp_wgrad(self) -> Sequence[WgradLayer]:
        return []


class TrivialDecoder(nn.Module):
    def __init__(self, layers: Sequence[TrivialLayer]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.input_tensor: Tensor | None = None
        self.final_layernorm: Callable[[Tensor], Tensor] | None = None


class TrivialModel(MegatronHooks, nn.Module):
    """``n`` trivial MoE layers; a :class:`moe_overlap.PreprocessableModel`."""

    def __init__(self, n_layers: int) -> None:
        super().__init__()
        self.config = TrivialConfig()
        self.pre_process = True
        self.post_process = True
        self.scale = nn.Parameter(torch.ones(()))
        self.decoder = TrivialDecoder([TrivialLayer(self.config) for _ in range(n_layers)])

    def _preprocess(
        self,
        input_ids: Tensor | None,
        position_ids: Tensor | None,
        *,
        decoder_input: Tensor | None = None,
        packed_seq_params: object | None = None,
        padding_mask: Tensor | None = None,
    ) -> PreprocessOutput:
        assert decoder_input is not None
        return PreprocessOutput(decoder_input * self.scale, None, None, None, None, None)

    def output(
        self, hidden_states: Tensor, labels: Tensor | None, loss_mask: Tensor | None
    ) -> Tensor:
        """The loss: the sum of the last hidden states (no labels needed)."""
        del labels, loss_mask
        return hidden_states.sum()


def _plain_cost_us(model: TrivialModel, mbs: Sequence[Microbatch]) -> float:
    """The same tensor ops without the schedule: plain forward + ``loss.backward()``."""
    t0 = time.perf_counter()
    for mb in mbs:
        assert mb.decoder_input is not None
        h = mb.decoder_input * model.scale
        for layer in model.decoder.layers:
            assert isinstance(layer, TrivialLayer)
            for i in range(4):
                h = layer.op(i, (h,))
        torch.autograd.backward([h.sum()])
    return (time.perf_counter() - t0) * 1e6


def _per_call_us(fn: Callable[[], object], repeats: int, calls: int = 200) -> float:
    """Median over ``repeats`` of the mean host time of ``calls`` calls, in µs."""
    samples: list[float] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) * 1e6 / calls)
    return statistics.median(samples)


def _chunk_state() -> ChunkState:
    """An empty chunk state; the A/B runs this file against older trees too (before
    ``ChunkState`` took a ``Microbatch``)."""
    try:
        return ChunkState(Microbatch())
    except TypeError:
        return ChunkState()  # type: ignore[call-arg]  # pyright: ignore[reportCallIssue]


def _blocks_cost_us(repeats: int) -> dict[str, float]:
    """Host cost of each block's step on tiny CPU tensors (so the library is all there is)."""
    T, D, X, K = 16, 8, 4, 2
    hidden = torch.randn(T, D, requires_grad=True)
    router = TopKRouter(D, X, K, aux_loss_coeff=0.0)
    nn.init.normal_(router.weight)
    dispatcher = TokenDispatcher(X, K)
    experts = GroupedExperts(X, D, D, expert_offset=0, delay_wgrad=True)
    for w in experts.parameters():
        nn.init.normal_(w)
    linear = DelayedWgradLinear(D, D, delay_wgrad=True)
    nn.init.normal_(linear.weight)
    probs, chosen = router(hidden)
    ctx = PlainContext(_chunk_state())

    def four_steps() -> Tensor:
        tokens, p = dispatcher.slot_permute(ctx, hidden, probs, chosen)
        recv = dispatcher.slot_dispatch(ctx, tokens, p)
        out = dispatcher.slot_experts(ctx, recv, experts, weigh_in_float32=True)
        return dispatcher.slot_combine(ctx, out)

    def permute() -> object:
        return dispatcher.slot_permute(ctx, hidden, probs, chosen)

    def wgrad_cycle() -> None:
        linear(hidden).sum().backward()
        linear.backward_dw()

    model = TrivialModel(1)
    x = torch.randn(4)

    def hooks() -> Tensor:
        # The two hooks are what the schedule calls; their names are Megatron's.
        pre = model._preprocess(None, None, decoder_input=x)  # pyright: ignore[reportPrivateUsage]
        h = pre.decoder_input
        return model._postprocess(h, None, None, None, None, None, None)  # pyright: ignore[reportPrivateUsage]

    return {
        "TopKRouter.forward": _per_call_us(lambda: router(hidden), repeats),
        "TokenDispatcher.slot_permute": _per_call_us(permute, repeats),
        "TokenDispatcher four slot steps (EP=1, 4 experts)": _per_call_us(four_steps, repeats),
        "DelayedWgradLinear forward+backward+backward_dw": _per_call_us(wgrad_cycle, repeats),
        "MegatronHooks._preprocess + _postprocess": _per_call_us(hooks, repeats),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="host cost per node of the schedule, on CPU")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument(
        "--blocks", action="store_true", help="host µs per call of each moe_overlap.blocks step"
    )
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.blocks:
        print(json.dumps(_blocks_cost_us(args.repeats), indent=1))
        return
    model = TrivialModel(args.layers)
    mbs = [Microbatch(decoder_input=torch.randn(4)) for _ in range(args.microbatches)]
    streams = make_streams("cpu")
    n_nodes = args.microbatches * (args.layers * 4 + 2) * 2  # (4 slots + pre/post) x F/B
    n_pairs = (args.microbatches - 1) * args.layers
    results: dict[str, float] = {}
    for name, overlap in (("overlapped", True), ("serial", False)):
        times: list[float] = []
        for _ in range(args.repeats + 3):
            t0 = time.perf_counter()
            combined_1f1b(model, mbs, overlap=overlap, streams=streams)
            times.append((time.perf_counter() - t0) * 1e6)
        step_us = statistics.median(times[3:])
        results[f"{name}_step_us"] = step_us
        results[f"{name}_us_per_node"] = step_us / n_nodes
    plain = statistics.median(_plain_cost_us(model, mbs) for _ in range(args.repeats))
    results["plain_step_us"] = plain
    results["schedule_overhead_us_per_node"] = (results["overlapped_step_us"] - plain) / n_nodes
    # A layer pair is 8 node executions (4 slots forward of f, 4 backward of b).
    results["overlapped_us_per_layer_pair"] = results["overlapped_us_per_node"] * 8
    print(
        json.dumps(
            {"layers": args.layers, "microbatches": args.microbatches, "pairs": n_pairs, **results},
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
