"""Integrations with the PyTorch stack people train with (``pipelining``: pipeline parallel;
``fsdp``: FSDP2; ``checkpoint``: exact ``torch.distributed.checkpoint`` under expert parallelism).

Private torch names live in one module per integration, behind a check of the torch
releases it was tested with: ``pipelining/_torch.py`` for ``pipelining``; ``fsdp``,
``checkpoint`` and ``_consensus`` (``pipelining``'s step consensus) use public torch API
only. ``tests/integrations/test_private_torch.py`` parses every module here and enforces it.
"""

__all__: list[str] = []
