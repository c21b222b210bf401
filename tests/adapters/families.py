"""Every MoE causal-LM family of the installed transformers, tried tiny against the adapter.

``python -m tests.adapters.families --write docs/families.md`` regenerates the table in the
docs; ``tests/adapters/test_families.py`` runs the same checks and fails when the table is
stale or when an accepted family computes anything but the model's own result.

A family is found by its modeling source (a ``*ForCausalLM`` class and routed experts), built
tiny from its config class (:func:`tiny_config`: the same small sizes for every family,
set on whichever of the config's fields exist, plus the few per-family settings a config
needs to have a MoE layer at all), and checked as :func:`check_family` says.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
import pathlib
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moe_overlap import ConfigError, Microbatch
from tests.torch_state import num_threads

LAYERS = 4
VOCAB = 128
TOPK = 4
"""Experts per token: from 3 on, the order in which a token's outputs and gradients are
added changes the rounding, so top-4 checks what top-2 cannot."""
IDS_BELOW = 100
"""Token ids of the probe batches (a few families mask logits past an unpadded vocabulary)."""


@dataclass(frozen=True)
class Bound:
    """How far a family listed in :data:`KNOWN_BOUNDS` may be from the model's own
    forward and ``backward()``, and why it cannot be bit-identical."""

    loss: float
    """Largest absolute loss difference."""
    grad: float
    """Largest gradient difference, relative to the largest gradient of the parameter."""
    reason: str
    exact_if: dict[str, object] | None = None
    """Config settings under which the reason is gone: the family must then be
    bit-identical (the check verifies the reason)."""


KNOWN_BOUNDS: dict[str, Bound] = {
    "llama4": Bound(
        loss=1e-5,
        grad=1e-5,
        reason=(
            "Llama 4's MoE runs every expert on every token (one batched GEMM over all "
            "tokens, a token's rows for the experts it did not pick scaled by 0); the "
            "adapter dispatches only the routed rows, so the expert GEMMs (forward, and "
            "each expert's weight gradient) have other shapes and round otherwise"
        ),
    ),
    "granitemoe_swa": Bound(
        loss=1e-5,
        grad=1e-5,
        reason=(
            "the model's own forward (with `use_cache=True`, its config's default) runs its "
            "sliding-window attention on the keys and values its KV cache hands back, a "
            "concatenated copy; the adapter keeps no KV cache in training, so the attention "
            "reads them in another memory layout and rounds otherwise (with "
            "`use_cache=False` it is bit-identical, which the check verifies)"
        ),
        exact_if={"use_cache": False},
    ),
}
"""Families whose losses and gradients cannot be bit-identical to the model's own, with
the bound the check holds them to and the reason. A family not listed here that differs
by any amount is *wrong*; one listed that is bit-identical makes the list stale."""

# (config field, value or a function of the field's default giving the value, None = keep)
_Rule = tuple[str, object]


def _when_set(value: object) -> Callable[[object], object]:
    return lambda default: value if default else None


def _groups(default: object) -> object:
    return 4 if isinstance(default, int) and default > 1 else None


RULES: tuple[_Rule, ...] = (
    ("vocab_size", VOCAB),
    ("hidden_size", 64),
    ("d_model", 64),
    ("num_hidden_layers", LAYERS),
    ("n_layers", LAYERS),
    ("num_layers", LAYERS),
    ("num_attention_heads", 4),
    ("n_heads", 4),
    ("ffn_hidden_size", 64),
    ("expert_ffn_hidden_size", 32),
    ("vocab_size_per_layer_input", _when_set(VOCAB)),
    ("hidden_size_per_layer_input", _when_set(16)),
    ("zero_expert_num", _when_set(2)),
    ("head_dim", 16),
    ("intermediate_size", 64),
    ("intermediate_size_mlp", 64),
    ("dense_intermediate_size", 64),
    ("moe_intermediate_size", 32),
    ("shared_expert_intermediate_size", 32),
    ("shared_intermediate_size", 32),
    ("moe_shared_expert_intermediate_size", 32),
    ("num_experts", 8),
    ("n_routed_experts", 8),
    ("num_local_experts", 8),
    ("moe_num_experts", 8),
    ("num_experts_per_tok", TOPK),
    ("moe_topk", TOPK),
    ("moe_k", TOPK),
    ("top_k_experts", TOPK),
    ("n_shared_experts", 1),
    ("num_shared_experts", 1),
    ("moe_num_shared_experts", 1),
    ("n_group", _groups),
    ("num_expert_group", _groups),
    ("first_k_dense_replace", 1),
    ("num_dense_layers", 1),
    ("mlp_only_layers", [0]),
    ("decoder_sparse_step", 1),
    ("moe_layer_start_index", 1),
    ("moe_layer_interval", 1),
    ("interleave_moe_layer_step", 2),
    ("kv_lora_rank", 16),
    ("q_lora_rank", _when_set(32)),
    ("qk_rope_head_dim", 8),
    ("qk_nope_head_dim", 16),
    ("v_head_dim", 16),
    ("sliding_window", _when_set(4)),
    ("max_position_embeddings", 64),
    ("router_jitter_noise", _when_set(0.0)),
    ("attention_dropout", _when_set(0.0)),
)

OVERRIDES: dict[str, dict[str, object]] = {
    "hunyuan_v1_moe": {"num_experts": 8, "moe_topk": TOPK},  # defaults: one expert, top-1
    "gemma4": {"enable_moe_block": True, "num_experts": 8, "top_k_experts": TOPK},
    "doge": {"is_moe": True, "num_experts": 16},
    "zaya": {"num_experts_per_tok": 1},  # its config accepts top-1 only
    "dbrx": {
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 8, "moe_top_k": TOPK},
    },
    "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv", "full_attention"]},
    "granitemoehybrid": {
        "layer_types": ["mamba", "attention", "mamba", "attention"],
    },
}
"""Settings without which the family's config builds no MoE layer (or does not build)."""


