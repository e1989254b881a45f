"""Test helper: in-memory target/draft pairs (see dspark_serve.models.random_init.tiny_pair)."""

from dspark_serve.models.random_init import tiny_pair as build_pair  # noqa: F401
