"""Typing tests: type-checked by mypy and pyright, never run (see README.md)."""
