"""The demo behind ``python -m moe_overlap demo`` (the command line is ``__main__``).

It trains the reference model with :func:`~moe_overlap.combined_1f1b` and, from the
same initial weights, with plain per-microbatch ``loss.backward()``; prints both losses
per step and whether every gradient is bit-identical; writes a timeline of the last step
as a Chrome trace and, with matplotlib, a PNG. Under ``torchrun --nproc-per-node N`` it
shards the experts over the N ranks (gloo on CPU, NCCL on CUDA).

It needs torch alone: the progress bar (tqdm, drawn only when stdout and stderr are
terminals; otherwise tqdm is not even imported) and the PNG (matplotlib) come with
``pip install 'moe-overlap[demo]'``, and without them the demo says what it left out.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol, cast

import torch
import torch.distributed as dist

from moe_overlap import ConfigError, Microbatch, combined_1f1b
from moe_overlap.models import GPTMoEConfig, GPTMoEModel, MoELayer
from moe_overlap.timeline import Timeline
from moe_overlap.wgrad import check_wgrad_done

__all__ = ["DemoArgs", "demo_config", "run_demo"]

#: What installs the demo's optional packages (tqdm, matplotlib).
_DEMO_EXTRA = "pip install 'moe-overlap[demo]'"
#: The GPU timeline of the schedule that the README shows, in the source repository.
_GPU_TIMELINE = "benchmarks/results/timeline.png"

# torch.distributed leaves these unannotated; give them types once, here.
_all_reduce = cast(
    "Callable[..., object]",
    dist.all_reduce,  # pyright: ignore[reportUnknownMemberType]
)
_barrier = cast(
    "Callable[[], object]",
    dist.barrier,  # pyright: ignore[reportUnknownMemberType]
)


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoArgs:
    """The demo's options (see ``python -m moe_overlap demo --help``)."""

    steps: int = 5
    microbatches: int = 4
    out: Path = Path("out")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    ep: int | None = None
    dtype: Literal["float32", "bfloat16"] = "float32"
    optimizer: Literal["adamw", "sgd"] = "adamw"
    lr: float = 3e-3
    delay_wgrad: bool = True
    dispatcher: Literal["alltoall", "loopback"] = "alltoall"
    seed: int = 0
    progress: bool = True


def demo_config(args: DemoArgs) -> GPTMoEConfig:
    """Hidden 64, 4 layers (1 dense + 3 MoE), 8 experts, top-2, a shared expert."""
    return GPTMoEConfig(
        vocab_size=128,
        hidden_size=64,
        num_layers=4,
        first_k_dense=1,
        num_attention_heads=4,
        ffn_hidden_size=128,
        num_experts=8,
        moe_ffn_hidden_size=32,
        moe_router_topk=2,
        moe_shared_expert_hidden_size=32,
        moe_aux_loss_coeff=1e-3,
        dispatcher=args.dispatcher,
        dtype=torch.bfloat16 if args.dtype == "bfloat16" else torch.float32,
        delay_wgrad_compute=args.delay_wgrad,
        seed=args.seed,
    )


def _synthetic_batch(
    step: int, n: int, *, vocab: int, rank: int, device: torch.device, seed: int
) -> list[Microbatch]:
    """Next-token data with structure to learn: ``x[t+1] = (5 * x[t] + 3) % vocab``,
    one token in eight replaced by noise. Each rank draws its own."""
    batch, seq = 2, 32
    gen = torch.Generator().manual_seed(seed * 1_000_003 + rank * 7919 + step)
    out: list[Microbatch] = []
    for _ in range(n):
        ids = torch.empty(batch, seq + 1, dtype=torch.int64)
        ids[:, 0] = torch.randint(0, vocab, (batch,), generator=gen)
        for t in range(seq):
            ids[:, t + 1] = (5 * ids[:, t] + 3) % vocab
        noise = torch.rand(batch, seq + 1, generator=gen) < 0.125
        ids = torch.where(noise, torch.randint(0, vocab, ids.shape, generator=gen), ids)
        out.append(
            Microbatch(
                input_ids=ids[:, :-1].to(device),
                position_ids=torch.arange(seq, device=device).expand(batch, seq),
                labels=ids[:, 1:].to(device),
                loss_mask=torch.ones(batch, seq, device=device),
            )
        )
    return out


