"""Train a tiny torchtitan DeepSeek-V3 (or Qwen3-MoE) with the combined-1F1B schedule.

    python examples/train_torchtitan.py                     # one process (a 1-rank group)
    torchrun --nproc-per-node 2 examples/train_torchtitan.py  # 2 ranks, data parallel

The model is built by torchtitan's own registry (``debugmodel``, cut to ``--layers``
blocks, no download), its optimizer is AdamW with torchtitan's own load-balancing hook
(``register_moe_load_balancing_hook``: the expert bias moves by the token counts the
MoE layers accumulate), and each step runs ``--microbatches`` microbatches through
:func:`~moe_overlap.combined_1f1b`. Under several ranks each trains on its own data and
the gradients are averaged, as data parallelism would.

On CPU the blocks' flex attention (which has no backward on CPU) is configured as
torchtitan's causal ``ScaledDotProductAttention`` before the model is built (one document
per sequence, which is what this example feeds); on a GPU torchtitan's flex attention is
kept. Gloo on CPU, NCCL on GPU. On CPU torch's warning that CPU autocast has no float32
(torchtitan's router asks for it) is silenced: the gate runs in float32 all the same.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import socket
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT / "src"))

from moe_overlap import Microbatch, combined_1f1b  # noqa: E402 - after the path set-up
from moe_overlap.adapters.torchtitan import TorchtitanMoEAdapter  # noqa: E402

FLAVORS = {"deepseek_v3": "debugmodel", "qwen3": "debugmodel_moe"}
SEQ = 32

# torch.distributed leaves this unannotated; give it a type once, here.
_all_reduce = cast(
    "Callable[..., object]",
    dist.all_reduce,  # pyright: ignore[reportUnknownMemberType]
)


def build(family: str, layers: int, device: torch.device) -> nn.Module:
    """The registry's debug model, ``layers`` blocks, states initialised on ``device``."""
    registry = cast("Any", importlib.import_module(f"torchtitan.models.{family}")).model_registry
    config = registry(FLAVORS[family]).model
    blocks = list(config.layers[:layers])
    if device.type == "cpu":  # flex attention has no backward on CPU
        sdpa = cast("Any", importlib.import_module("torchtitan.models.common.attention"))
        for block in blocks:
            block.attention = dataclasses.replace(
                block.attention, inner_attention=sdpa.ScaledDotProductAttention.Config()
            )
    config = dataclasses.replace(config, layers=blocks)
    torch.manual_seed(0)  # pyright: ignore[reportUnknownMemberType] - unannotated
    with device:
        model = cast("nn.Module", config.build())
    cast("Any", model).init_states(buffer_device=device)
    return model


def load_balancing(
    optimizer: torch.optim.Optimizer, model: nn.Module, world: int, device: torch.device
) -> None:
    """torchtitan's own hook: before each optimizer step, move the expert bias by the
    token counts (summed over the data-parallel ranks) and zero them."""
    optim = cast("Any", importlib.import_module("torchtitan.components.optimizer.optimizer"))
    dims = cast("Any", importlib.import_module("torchtitan.distributed.parallel_dims"))
    # torchtitan assumes an accelerator unless told: its meshes (built by the hook once
    # there are several ranks) would ask CUDA for the rank's device on a CPU machine.
    dims.device_type = device.type
    parallel = dims.ParallelDims(
        dp_replicate=world, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=world
    )
    optim.register_moe_load_balancing_hook(optimizer, [model], parallel)


def batches(vocab: int, n: int, rank: int, step: int, device: torch.device) -> list[Microbatch]:
    del step  # the same batches every step: the loss should fall
    g = torch.Generator().manual_seed(rank)
    out: list[Microbatch] = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (2, SEQ + 1), generator=g).to(device)
        positions = torch.arange(SEQ, device=device).expand(2, SEQ)
        out.append(Microbatch(input_ids=ids[:, :-1], labels=ids[:, 1:], position_ids=positions))
    return out


def average_gradients(model: nn.Module, world: int) -> None:
    if world == 1:
        return
    for p in model.parameters():
        if p.grad is not None:
            _all_reduce(p.grad)
            p.grad.div_(world)


def self_check_table(adapter: TorchtitanMoEAdapter) -> str:
    """The adapter's construction-time self-check, one row per block structure."""
    report = adapter.self_check_report
    if not report.enabled:
        return "self-check: off"
    rows = [("block class", "blocks", "largest rel. difference", "probe dtype")]
    rows += [(c, ", ".join(n), f"{d:.3g}", t) for c, n, d, t in report.structures]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [
        "  " + "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows
    ]
    head = (
        f"self-check ({report.seconds:.1f} s): the adapter's split of each block structure "
        "against the block's own forward (0: bit-identical)"
    )
    return "\n".join([head, *lines])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Train a tiny torchtitan MoE with combined 1F1B.")
    parser.add_argument(
        "--family",
        choices=sorted(FLAVORS),
        default="deepseek_v3",
        help="torchtitan model family; its debug model is built (default: %(default)s)",
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=3,
        help="blocks of the debug model kept (default: %(default)s)",
    )
    parser.add_argument(
        "--steps", type=int, default=5, help="training steps (default: %(default)s)"
    )
    parser.add_argument(
        "--microbatches",
        type=int,
        default=4,
        help="microbatches per step and rank (default: %(default)s)",
    )
    parser.add_argument(
        "--delay-wgrad",
        action="store_true",
        help="delay the weight gradients of the blocks' attention and shared-expert linears "
        "to the schedule's backward_dw (default: off)",
    )
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    if not cuda:  # the router's float32 autocast: unavailable on CPU, and not needed there
        warnings.filterwarnings(
            "ignore",
            message="In CPU autocast, but the target dtype is not supported",
            category=UserWarning,
        )
    if "RANK" not in os.environ:  # a 1-rank group: torchtitan's hook reads the meshes
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = str(sock.getsockname()[1])
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)  # several ranks share the cores
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        if cuda
        else torch.device("cpu")
    )

    model = build(args.family, args.layers, device)
    adapter = TorchtitanMoEAdapter(model, delay_wgrad_compute=args.delay_wgrad)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    load_balancing(optimizer, model, world, device)
    vocab = int(cast("Any", model).config.vocab_size)
    if rank == 0:
        kinds = ", ".join(type(layer).__name__ for layer in adapter.decoder.layers)
        print(f"{type(model).__name__}, {args.layers} blocks scheduled as: {kinds}")
        print(self_check_table(adapter))
    for step in range(args.steps):
        optimizer.zero_grad()
        mbs = batches(vocab, args.microbatches, rank, step, device)
        losses = combined_1f1b(
            adapter, mbs, options=adapter.schedule_options(), loss_scale=1 / len(mbs)
        )
        average_gradients(model, world)
        optimizer.step()  # pyright: ignore[reportUnknownMemberType] - unannotated closure
        loss = torch.stack([x.detach() for x in losses]).mean()
        _all_reduce(loss)
        if rank == 0:
            print(f"step {step + 1:3d}: loss {float(loss) / world:.4f}", flush=True)
    if rank == 0:
        moe = model.get_submodule("layers.1.moe")
        bias = cast("Tensor", moe.expert_bias_E)
        print(
            f"expert bias of layers.1 after {args.steps} steps (torchtitan's load-balancing "
            f"hook): {bias.numel()} experts, from {float(bias.min()):.5f} to "
            f"{float(bias.max()):.5f}"
        )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
