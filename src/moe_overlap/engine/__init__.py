"""The engine: schedule nodes, plans, the driver, streams, Protocols and errors.

Its public names are re-exported from :mod:`moe_overlap`; import them from there. The
modules here are private (``_*.py``), one concept each. This package imports nothing, so
debug mode (``engine._debug``) can install its checks before any other module loads.
"""

__all__: list[str] = []
