"""Save and resume an expert-parallel run with ``torch.distributed.checkpoint``, exactly.

    torchrun --nproc-per-node 2 examples/checkpoint.py --ep 2 --dir DIR            # train, save
    torchrun --nproc-per-node 2 examples/checkpoint.py --ep 2 --dir DIR --resume   # fresh run
    torchrun --nproc-per-node 2 examples/checkpoint.py --ep 1 --dir DIR --resume   # reshard

Ranks ``d * EP + e``: data-parallel rank ``d``, expert-parallel rank ``e``. The first run
trains ``--steps`` steps of the reference model (combined_1f1b, AdamW), saves model and
optimizer with DCP (``DIR/ckpt``), then trains ``--steps`` more and writes what they gave
(``DIR/reference.pt``) and the saved global tensors (``DIR/global.pt``). A ``--resume`` run
starts fresh processes, loads the checkpoint and checks the loaded global tensors (any EP
size); with the saving run's EP size it also trains on and checks that every loss,
gradient and parameter is bit-identical to the run that never stopped.

Nothing here is checkpoint-specific to moe_overlap: the experts appear in state dicts as
DTensors sharded over the EP group, so DCP's own calls save and reshard them.
"""

from __future__ import annotations

import argparse
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

from torch.distributed.checkpoint import state_dict_loader, state_dict_saver  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402 - after the path set-up
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)

from moe_overlap import Microbatch, combined_1f1b  # noqa: E402
from moe_overlap.blocks import GroupedExperts  # noqa: E402
from moe_overlap.models import GPTMoEConfig, GPTMoEModel  # noqa: E402

CONFIG = GPTMoEConfig(hidden_size=32, num_layers=3, num_experts=4, ffn_hidden_size=64, seed=1)
FULL = StateDictOptions(full_state_dict=True)

# torch.distributed leaves these unannotated; give them a type once, here.
_all_reduce = cast(
    "Callable[..., object]",
    dist.all_reduce,  # pyright: ignore[reportUnknownMemberType]
)
dcp_load = cast(
    "Callable[..., None]",
    state_dict_loader.load,  # pyright: ignore[reportUnknownMemberType]
)
dcp_save = cast(
    "Callable[..., object]",
    state_dict_saver.save,  # pyright: ignore[reportUnknownMemberType]
)
_all_gather_object = cast(
    "Callable[..., None]",
    dist.all_gather_object,  # pyright: ignore[reportUnknownMemberType]
)
_new_group = cast(
    "Callable[..., dist.ProcessGroup]",
    dist.new_group,  # pyright: ignore[reportUnknownMemberType]
)


def data(step: int, rank: int) -> list[Microbatch]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    ids = [torch.randint(0, CONFIG.vocab_size, (2, 16), generator=gen) for _ in range(3)]
    return [Microbatch(input_ids=x, labels=x.roll(-1, 1)) for x in ids]


