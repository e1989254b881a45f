"""logit_bias, penalties and min_tokens on the target's logits at every verified position; pure tensor functions.

Position j of a verify row sees the committed output plus the drafts before j, so verifying a block is sampling
the penalized target one token at a time (lossless).
"""

from __future__ import annotations

import torch
from torch import Tensor


def token_counts(token_ids: Tensor, vocab_size: int) -> Tensor:
    """How often each id occurs per row. token_ids [R, L] int64 (-1: padding) -> [R, V] fp32."""
    counts = torch.zeros(token_ids.shape[0], vocab_size, device=token_ids.device)
    return counts.scatter_add_(1, token_ids.clamp(min=0), (token_ids >= 0).float())


def counts_before(counts: Tensor, drafts: Tensor) -> Tensor:
    """counts [R, V] of the committed output, drafts [R, W - 1] (-1: padding) -> [R, W, V]: the counts position
    j sees, i.e. counts + drafts[:, :j]."""
    num_reqs, vocab_size = counts.shape
    added = counts.new_zeros(num_reqs, drafts.shape[1] + 1, vocab_size)  # [R, W, V]: drafts[:, j - 1] at j
    added[:, 1:].scatter_add_(-1, drafts.clamp(min=0)[..., None], (drafts >= 0)[..., None].float())
    return counts[:, None] + added.cumsum(1)


def apply_penalties(logits: Tensor, prompt_mask: Tensor, counts: Tensor, repetition: Tensor, presence: Tensor,
                    frequency: Tensor) -> Tensor:
    """vLLM's penalties. logits [R, W, V]; prompt_mask [R, V] bool (in the prompt); counts [R, W, V] of the output
    before each position; repetition, presence, frequency [R] -> [R, W, V] fp32.

    repetition (HF / vLLM): a token seen in the prompt or output has a positive logit divided, a negative one
    multiplied; then (OpenAI) presence * [count > 0] + frequency * count is subtracted."""
    x = logits.float()
    present = counts > 0
    seen = prompt_mask[:, None] | present  # [R, W, V]
    rep = repetition[:, None, None].float()
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    return x - frequency[:, None, None] * counts - presence[:, None, None] * present


def add_logit_bias(logits: Tensor, ids: Tensor, biases: Tensor) -> Tensor:
    """OpenAI's logit_bias at every position. logits [R, W, V]; ids [R, B] int64 (-1: padding); biases [R, B] fp32
    -> [R, W, V] fp32."""
    dense = torch.zeros(logits.shape[0], logits.shape[-1], device=logits.device)  # [R, V]
    dense.scatter_add_(1, ids.clamp(min=0), torch.where(ids >= 0, biases, 0.0))
    return logits.float() + dense[:, None]


def mask_before_min(logits: Tensor, banned: Tensor, num_output: Tensor, min_tokens: Tensor) -> Tensor:
    """min_tokens: the banned ids (EOS, stop token ids) get -inf where fewer than min_tokens tokens precede.
    logits [R, W, V]; banned [R, V] bool; num_output, min_tokens [R] (output length before position 0) -> [R, W, V]."""
    pos = num_output[:, None] + torch.arange(logits.shape[1], device=logits.device)  # [R, W]
    early = pos < min_tokens[:, None]  # [R, W]
    return logits.masked_fill(early[..., None] & banned[:, None], float("-inf"))