MAX_PARAMETERS = 20_000_000
"""A tiny build above this (a config field the rules miss) is not run."""


def _get(config: object, key: str) -> object:
    try:
        return getattr(config, key, None)
    except Exception:
        return None


def _fields(config_cls: type) -> set[str]:
    if dataclasses.is_dataclass(config_cls):
        return {f.name for f in dataclasses.fields(config_cls)}
    return set(inspect.signature(config_cls).parameters)


def tiny_config(family: str, config_cls: type) -> dict[str, object]:
    """The tiny settings for ``family``'s config class."""
    fields = _fields(config_cls)
    default = config_cls()
    kw: dict[str, object] = {}
    for key, rule in RULES:
        if key not in fields:
            continue
        value = rule(_get(default, key)) if callable(rule) else rule
        if value is not None:
            kw[key] = value
    if "num_key_value_heads" in fields:
        kv, heads = _get(default, "num_key_value_heads"), _get(default, "num_attention_heads")
        kw["num_key_value_heads"] = kw.get("num_attention_heads", 4) if kv in (None, heads) else 2
    if "topk_group" in fields and kw.get("n_group", kw.get("num_expert_group")) == 4:
        kw["topk_group"] = 2
    if "qk_rope_head_dim" in fields and "head_dim" in fields:
        kw["head_dim"] = kw["qk_rope_head_dim"]
    for tok in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = _get(default, tok)
        if tok in fields and isinstance(value, int) and value >= VOCAB:
            kw[tok] = 0 if tok == "pad_token_id" else 1
        elif tok in fields and isinstance(value, list):
            kw[tok] = [1]
    kw.update(OVERRIDES.get(family, {}))
    return kw


_MOE = re.compile(r"self\.experts\s*=|^class \w*(MoE|Moe)\w*\(", re.M)
"""Routed experts, or a class named for a mixture of experts (Doge's product-key CDMoE)."""
_CLM = re.compile(r"^class (\w+ForCausalLM)\((\w+)", re.M)


def discover() -> list[tuple[str, str]]:
    """``(family, ForCausalLM class)`` of every modeling module with a mixture of experts."""
    import transformers

    root = pathlib.Path(transformers.__file__).parent / "models"
    found: list[tuple[str, str]] = []
    for d in sorted(p for p in root.iterdir() if p.is_dir()):
        f = d / f"modeling_{d.name}.py"
        if not f.exists():
            continue
        src = f.read_text()
        if not _MOE.search(src):
            continue
        classes = [c for c, _ in _CLM.findall(src)]
        if classes:
            found.append((d.name, classes[0]))
    return found


@dataclass(frozen=True)
class Row:
    """One family's outcome."""

    family: str
    causal_lm: str
    status: str
    """``supported``, ``refused``, ``wrong`` (accepted, but not the model's result) or
    ``not built`` (the tiny settings do not fit the family's config)."""
    detail: str
    seconds: float
    vs_original: str = ""
    """Supported: ``bit-identical`` to the model's own forward and ``backward()``, or the
    family's :data:`KNOWN_BOUNDS` entry."""
    loss_diff: float = 0.0
    """Largest loss difference from the model's own (over the runs; not in the table)."""
    grad_diff: float = 0.0
    """Largest relative gradient difference from the model's own (not in the table)..."""
    grad_at: str = ""
    """... and the parameter where it is."""