def _optimizer(model: torch.nn.Module, args: DemoArgs) -> torch.optim.Optimizer:
    if args.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=args.lr * 10)
    return torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=False)


def _grads_identical(a: torch.nn.Module, b: torch.nn.Module) -> tuple[int, int]:
    """``(identical, total)`` parameter gradients (``torch.equal``; both ``None`` counts)."""
    same = total = 0
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        total += 1
        if p.grad is None or q.grad is None:
            same += p.grad is None and q.grad is None
        else:
            same += bool(torch.equal(p.grad, q.grad))
    return same, total


def _average_grads(model: GPTMoEModel, world: int) -> None:
    """Turn each rank's gradients into those of the mean loss over ranks.

    Replicated (non-expert) grads are averaged, as data parallelism does. Expert weights
    are sharded: the all-to-all already brought every rank's tokens to them, so their
    local grad is the sum over ranks and only needs the same ``1 / world``.
    """
    experts = {
        id(p)
        for layer in model.layer_list
        if isinstance(layer, MoELayer)
        for p in layer.experts.parameters()
    }
    for p in model.parameters():
        if p.grad is None:
            continue
        if id(p) not in experts:
            _all_reduce(p.grad)
        p.grad.div_(world)


def _init_distributed(device: torch.device) -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size()


def _pick_device(choice: str) -> torch.device:
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("demo --device: expected a visible GPU for 'cuda', found none")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


if TYPE_CHECKING:

    class _Bar(Protocol):
        """The part of a ``tqdm`` progress bar the demo uses."""

        def write(self, s: str) -> None: ...
        def update(self, n: int) -> object: ...
        def close(self) -> None: ...

else:
    # Opaque at run time: debug mode's beartype cannot check a Protocol that is not
    # runtime-checkable (and one that is needs a rule table).
    _Bar = object


def _on_terminal() -> bool:
    """Whether a person watches: stdout and stderr (where a bar is drawn) are terminals."""
    return sys.stdout.isatty() and sys.stderr.isatty()


def _progress_bar(steps: int) -> _Bar | None:
    """A tqdm bar over ``steps`` steps; ``None`` (after saying so) without tqdm."""
    try:
        tqdm = importlib.import_module("tqdm")
    except ImportError:
        print(f"(no progress bar: tqdm is not installed; {_DEMO_EXTRA})", flush=True)
        return None
    return cast(_Bar, tqdm.tqdm(total=steps, desc="steps", unit="step"))


