"""The torchtitan tests build their attention masks eagerly (``_titan.eager_block_masks``),
except a test marked ``compiled_block_masks`` or ``gpu`` (torchtitan's real flex attention)."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "compiled_block_masks: torchtitan's own torch.compile'd create_block_mask (the other "
        "torchtitan tests build their masks eagerly: tests/adapters/_titan.eager_block_masks)",
    )


@pytest.fixture(autouse=True)
def _eager_block_masks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Inside each test of a session that imported torchtitan (a torchtitan test collected)."""
    node = request.node
    if (
        "torchtitan" not in sys.modules
        or node.get_closest_marker("compiled_block_masks") is not None
        or node.get_closest_marker("gpu") is not None
    ):
        yield
        return
    from tests.adapters._titan import eager_block_masks

    with eager_block_masks():
        yield