def build(family: str, causal_lm: str, *, seed: int = 0, aux: bool = False) -> nn.Module:
    """The tiny model; ``aux`` asks for the router logits (and a load-balancing loss
    coefficient), where the config has those fields."""
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    cls: Any = getattr(module, causal_lm)
    config_cls: Any = cls.config_class
    settings = tiny_config(family, config_cls)
    if aux:
        fields = _fields(config_cls)
        settings.update(
            {
                k: v
                for k, v in (("output_router_logits", True), ("router_aux_loss_coef", 0.1))
                if k in fields
            }
        )
    config = config_cls(**settings)
    with torch.device("meta"):
        size = sum(p.numel() for p in cls(config).parameters())
    if size > MAX_PARAMETERS:
        raise ValueError(f"the tiny settings leave {size:,} parameters (> {MAX_PARAMETERS:,})")
    torch.manual_seed(seed)
    model: nn.Module = cls(config)
    return model.float().train()


def batches(n: int = 2, *, seed: int = 1, padded: bool = False) -> list[Microbatch]:
    """Random microbatches; ``padded`` left-pads the first sequence (mask 0, labels -100)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, IDS_BELOW, (2, 8), generator=g)
        labels = ids.clone()
        mask = None
        if padded:
            mask = torch.ones(2, 8, dtype=torch.long)
            mask[0, :3] = 0
            labels[0, :3] = -100
        out.append(Microbatch(input_ids=ids, labels=labels, attention_mask=mask))
    return out


LOOSE = Bound(loss=float("inf"), grad=float("inf"), reason="measured only")
"""The bound :func:`main`'s ``--measure`` holds every family to (it reports, never fails)."""


def check_family(family: str, causal_lm: str, *, bound: Bound | None = None) -> Row:
    """Build tiny and check three runs: delayed wgrad off and on; then with the router
    logits asked for (the model's load-balancing loss, where it has one), a padded batch and
    delayed wgrad. Each: the adapter at construction; the plain schedule's losses and
    gradients equal the model's own ``forward`` + ``backward()`` bit for bit (a family in
    :data:`KNOWN_BOUNDS`: within its bound); the overlapped schedule bit-identical to the
    plain one. ``bound``: instead of the family's entry in :data:`KNOWN_BOUNDS`."""
    from tests.adapters import _hf

    start = time.perf_counter()
    try:
        model = build(family, causal_lm)
        aux_model = build(family, causal_lm, aux=True)
    except Exception as exc:
        return Row(
            family,
            causal_lm,
            "not built",
            f"does not build tiny: {type(exc).__name__}: {_short(exc)}",
            0.0,
        )
    runs = [
        ("delay=False", model, batches(), False),
        ("delay=True", model, batches(), True),
        ("router logits, padded, delay=True", aux_model, batches(padded=True), True),
    ]
    bound = bound or KNOWN_BOUNDS.get(family)
    loss_atol, grad_rtol = (bound.loss, bound.grad) if bound is not None else (0.0, 0.0)
    note = ""
    exact = True
    loss_diff, grad_diff, grad_at = 0.0, 0.0, ""
    for label, m, mbs, delay in runs:
        try:
            outcome = _hf.compare(m, mbs, delay=delay, loss_atol=loss_atol, grad_rtol=grad_rtol)
        except ConfigError as exc:
            if m is aux_model:  # the family trains; its own aux loss is what is refused
                note = f"with output_router_logits: refused, {_short(exc)}"
                break
            return Row(family, causal_lm, "refused", _short(exc), time.perf_counter() - start)
        except Exception as exc:
            return Row(
                family,
                causal_lm,
                "wrong",
                f"{label}: {type(exc).__name__}: {_short(exc)}",
                time.perf_counter() - start,
            )
        exact = exact and outcome.exact
        loss_diff = max(loss_diff, outcome.loss_diff)
        if outcome.grad_rel_diff > grad_diff:
            grad_diff, grad_at = outcome.grad_rel_diff, outcome.worst_grad
        if not outcome.ok:  # without a bound, ok means bit-identical to the model's own
            return Row(
                family, causal_lm, "wrong", f"{label}: {outcome}", time.perf_counter() - start
            )
    if not exact and bound is not None and bound.exact_if is not None:
        for key, value in bound.exact_if.items():
            setattr(getattr(model, "config"), key, value)  # noqa: B009 - a transformers config
        outcome = _hf.compare(model, batches(), delay=False, loss_atol=0.0, grad_rtol=0.0)
        if not outcome.exact:
            return Row(
                family,
                causal_lm,
                "wrong",
                f"with {bound.exact_if}: not bit-identical, so the stated reason is not the "
                f"cause: {outcome}",
                time.perf_counter() - start,
            )
    seconds = time.perf_counter() - start
    if exact:
        vs = "bit-identical"
    else:
        assert bound is not None  # a difference without a bound failed above
        # The table states the bound (the measured figures vary in the last digit across CPUs).
        vs = f"within {bound.grad:g} relative (loss {bound.loss:g}): {bound.reason}"
    return Row(family, causal_lm, "supported", note, seconds, vs, loss_diff, grad_diff, grad_at)