def run_demo(args: DemoArgs) -> int:
    """Run the demo; return 0 when every step was bit-identical, 1 otherwise."""
    if args.steps < 1 or args.microbatches < 1:
        raise ConfigError(
            f"demo: expected steps and microbatches >= 1, received {args.steps} and "
            f"{args.microbatches}"
        )
    if not math.isfinite(args.lr) or args.lr < 0:
        raise ConfigError(f"demo --lr: expected a finite learning rate >= 0, received {args.lr}")
    if args.ep is not None and args.ep < 1:
        raise ConfigError(f"demo --ep: expected an expert-parallel size >= 1, received {args.ep}")
    try:  # a wrong --out fails before the training, not after it
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"demo --out: expected a folder that can be created, received {str(args.out)!r} "
            f"({e.strerror or e}); pass another folder"
        ) from None
    device = _pick_device(args.device)
    if device.type == "cuda":
        # Bit-identity on a GPU needs deterministic kernels (cuBLAS needs this before init).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    rank, world = _init_distributed(device)
    ep = args.ep if args.ep is not None else world
    if ep != world:
        raise ConfigError(
            f"demo --ep: expected the number of processes ({world}; launch with torchrun "
            f"--nproc-per-node {ep}), received --ep {ep}"
        )
    group = dist.group.WORLD if world > 1 else None
    config = demo_config(args)
    scheduled = GPTMoEModel(config, ep_group=group, device=device)
    plain = GPTMoEModel(
        dataclasses.replace(config, delay_wgrad_compute=False), ep_group=group, device=device
    )
    plain.load_state_dict(scheduled.state_dict())
    opt_s, opt_p = _optimizer(scheduled, args), _optimizer(plain, args)
    options = scheduled.schedule_options()
    scale = 1.0 / args.microbatches
    for model in (scheduled, plain):
        model.set_aux_loss_scale(scale)
    lead = rank == 0
    # A bar only where a person watches; piped or logged output gets plain lines.
    bar = _progress_bar(args.steps) if lead and args.progress and _on_terminal() else None

    def say(line: str) -> None:
        if bar is not None:
            bar.write(line)
        elif lead:
            print(line, flush=True)

    say(
        f"moe_overlap demo: {config.num_layers} layers ({config.first_k_dense} dense), "
        f"{config.num_experts} experts top-{config.moe_router_topk}, EP={ep}, "
        f"{args.microbatches} microbatches, {device.type} {args.dtype}, "
        f"delay_wgrad={args.delay_wgrad}, optimizer={args.optimizer}"
    )
    timeline = Timeline(rank=rank)
    all_ok = True
    for step in range(args.steps):
        data = _synthetic_batch(
            step,
            args.microbatches,
            vocab=config.vocab_size,
            rank=rank,
            device=device,
            seed=args.seed,
        )
        opt_s.zero_grad(set_to_none=True)
        opt_p.zero_grad(set_to_none=True)
        record = step == args.steps - 1
        losses = combined_1f1b(
            scheduled,
            data,
            options=options,
            loss_scale=scale,
            observer=timeline if record else None,
        )
        check_wgrad_done(scheduled)
        ref: list[torch.Tensor] = []
        for mb in data:
            assert mb.input_ids is not None
            loss = plain(mb.input_ids, mb.position_ids, mb.labels, mb.loss_mask)
            (loss * scale).backward()
            ref.append(loss.detach())
        same_loss = all(torch.equal(a, b) for a, b in zip(losses, ref, strict=True))
        same, total = _grads_identical(scheduled, plain)
        ok = same_loss and same == total
        if world > 1:
            flag = torch.tensor([int(ok)], device=device)
            _all_reduce(flag, op=dist.ReduceOp.MIN)
            ok = bool(flag.item())
        all_ok &= ok
        mean_s = float(torch.stack(losses).mean())
        mean_p = float(torch.stack(ref).mean())
        say(
            f"step {step + 1}: loss combined_1f1b {mean_s:.6f} | plain {mean_p:.6f} | "
            f"losses identical {same_loss} | grads bit-identical {ok} ({same}/{total} params"
            f"{', all ranks' if world > 1 else ''})"
        )
        if world > 1:
            _average_grads(scheduled, world)
            _average_grads(plain, world)
        opt_s.step()
        opt_p.step()
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = f"_rank{rank}" if world > 1 else ""
    png = args.out / f"timeline{suffix}.png"
    trace = args.out / f"timeline{suffix}.json"
    timeline.to_chrome_trace(trace)
    title = (
        f"moe_overlap demo: combined_1f1b, step {args.steps} of {args.steps}, rank {rank} of "
        f"{world}; {config.num_layers} layers, {config.num_experts} experts top-"
        f"{config.moe_router_topk}, EP={ep}, {args.microbatches} microbatches, "
        f"{device.type} {args.dtype}"
    )
    try:
        timeline.to_png(png, title=title)
    except ConfigError as e:
        say(f"timeline of step {args.steps}: {trace} (chrome://tracing, Perfetto); no PNG: {e}")
    else:
        say(f"timeline of step {args.steps}: {png} and {trace} (chrome://tracing, Perfetto)")
    for line in _overlap_lines(timeline, device, args.steps):
        say(line)
    say(f"all steps bit-identical: {all_ok}")
    if world > 1:
        _barrier()
        dist.destroy_process_group()
    return 0 if all_ok else 1


def _overlap_lines(timeline: Timeline, device: torch.device, step: int) -> list[str]:
    """How long the comm stream's steps ran under the compute stream's in the timed step."""
    spans = timeline.spans()
    step_ms = max((s.end_ms for s in spans), default=0.0) - min(
        (s.start_ms for s in spans), default=0.0
    )
    lines = [
        f"comm hidden under compute in step {step}: {timeline.overlap_ms() * 1e3:.0f} us "
        f"of the {step_ms:.1f} ms step"
    ]
    if device.type == "cpu":
        lines.append(
            "  (on CPU the two streams are stand-ins that run one after another, so 0 us is "
            f"expected; a GPU step's overlap is pictured in {_GPU_TIMELINE} of the source "
            "repository)"
        )
    return lines