def build(ep: int) -> tuple[GPTMoEModel, torch.optim.Optimizer, dist.ProcessGroup | None]:
    """The model with its experts over this rank's EP group; its AdamW; its expert-DP group."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % ep:
        raise SystemExit(f"--ep {ep} must divide the {world} processes")
    dp = world // ep
    ep_groups = [_new_group([d * ep + e for e in range(ep)]) for d in range(dp)]
    dp_groups = [_new_group([d * ep + e for d in range(dp)]) for e in range(ep)]
    model = GPTMoEModel(CONFIG, ep_group=ep_groups[rank // ep] if ep > 1 else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, opt, dp_groups[rank % ep] if ep > 1 else None


def train(
    model: GPTMoEModel, opt: torch.optim.Optimizer, steps: range, expert_dp: Any
) -> dict[str, Tensor]:
    """Steps of combined_1f1b + AdamW: the mean over all ranks' losses (dense gradients
    averaged over every rank, expert gradients over the ranks holding the same experts)."""
    world = dist.get_world_size()
    experts = {
        id(p) for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()
    }
    seen: dict[str, Tensor] = {}
    for step in steps:
        losses = combined_1f1b(model, data(step, dist.get_rank()))
        seen[f"loss{step}"] = torch.stack([x.detach() for x in losses])
        for name, p in model.named_parameters():
            assert p.grad is not None, name
            _all_reduce(p.grad, group=expert_dp if id(p) in experts else None)
            p.grad.div_(world)
            seen[f"grad{step}.{name}"] = p.grad.clone()
        opt.step()
        opt.zero_grad(set_to_none=True)
    seen.update({f"param.{n}": p.detach().clone() for n, p in model.named_parameters()})
    return seen


def global_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Tensor]:
    """A copy of every model and optimizer tensor at its global shape (a full state dict
    holds the replicated tensors themselves, which training goes on changing)."""
    model_sd = get_model_state_dict(model, options=FULL)
    optim_sd = get_optimizer_state_dict(model, opt, options=FULL)
    out = {f"model.{k}": v.clone() for k, v in model_sd.items() if isinstance(v, Tensor)}
    for fqn, state in cast("dict[str, dict[str, object]]", optim_sd["state"]).items():
        out.update(
            {f"optim.{fqn}.{k}": v.clone() for k, v in state.items() if isinstance(v, Tensor)}
        )
    return out


def say(text: str) -> None:
    if dist.get_rank() == 0:
        print(text, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument(
        "--ep",
        type=int,
        default=2,
        help="expert-parallel size; must divide the number of processes (default: %(default)s)",
    )
    parser.add_argument(
        "--dir",
        type=Path,
        required=True,
        help="folder of the checkpoint (DIR/ckpt) and the files the resumed run checks "
        "against (required, no default)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=2,
        help="training steps before saving, and again after it (default: %(default)s)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="load DIR/ckpt and check it instead of training and saving; at the saving "
        "run's EP size, also train on and compare (default: off)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    ep, k, folder = int(args.ep), int(args.steps), Path(args.dir)
    ckpt, reference, saved = folder / "ckpt", folder / "reference.pt", folder / "global.pt"
    model, opt, expert_dp = build(ep)
    if not args.resume:
        train(model, opt, range(k), expert_dp)
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp_save({"model": model_sd, "optim": optim_sd, "ep": ep}, checkpoint_id=str(ckpt))
        full = global_tensors(model, opt)
        after = train(model, opt, range(k, 2 * k), expert_dp)
        torch.save(after, f"{reference}.rank{dist.get_rank()}")
        say(f"wrote {ckpt}")
        say(f"wrote {reference}.rank0 .. rank{dist.get_world_size() - 1}")
        if dist.get_rank() == 0:
            torch.save(full, saved)
        say(f"wrote {saved}")
        say(f"trained {2 * k} steps at EP={ep}, saved after {k}")
    else:
        model_sd, optim_sd = get_state_dict(model, opt)
        state: dict[str, object] = {"model": model_sd, "optim": optim_sd, "ep": 0}
        dcp_load(state, checkpoint_id=str(ckpt))
        set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
        want = cast("dict[str, Tensor]", torch.load(saved, weights_only=True))
        got = global_tensors(model, opt)
        exact = want.keys() == got.keys() and all(torch.equal(want[n], got[n]) for n in want)
        say(f"loaded {ckpt} (saved at EP={state['ep']}) at EP={ep}: global tensors equal: {exact}")
        if state["ep"] == ep:
            after = train(model, opt, range(k, 2 * k), expert_dp)
            ref = cast(
                "dict[str, Tensor]",
                torch.load(f"{reference}.rank{dist.get_rank()}", weights_only=True),
            )
            same = ref.keys() == after.keys() and all(torch.equal(ref[n], after[n]) for n in ref)
            flags = [False] * dist.get_world_size()
            _all_gather_object(flags, same)
            say(f"trained {k} more steps: matches the uninterrupted run: {all(flags)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