STATUSES = ("supported", "refused", "wrong", "not built")
MIXER_REFUSAL = "the adapter schedules softmax-attention layers"


def _short(exc: BaseException, n: int = 300) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= n else text[: n - 3] + "..."


def table(rows: Sequence[Row]) -> str:
    import transformers

    counts = {s: sum(r.status == s for r in rows) for s in STATUSES}
    mixers = sum(r.status == "refused" and MIXER_REFUSAL in r.detail for r in rows)
    lines = [
        "# transformers MoE families",
        "",
        f"Generated by `python -m tests.adapters.families --write docs/families.md` from "
        f"transformers {transformers.__version__}; "
        "`tests/adapters/test_families.py` fails when it is stale.",
        "",
        "Each family is built tiny from its own config class (4 layers, hidden 64, 8 experts, "
        f"top-{TOPK}, float32) and trained one step of two microbatches: *supported* means the "
        "schedule's losses and gradients equal the model's own `forward` + `backward()` "
        "(transformers' model, not the adapter's plain path) and the overlapped schedule is "
        "bit-identical to the plain one, with and without `delay_wgrad_compute`, and again "
        "with `output_router_logits` set (the model's load-balancing loss, where it has one) "
        "on a padded batch. The column *vs the original model* says *bit-identical*, or the "
        "bound the family is held to and why it cannot be bit-identical (a difference "
        "without a stated reason fails the test); *refused* means `TransformersMoEAdapter` "
        "raises `ConfigError` at construction, with the reason shown.",
        "",
        f"**{counts['supported']} supported, {counts['refused']} refused "
        f"({mixers} of them for layers that are not softmax attention), "
        f"{counts['wrong']} wrong, {counts['not built']} not built** (of {len(rows)}; *not built*: "
        "the tiny settings do not fit the family's config, so it was not tried).",
        "",
        "| family | class | status | vs the original model | detail |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        detail = r.detail.replace("|", "\\|")
        vs = r.vs_original.replace("|", "\\|")
        lines.append(f"| `{r.family}` | `{r.causal_lm}` | {r.status} | {vs} | {detail} |")
    return "\n".join(lines) + "\n"


def run_all(
    threads: int = 1, families: Sequence[str] | None = None, *, bound: Bound | None = None
) -> list[Row]:
    """Every family (or ``families``), at ``threads`` torch threads (the table: 1)."""
    found = discover()
    if families is not None:
        found = [(f, c) for f, c in found if f in families]
    with num_threads(threads):
        return [check_family(f, c, bound=bound) for f, c in found]


def figures(rows: Sequence[Row]) -> str:
    """The measured differences from the model's own forward and ``backward()``."""
    lines = ["family | status | vs the original | max loss diff | max rel grad diff (at)"]
    for r in rows:
        if r.status == "supported":
            vs = "bit-identical" if r.vs_original == "bit-identical" else "differs"
            lines.append(
                f"{r.family} | {r.status} | {vs} | {r.loss_diff:.2g} | {r.grad_diff:.2g} "
                f"({r.grad_at or '-'})"
            )
        else:
            lines.append(f"{r.family} | {r.status} | {r.detail[:120]}")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--write", type=pathlib.Path, help="write the markdown table here")
    p.add_argument("--family", action="append", help="only these families")
    p.add_argument(
        "--measure",
        action="store_true",
        help="print the measured loss and gradient differences from the model's own",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads (the table: 1)")
    p.add_argument("--json", action="store_true", help="print each row as one JSON line")
    args = p.parse_args(argv)
    rows = run_all(args.threads, args.family, bound=LOOSE if args.measure else None)
    if args.json:
        for row in rows:
            print(json.dumps(dataclasses.asdict(row)))
        return 0
    if args.measure:
        sys.stdout.write(figures(rows))
        return 0
    if args.family:
        for row in rows:
            print(row)
        return 0
    text = table(rows)
    if args.write:
        args.write.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
