"""Test helper: in-memory target/draft pairs (see dspark_serve.models.random_init.tiny_pair) and prompts."""

import torch

from dspark_serve.models.random_init import tiny_pair as build_pair  # noqa: F401


def random_prompts(seed: int, count: int) -> list[list[int]]:
    """`count` prompts of 1-19 token ids below 255, seeded."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 255, (int(n),), generator=g).tolist() for n in torch.randint(1, 20, (count,), generator=g)]
