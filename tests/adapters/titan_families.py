"""Every model family of the installed torchtitan, tried tiny against the adapter.

``python -m tests.adapters.titan_families --write docs/torchtitan_families.md`` regenerates
the table in the docs; ``tests/adapters/test_titan_families.py`` fails when it is stale.

A family is a package of ``torchtitan.models`` with a ``model_registry``; its smallest
flavour (``debugmodel_moe``, else ``debugmodel``) is built by the registry, cut to
:data:`LAYERS` blocks, its routed experts :data:`EXPERT_WIDTH` wide (the flavour's
expert count and top-k: the same modules, routing and code paths, smaller tensors), with the test-only causal attention in place of flex
(``_titan.causal_stand_in``: flex has no backward on CPU), in float32, or in bfloat16
when the model's own forward fails in float32, and checked as :func:`check_family` says.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import pathlib
import pkgutil
import sys
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn

from moe_overlap import ConfigError, Microbatch, combined_1f1b
from tests.torch_state import num_threads

from . import _titan

LAYERS = 3
MICROBATCHES = 2
EXPERT_WIDTH = 64
"""The routed experts' ``hidden_dim`` (the flavours': 256 to 2880; the wide ones were most
of the check's time)."""
GRAD_RTOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
"""Largest gradient difference against the model's own forward, relative to the largest
gradient of the parameter, that a family listed in :data:`KNOWN_BOUNDS` may show (float32:
rounding; bfloat16: its rounding unit times a few)."""
KNOWN_BOUNDS: dict[str, str] = {}
"""Families whose gradients cannot be bit-identical to the model's own, with the reason
(none today: every supported family is bit-identical). A family not listed here that
differs by any amount is WRONG."""
_NOT_FAMILIES = {"common", "utils"}


@dataclass(frozen=True, slots=True)
class Row:
    family: str
    model: str
    status: str
    detail: str
    vs_original: str = ""
    """Against the model's own forward and ``backward()``: ``bit-identical`` or the bound."""


def _flavor(module: object) -> str | None:
    for name in dir(module):
        configs = getattr(module, name)
        if name.endswith("_configs") and isinstance(configs, dict):
            for flavor in ("debugmodel_moe", "debugmodel"):
                if flavor in configs:
                    return flavor
    return None


def _own_loss(model: nn.Module, mb: dict[str, Tensor]) -> Tensor:
    from torchtitan.components.loss import cross_entropy_loss

    logits = model(mb["input_ids"], positions=mb["position_ids"])
    labels = mb["labels"]
    loss: Tensor = cross_entropy_loss(logits, labels) / (labels != -100).sum()
    return loss


def _microbatch(mb: dict[str, Tensor]) -> Microbatch:
    return Microbatch(
        input_ids=mb["input_ids"], labels=mb["labels"], position_ids=mb["position_ids"]
    )


