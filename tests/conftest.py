"""Fixtures shared by every test package."""

from tests.shards.conftest import smollm2_gguf, smollm2_home, smollm2_store  # noqa: F401
