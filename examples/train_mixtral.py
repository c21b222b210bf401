"""Train a tiny random-initialised transformers Mixtral with the combined-1F1B schedule.

    python examples/train_mixtral.py                  # one process, all experts local
    python examples/train_mixtral.py --ep 2           # spawns 2 gloo processes (EP=2)
    torchrun --nproc-per-node 2 examples/train_mixtral.py --ep 2

The config is built in code (no download). Each step runs ``--microbatches`` microbatches
through :func:`~moe_overlap.combined_1f1b` (forward of one overlapped with backward of
the previous), then one AdamW step on the model's own parameters. Under EP each rank
holds ``num_experts / EP`` experts and trains on its own data; the replicated (non-expert)
gradients are averaged over ranks as data parallelism would. At the end the experts are
gathered into a transformers-format state dict, loaded into a fresh full model, and that
model's own ``forward`` gives the loss of the trained weights.
"""

from __future__ import annotations

import argparse
import importlib
import os
import socket
import subprocess
import sys
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
from moe_overlap.adapters.transformers import (  # noqa: E402
    TransformersMoEAdapter,
    gather_experts,
)

VOCAB = 96
SEQ = 32

# torch.distributed leaves this unannotated; give it a type once, here.
_all_reduce = cast(
    "Callable[..., object]",
    dist.all_reduce,  # pyright: ignore[reportUnknownMemberType]
)


def build_mixtral(seed: int) -> nn.Module:
    """A 2-layer, 4-expert, top-2 Mixtral with the router load-balancing loss on."""
    # importlib keeps the type checkers out of transformers' thousands of modules.
    t: Any = importlib.import_module("transformers")
    config = t.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=SEQ,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
    )
    torch.manual_seed(seed)  # pyright: ignore[reportUnknownMemberType] - unannotated
    model: nn.Module = t.MixtralForCausalLM(config)
    return model


def batch(step: int, rank: int, n: int, *, size: int = 4) -> list[Microbatch]:
    """Arithmetic sequences mod VOCAB (learnable: next = previous + stride)."""
    gen = torch.Generator().manual_seed(1_000 * step + rank)
    out: list[Microbatch] = []
    for _ in range(n):
        start = torch.randint(0, VOCAB, (size, 1), generator=gen)
        stride = torch.randint(1, 4, (size, 1), generator=gen)
        ids = (start + stride * torch.arange(SEQ)) % VOCAB
        out.append(Microbatch(input_ids=ids, labels=ids))
    return out


def average_replicated_grads(adapter: TransformersMoEAdapter, world: int) -> None:
    """Average the grads of replicated parameters over ranks; scale the experts' alike.

    Each rank's expert grads already sum every rank's tokens routed to them.
    """
    experts = {id(p) for p in adapter.expert_parameters()}
    for p in adapter.parameters():
        if p.grad is None:
            continue
        if id(p) not in experts:
            _all_reduce(p.grad)
        p.grad.div_(world)


def train(args: argparse.Namespace, rank: int, world: int) -> None:
    group = dist.group.WORLD if world > 1 else None
    model = build_mixtral(seed=0)
    adapter = TransformersMoEAdapter(model, ep_group=group, delay_wgrad_compute=args.delay_wgrad)
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    lead = rank == 0
    if lead:
        print(
            f"Mixtral: 2 layers, 4 experts top-2, EP={world} ({4 // world} experts/rank), "
            f"{args.microbatches} microbatches/step, delayed wgrad={args.delay_wgrad}"
        )
    for step in range(args.steps):
        losses = combined_1f1b(
            adapter,
            batch(step, rank, args.microbatches),
            options=adapter.schedule_options(),
            loss_scale=1.0 / args.microbatches,
        )
        mean = torch.stack(losses).mean()
        if world > 1:
            average_replicated_grads(adapter, world)
            _all_reduce(mean)
            mean /= world
        optimizer.step()  # pyright: ignore[reportUnknownMemberType] - unannotated closure
        optimizer.zero_grad(set_to_none=True)
        if lead:
            print(f"step {step + 1:2d}: loss {mean.item():.4f}")
    state = gather_experts(model, group)
    if lead:
        full = build_mixtral(seed=1)
        full.load_state_dict(state)
        mb = batch(args.steps, 0, 1)[0]
        out = full(input_ids=mb.input_ids, labels=mb.labels)
        loss: Tensor = out.loss
        print(f"gathered checkpoint ({len(state)} tensors), model.forward loss {loss.item():.4f}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def spawn(world: int) -> int:
    """Re-run this script as ``world`` gloo ranks; return the worst exit code."""
    port = str(_free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, *sys.argv],
            env=dict(
                os.environ,
                RANK=str(rank),
                WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                OMP_NUM_THREADS="1",
            ),
        )
        for rank in range(world)
    ]
    return max(p.wait() for p in procs)


def main() -> int:
    parser = argparse.ArgumentParser(description="Train a tiny Mixtral with combined 1F1B.")
    parser.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel size: the number of processes, spawned here unless run under "
        "torchrun (default: %(default)s)",
    )
    parser.add_argument(
        "--steps", type=int, default=8, help="training steps (default: %(default)s)"
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
        help="delay the weight gradients of the layers' linears and routed experts to the "
        "schedule's backward_dw (default: off)",
    )
    args = parser.parse_args()
    if args.ep > 1 and "RANK" not in os.environ:
        return spawn(args.ep)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != args.ep:
        parser.error(f"--ep {args.ep} needs {args.ep} processes, received {world}")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if world > 1:
        dist.init_process_group("gloo")
    try:
        train(args, int(os.environ.get("RANK", "0")), world)
    finally:
        if world > 1:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    if "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # gloo's background threads can abort a rank at interpreter teardown ("terminate
        # called without an active exception") after its work is done and the group is
        # destroyed: a rank leaves without the teardown, its exit status main's.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
