"""Prompt logprobs (vLLM's prompt_logprobs): each prompt token's logprob under the target's raw logits, computed one
prefill chunk at a time, and the fresh prefill that computes them for the requests that ask."""

from __future__ import annotations

import torch
from torch import Tensor

from .request import Request, StepOutput
from .target_side import TargetSide

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


def prefill_fresh(target: TargetSide, reqs: list[Request]) -> tuple[Tensor, list[Tensor | None],
                                                                     dict[str, list[tuple]]]:
    """TargetSide.run(reqs, prompts, last_only=True)'s outputs (logits [R, 1, V] of each prompt's last position,
    features per request), plus the prompt logprobs of the requests whose params ask (request id -> entries).
    Those run alone, PROMPT_CHUNK_TOKENS positions at a time with every position's logits; the rest as one batch."""
    asking = [i for i, r in enumerate(reqs) if r.params.prompt_logprobs is not None]
    if not asking:
        return *target.run(reqs, [r.prompt_ids for r in reqs], last_only=True), {}
    rest = [i for i in range(len(reqs)) if i not in asking]
    rows: dict[int, tuple[Tensor, Tensor | None]] = {}
    if rest:
        logits, feats = target.run([reqs[i] for i in rest], [reqs[i].prompt_ids for i in rest], last_only=True)
        rows.update((i, (logits[k], feats[k])) for k, i in enumerate(rest))
    found = {}
    for i in asking:
        last, feats, found[reqs[i].request_id] = _chunked(target, reqs[i])
        rows[i] = (last, feats)
    logits = torch.stack([rows[i][0] for i in range(len(reqs))])  # [R, 1, V]
    return logits, [rows[i][1] for i in range(len(reqs))], found


def _chunked(target: TargetSide, req: Request) -> tuple[Tensor, Tensor | None, list[tuple]]:
    """One prompt chunk by chunk: (logits [1, V] of its last position, its features or None, its prompt logprobs).
    req.num_computed is where each chunk starts, and back at its start afterwards."""
    start, prompt = req.num_computed, req.prompt_ids
    entries, feats = [], []
    try:
        for s in range(start, len(prompt), PROMPT_CHUNK_TOKENS):
            tokens = prompt[s:s + PROMPT_CHUNK_TOKENS]
            req.num_computed = s
            logits, f = target.run([req], [tokens], last_only=False)  # [1, >= T, V]
            nxt = prompt[s + len(tokens)] if s + len(tokens) < len(prompt) else None
            entries += chunk_prompt_logprobs(logits[0, :len(tokens)], tokens, nxt, req.params.prompt_logprobs,
                                             first=s == 0)
            feats.append(f[0])
            last = logits[0, len(tokens) - 1:len(tokens)]  # [1, V]
    finally:
        req.num_computed = start
    return last, (torch.cat(feats) if feats[0] is not None else None), entries


def with_prompt_logprobs(outputs: list[StepOutput], found: dict[str, list[tuple]]) -> list[StepOutput]:
    """The prefill's outputs, each asking request's first carrying its prompt logprobs."""
    if not found:
        return outputs
    return [o._replace(prompt_logprobs=found[o.request_id]) if o.request_id in found else o for o in outputs]
