"""The host loopback on CUDA under deterministic algorithms (skipped without a GPU).

``torch.use_deterministic_algorithms`` fills new memory with NaN; the loopback's pinned
staging block is written in full before it is read, so it is allocated without the fill
(a host memset of the whole transfer per call). The values and the user's flag must not
change.
"""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch

from moe_overlap.blocks import HostLoopback
from tests.models._helpers import deterministic_cuda

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("remote_rows", [None, 5, 0])
@pytest.mark.parametrize("chunks", [1, 3])
def test_loopback_exact_and_fill_flag_kept_under_deterministic(
    remote_rows: int | None, chunks: int
) -> None:
    det = cast("Any", torch.utils.deterministic)  # the flag is a property of its class
    x = torch.randn(17, 3, 8, device="cuda", dtype=torch.bfloat16)
    mover = HostLoopback(remote_rows=remote_rows, chunks=chunks)
    with deterministic_cuda():
        assert det.fill_uninitialized_memory
        out = mover(x)
        assert det.fill_uninitialized_memory
    assert torch.equal(out, x)
    found = det.fill_uninitialized_memory
    det.fill_uninitialized_memory = False
    try:
        with deterministic_cuda():
            assert torch.equal(mover(x), x)
            assert not det.fill_uninitialized_memory
    finally:
        det.fill_uninitialized_memory = found
