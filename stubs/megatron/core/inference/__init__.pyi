"""Megatron-Core 0.19 (partial stub; see stubs/README.md)."""
