"""Integrations with the PyTorch stack people train with (``pipelining``: pipeline parallel;
``fsdp``: FSDP2; ``checkpoint``: exact ``torch.distributed.checkpoint`` under expert parallelism).

Each module here is the only place that touches the other library's private names, behind
a check of the torch version it was tested with.
"""

__all__: list[str] = []
