"""Test helper: in-memory target/draft pairs (see dspark_serve.models.random_init.tiny_pair) and prompts."""

import torch

from dspark_serve.models.random_init import tiny_pair as build_pair  # noqa: F401


def random_prompts(seed: int, count: int) -> list[list[int]]:
    """`count` prompts of 1-19 token ids below 255, seeded."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 255, (int(n),), generator=g).tolist() for n in torch.randint(1, 20, (count,), generator=g)]


def cheap_draft_costs():
    """Step costs of a draft far cheaper than a verify, under which speculation pays whenever drafts are accepted
    at all: tests pin them so the policy's choices do not follow the timing of a busy test machine."""
    from dspark_serve.engine.core.step_costs import StepCosts

    return StepCosts.linear(1.0, 0.01, 0.3, 0.001)
