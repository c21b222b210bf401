"""On CUDA in bf16: a tiny DeepSeek-V3 through the adapter, overlapped bit-identical to plain.

Deterministic settings (``torch.use_deterministic_algorithms``), real compute and comm
streams. Skipped without a GPU.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from moe_overlap import Microbatch, combined_1f1b, make_streams
from moe_overlap.adapters.transformers import TransformersMoEAdapter
from tests.adapters import families

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])
@pytest.mark.parametrize("delay", [False, True])
def test_bf16_overlap_is_bit_identical(family: str, delay: bool) -> None:
    found = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        causal_lm = dict(families.discover())[family]
        model = families.build(family, causal_lm).to(device="cuda", dtype=torch.bfloat16)
        mbs: list[Microbatch] = []
        for b in families.batches(4):
            assert b.input_ids is not None
            assert b.labels is not None
            mbs.append(Microbatch(input_ids=b.input_ids.cuda(), labels=b.labels.cuda()))
        runs = []
        for overlap in (False, True):
            m = copy.deepcopy(model)
            adapter = TransformersMoEAdapter(m, delay_wgrad_compute=delay)
            losses = combined_1f1b(
                adapter,
                mbs,
                overlap=overlap,
                streams=make_streams(torch.device("cuda")),
                options=adapter.schedule_options(),
            )
            torch.cuda.synchronize()
            grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
            runs.append((losses, grads))
        (lp, gp), (lo, go) = runs
        assert all(torch.equal(a, b) for a, b in zip(lp, lo, strict=True))
        assert gp.keys() == go.keys()
        assert all(torch.equal(gp[k], go[k]) for k in gp)
    finally:
        torch.use_deterministic_algorithms(found)  # as found: the suite's fixture turns it on