def _grads(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@dataclass(frozen=True, slots=True)
class Check:
    """What :func:`check_family` found: ``problem`` (``""``: exact) and the largest
    gradient difference from the model's own (relative to the parameter's largest)."""

    problem: str
    worst: float
    worst_at: str


def check_family(model: nn.Module, family: str = "") -> Check:
    """The adapter on ``model`` against the model's **own** forward and ``backward()``.

    Exact: the losses of :func:`~moe_overlap.combined_1f1b` and of the adapter's plain path
    equal the model's own bit for bit, the schedule's gradients and load-balancing counts
    equal the plain path's bit for bit, with and without ``delay_wgrad_compute``, and the
    gradients equal the model's own bit for bit -- or, for a family in
    :data:`KNOWN_BOUNDS`, within :data:`GRAD_RTOL`.
    """
    from moe_overlap.adapters.torchtitan import TorchtitanMoEAdapter

    dtype = next(model.parameters()).dtype
    batches = _titan.batch(model, MICROBATCHES)
    worst, worst_at = 0.0, ""

    def found(problem: str) -> Check:
        return Check(problem, worst, worst_at)

    own: nn.Module | None = None
    own_losses: list[Tensor] = []
    for delay in (False, True):
        plain, sched = copy.deepcopy(model), copy.deepcopy(model)
        a_plain = TorchtitanMoEAdapter(plain, delay_wgrad_compute=delay, self_check=False)
        a_sched = TorchtitanMoEAdapter(sched, delay_wgrad_compute=delay)
        if own is None:  # the model's own step, once (the adapter took the model): both
            own = copy.deepcopy(model)  # delay settings are held to the same result
            for mb in batches:
                own_loss = _own_loss(own, mb)
                torch.autograd.backward(own_loss)
                own_losses.append(own_loss.detach())
        g_own = _grads(own)
        for mb, own_loss in zip(batches, own_losses, strict=True):
            plain_loss = a_plain.forward(mb["input_ids"], mb["position_ids"], labels=mb["labels"])
            torch.autograd.backward(plain_loss)
            if not torch.equal(plain_loss.detach(), own_loss):
                return found(f"delay={delay}: the plain path's loss differs from the model's own")
            for layer in a_plain.decoder.layers:
                for m in layer.delayed_modules():
                    while m.pending_wgrad:
                        m.backward_dw()
        losses = combined_1f1b(
            a_sched, [_microbatch(mb) for mb in batches], options=a_sched.schedule_options()
        )
        if not all(torch.equal(a.detach(), b) for a, b in zip(losses, own_losses, strict=True)):
            return found(f"delay={delay}: the schedule's losses differ from the model's own")
        g_plain, g_sched = _grads(plain), _grads(sched)
        if g_plain.keys() != g_own.keys() or g_sched.keys() != g_own.keys():
            return found(
                f"delay={delay}: other parameters get gradients than in the model's own run"
            )
        for name, want in g_own.items():
            if not torch.equal(g_sched[name], g_plain[name]):
                return found(
                    f"delay={delay}: the schedule's gradient of {name} differs from the plain path's"
                )
            if torch.equal(g_plain[name], want):
                continue
            scale = float(want.abs().max()) or 1.0
            diff = float((g_plain[name].float() - want.float()).abs().max()) / scale
            if diff > worst:
                worst, worst_at = diff, name
            rtol = GRAD_RTOL[torch.bfloat16 if ".routed_experts." in name else dtype]
            if family not in KNOWN_BOUNDS or diff > rtol:
                return found(
                    f"delay={delay}: gradient of {name} differs from the model's own by "
                    f"{diff:.2g} (relative)"
                )
        for (name, b_plain), (_, b_sched), (_, b_own) in zip(
            plain.named_buffers(), sched.named_buffers(), own.named_buffers(), strict=True
        ):
            if not (torch.equal(b_plain, b_own) and torch.equal(b_sched, b_own)):
                return found(
                    f"delay={delay}: buffer {name} ends the step otherwise than in the model's own run"
                )
    return found("")


def _build(family: str, registry: object, flavor: str) -> nn.Module:
    kwargs: dict[str, object] = {}
    if family == "gpt_oss":
        kwargs["attn_backend"] = "flex"
    spec = cast("Any", registry)(flavor, **kwargs)
    config = _titan.shrink(spec.model, layers=LAYERS)
    if all(hasattr(layer, "moe") for layer in config.layers):
        config = _titan.shrink(config, layers=LAYERS, moe={"hidden_dim": EXPERT_WIDTH})
    torch.manual_seed(0)
    model: Any = config.build()
    model.init_states(buffer_device=torch.device("cpu"))
    return _titan.causal_stand_in(model)


def _runs_in_float32(model: nn.Module) -> bool:
    mb = _titan.batch(model, 1)[0]
    try:
        with torch.no_grad():
            model(mb["input_ids"], positions=mb["position_ids"])
    except RuntimeError:
        return False
    return True


def rows() -> list[Row]:
    """One row per family of ``torchtitan.models`` (checked at one thread; the thread count
    found is put back after)."""
    with num_threads(1):
        return _rows()


def _rows() -> list[Row]:
    import torchtitan.models as models

    found: list[Row] = []
    for info in sorted(pkgutil.iter_modules(models.__path__), key=lambda m: m.name):
        family = info.name
        if family in _NOT_FAMILIES:
            continue
        try:
            module = importlib.import_module(f"torchtitan.models.{family}")
        except ImportError as exc:
            found.append(Row(family, "", "not importable", f"{type(exc).__name__}: {exc}"))
            continue
        registry = getattr(module, "model_registry", None)
        flavor = _flavor(module)
        if registry is None or flavor is None:
            found.append(Row(family, "", "no registry", "no model_registry / debug flavour"))
            continue
        try:
            model = _build(family, registry, flavor)
        except Exception as exc:
            found.append(Row(family, "", "not built", f"{type(exc).__name__}: {exc}"))
            continue
        name = f"{type(model).__name__} ({flavor})"
        if not _runs_in_float32(model):
            model = model.to(torch.bfloat16)
        try:
            check = check_family(model, family)
        except ConfigError as exc:
            found.append(Row(family, name, "refused", str(exc)))
            continue
        status = "supported" if not check.problem else "WRONG"
        detail = check.problem or str(next(model.parameters()).dtype)
        if check.problem:
            vs = ""
        elif check.worst == 0.0:
            vs = "bit-identical"
        else:
            vs = f"within {check.worst:.2g} (at {check.worst_at}): {KNOWN_BOUNDS[family]}"
        found.append(Row(family, name, status, detail, vs))
    return found


def _cell(text: str) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= 300 else text[:297] + "..."


def render(found: list[Row]) -> str:
    import torchtitan

    version = getattr(torchtitan, "__version__", "?")
    counts: dict[str, int] = {}
    for r in found:
        counts[r.status] = counts.get(r.status, 0) + 1
    summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    lines = [
        "# torchtitan model families",
        "",
        "Generated by `python -m tests.adapters.titan_families --write "
        f"docs/torchtitan_families.md` from torchtitan {version}; "
        "`tests/adapters/test_titan_families.py` fails when it is stale.",
        "",
        f"Each family's smallest flavour is built by its own registry, cut to {LAYERS} blocks, "
        f"its routed experts {EXPERT_WIDTH} wide (the flavour's expert count and top-k), "
        "with a test-only causal attention in place of flex attention (flex has no backward "
        "on CPU), in float32 (bfloat16 where the model's own forward fails in float32), and "
        f"trained one step of {MICROBATCHES} microbatches: *supported* means the overlapped "
        "schedule's losses, gradients and load-balancing counts equal the model's own "
        "forward + `backward()` (torchtitan's model, not the adapter's plain path), with and "
        "without `delay_wgrad_compute`; the column *vs the original model* says "
        "*bit-identical*, or the measured bound and why it cannot be (a difference "
        "without a stated reason fails the test); *refused* means `TorchtitanMoEAdapter` "
        "raises `ConfigError`.",
        "",
        f"**{summary}** (of {len(found)}).",
        "",
        "| family | model (flavour) | status | vs the original model | detail |",
        "|---|---|---|---|---|",
    ]
    for r in found:
        model = f"`{r.model}`" if r.model else ""
        lines.append(
            f"| `{r.family}` | {model} | {r.status} | {_cell(r.vs_original)} | {_cell(r.detail)} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The torchtitan families table.")
    parser.add_argument("--write", type=pathlib.Path, help="write the table to this file")
    args = parser.parse_args(argv)
    text = render(rows())
    if args.write is None:
        sys.stdout.write(text)
    else:
        args.write.write_text(text)
        print(f"wrote {args.write}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
