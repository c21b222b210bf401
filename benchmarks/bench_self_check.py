"""Cost of the transformers adapter's construction-time self-check (CPU).

``PYTHONPATH=src:. python benchmarks/bench_self_check.py`` builds DeepSeek-V3 and Qwen2-MoE
at the test suite's tiny size and at a medium size, and times ``TransformersMoEAdapter``
with ``self_check=True`` and ``False`` (median of 3), with and without delayed weight
gradients. Prints a markdown table and writes ``benchmarks/results/self_check.json``.
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from tests.adapters import families

from moe_overlap.adapters.transformers import TransformersMoEAdapter

MEDIUM = {
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "moe_intermediate_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "num_experts": 16,
    "n_routed_experts": 16,
    "num_local_experts": 16,
}


def _build(family: str, size: str) -> torch.nn.Module:
    causal_lm = dict(families.discover())[family]
    if size == "tiny":
        return families.build(family, causal_lm)
    saved = families.OVERRIDES.get(family, {})
    families.OVERRIDES[family] = {**saved, **MEDIUM}
    try:
        return families.build(family, causal_lm)
    except ValueError:  # above the tiny-size guard: build anyway, this is a benchmark
        module = __import__(f"transformers.models.{family}.modeling_{family}", fromlist=["x"])
        cls = getattr(module, causal_lm)
        config = cls.config_class(**families.tiny_config(family, cls.config_class))
        model: torch.nn.Module = cls(config).float().train()
        return model
    finally:
        families.OVERRIDES[family] = saved


def main() -> int:
    torch.set_num_threads(2)
    rows: list[dict[str, object]] = []
    for family in ("deepseek_v3", "qwen2_moe"):
        for size in ("tiny", "medium"):
            model = _build(family, size)
            params = sum(p.numel() for p in model.parameters())
            for delay in (False, True):
                times: dict[bool, float] = {}
                for check in (True, False):
                    samples: list[float] = []
                    for _ in range(3):
                        m = copy.deepcopy(model)
                        t = time.perf_counter()
                        TransformersMoEAdapter(m, delay_wgrad_compute=delay, self_check=check)
                        samples.append(time.perf_counter() - t)
                    times[check] = statistics.median(samples)
                rows.append(
                    {
                        "family": family,
                        "size": size,
                        "parameters": params,
                        "delay_wgrad": delay,
                        "construct_s_self_check": times[True],
                        "construct_s_no_check": times[False],
                    }
                )
    print(
        "| family | size | parameters | delayed wgrad | construction, self-check on (s) | off (s) |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['family']} | {r['size']} | {r['parameters']:,} | {r['delay_wgrad']} | "
            f"{r['construct_s_self_check']:.3f} | {r['construct_s_no_check']:.3f} |"
        )
    out = Path(__file__).resolve().parent / "results" / "self_check.json"
    env = {"torch": torch.__version__, "python": sys.version.split()[0], "threads": 2}
    out.write_text(json.dumps({"env": env, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
