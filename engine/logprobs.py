"""Logprobs of emitted tokens under the target's processed distribution; a pure tensor function.

"Processed" as vLLM's processed_logprobs: after penalties, min_tokens and temperature (greedy rows: 1), before
top-k / top-p / min-p filtering, so alternatives the filters would drop keep a finite logprob.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .sampling_params import GREEDY_TEMPERATURE


def token_logprobs(logits: Tensor, temperature: Tensor, tokens: Tensor, num_top: int) -> Tensor:
    """logits [R, W, V] (processed); temperature [R]; tokens [R, W] (-1: none) -> [R, W, 1 + 2 * num_top] fp32:
    the token's logprob, the num_top largest logprobs (descending), then their ids (exact as fp32 below 2^24)."""
    t = torch.where(temperature < GREEDY_TEMPERATURE, 1.0, temperature.float())
    lp = (logits.float() / t[:, None, None]).log_softmax(-1)  # [R, W, V]
    chosen = lp.gather(-1, tokens.clamp(min=0)[..., None])  # [R, W, 1]
    if num_top == 0:
        return chosen
    top = lp.topk(num_top, -1)  # sorted, descending
    return torch.cat([chosen, top.values, top.indices.float()], -1)


def unpack_row(values: list[list[float]], tokens: list[int], num_top: int, width: int) -> list[tuple]:
    """One row of token_logprobs on the host (values [W][1 + 2 * width]) -> per token (token_id, logprob,
    [(token_id, logprob)] * num_top), the plain tuples outputs carry."""
    out = []
    for tok, v in zip(tokens, values):
        top = [(int(v[1 + width + k]), v[1 + k]) for k in range(num_top)]
        out.append((tok, v[0], top))
    return out
