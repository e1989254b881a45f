"""Prompt logprobs (vLLM's prompt_logprobs): each prompt token's logprob under the target's raw logits, computed one
prefill chunk at a time (engine/core/executor.py runs the chunks of the requests that ask)."""

from __future__ import annotations

import torch
from torch import Tensor


PROMPT_CHUNK_TOKENS = 512  # prompt positions whose logits [T, V] one chunk holds at once


def chunk_prompt_logprobs(logits: Tensor, tokens: list[int], next_token: int | None, num_top: int,
                          first: bool) -> list[tuple]:
    """One prefill chunk's prompt logprobs. logits [T, V] of the chunk's positions (raw); tokens: its T prompt
    tokens; next_token: the prompt token after the chunk (None: the chunk ends the prompt, and its last position
    predicts no prompt token); first: the chunk starts the prompt.

    -> per prompt token the chunk scores, in order: (token_id, logprob, [(token_id, logprob)] * num_top, rank)
    with rank 1 for the most likely token; with `first` the prompt's first token leads, as (token_id, None, [],
    None), since nothing precedes it."""
    targets = tokens[1:] + ([next_token] if next_token is not None else [])
    out = [(tokens[0], None, [], None)] if first else []
    if not targets:
        return out
    lp = logits[:len(targets)].float().log_softmax(-1)  # [n, V]
    ids = torch.tensor(targets, device=lp.device)
    chosen = lp.gather(1, ids[:, None])  # [n, 1]
    rank = (lp > chosen).sum(-1) + 1  # [n]
    top = lp.topk(num_top, -1) if num_top else None  # [n, k] each
    values, ranks = chosen[:, 0].tolist(), rank.tolist()
    top_ids, top_lps = (top.indices.tolist(), top.values.tolist()) if top is not None else ([[]] * len(targets),) * 2
    for tok, v, r, ti, tv in zip(targets, values, ranks, top_ids, top_lps):
        out.append((tok, v, list(zip(ti, tv)), r))
    return out
