"""Lossless verification of draft tokens against the target: greedy, sampled, and a mixed batch.

Pure, vectorized over requests, no host sync; randomness is keyed by (seed, position) through sampling.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .sampling import (BONUS_SALT, RESAMPLE_SALT, VERIFY_SALT, keyed_gumbel, keyed_uniform, processed_probs,
                       sample_from_probs)

COUPLED_ROWS = 8  # sampled rows without filters drawn in one pass on a GPU (bounds its [rows, n, V]); on CPU one row
# a pass, whose noise stays in cache

RESIDUAL_EPS = 1e-8  # residual mass at or below this falls back to p


@dataclass(frozen=True)
class VerifyResult:
    num_accepted: Tensor  # [R] int64: accepted drafts, not counting the correction/bonus
    output_tokens: Tensor  # [R, n + 1] int64: drafts[:num_accepted], correction or bonus, then -1


def _accepted_prefix(accepted: Tensor) -> Tensor:
    """Length of the all-True prefix of each row. accepted [R, n] bool -> [R] int64."""
    return accepted.long().cumprod(-1).sum(-1)


def _assemble(draft_tokens: Tensor, num_accepted: Tensor, last_token: Tensor) -> Tensor:
    """[R, n + 1]: accepted drafts, then last_token at index num_accepted, then -1."""
    pad = draft_tokens.new_full((draft_tokens.shape[0], 1), -1)
    drafts = torch.cat([draft_tokens, pad], 1).long()  # [R, n + 1]
    col = torch.arange(drafts.shape[1], device=drafts.device)[None, :]
    n_acc = num_accepted[:, None]
    return torch.where(col < n_acc, drafts, torch.where(col == n_acc, last_token[:, None], -1))


def _draft_mask(draft_tokens: Tensor, num_draft: Tensor) -> Tensor:
    """Which draft slots are real proposals. [R, n] bool; padding (id < 0) is never accepted."""
    col = torch.arange(draft_tokens.shape[1], device=draft_tokens.device)[None, :]
    return (col < num_draft[:, None]) & (draft_tokens >= 0)


PACKED_VERIFIED, PACKED_ACCEPTED, PACKED_TOKENS = 0, 1, 2  # the columns of a step's packed accept


def pack_accept(num_verified: Tensor, result: VerifyResult) -> Tensor:
    """A step's accept in one int64 tensor for one host read: [R, 2 + n + 1] = drafts verified, drafts accepted,
    then the output tokens (-1 padded)."""
    return torch.cat([num_verified[:, None].long(), result.num_accepted[:, None], result.output_tokens], 1)


def verify_greedy(draft_tokens: Tensor, num_draft: Tensor, target_logits: Tensor) -> VerifyResult:
    """Accept while draft == target argmax. draft_tokens [R, n], num_draft [R], target_logits [R, n + 1, V]."""
    return verify_greedy_ids(draft_tokens, num_draft, target_logits.argmax(-1))


def verify_greedy_ids(draft_tokens: Tensor, num_draft: Tensor, target_ids: Tensor) -> VerifyResult:
    """verify_greedy from the target's argmax ids [R, n + 1].

    The accepted drafts equal the target's argmax, so the output is the argmax row up to the correction (or bonus)
    at num_accepted; padding drafts (-1) never equal an argmax."""
    n = draft_tokens.shape[1]
    col = torch.arange(n + 1, device=target_ids.device)
    accepted = (draft_tokens == target_ids[:, :n]) & (col[:n] < num_draft[:, None])  # [R, n]
    num_accepted = _accepted_prefix(accepted)  # [R]
    return VerifyResult(num_accepted, target_ids.masked_fill(col > num_accepted[:, None], -1))


def _draft_row(draft_probs: Tensor | None, draft_tokens: Tensor, index: Tensor, vocab_size: int) -> Tensor:
    """q at draft slot index[r] for each row -> [R, V]; a one-hot on the draft when draft_probs is None."""
    rows = torch.arange(draft_tokens.shape[0], device=draft_tokens.device)
    if draft_probs is not None:
        return draft_probs[rows, index].float()
    token = draft_tokens[rows, index].clamp(min=0)
    return torch.nn.functional.one_hot(token, vocab_size).float()


def verify_sampled(
    draft_tokens: Tensor,
    num_draft: Tensor,
    draft_probs: Tensor | None,
    target_probs: Tensor,
    seeds: Tensor,
    positions: Tensor,
) -> VerifyResult:
    """Speculative sampling (Leviathan/Chen): output tokens are distributed exactly as the target's p.

    draft_tokens [R, n]; num_draft [R]; draft_probs [R, n, V] is q, the distribution each draft was sampled
    from (None: greedy drafts, q one-hot); target_probs [R, n + 1, V] is processed p; seeds [R];
    positions [R, n + 1] are the absolute positions of the n + 1 output slots.
    """
    num_reqs, n = draft_tokens.shape
    vocab_size = target_probs.shape[-1]
    drafts = draft_tokens.long().clamp(min=0)[..., None]  # [R, n, 1]
    p_draft = target_probs[:, :n].gather(-1, drafts)[..., 0].float()  # [R, n]
    q_draft = torch.ones_like(p_draft) if draft_probs is None else draft_probs.gather(-1, drafts)[..., 0].float()
    u = keyed_uniform(seeds, positions[:, :n], VERIFY_SALT)  # [R, n]
    # u < p/q written without the division: q = 0 for a sampled draft cannot happen, p = 0 always rejects.
    accepted = _draft_mask(draft_tokens, num_draft) & (u * q_draft < p_draft)
    num_accepted = _accepted_prefix(accepted)  # [R]

    rows = torch.arange(num_reqs, device=target_probs.device)
    p_row = target_probs[rows, num_accepted].float()  # [R, V]
    rejected = num_accepted < num_draft  # else every proposal was accepted: a bonus from p
    if n > 0:
        slot = num_accepted.clamp(max=n - 1)
        proposed = rejected & (draft_tokens[rows, slot] >= 0)
        q_row = _draft_row(draft_probs, draft_tokens, slot, vocab_size) * proposed[:, None]  # [R, V]
    else:
        q_row = torch.zeros_like(p_row)
    residual = (p_row - q_row).clamp(min=0)  # [R, V]
    dist = torch.where(residual.sum(-1, keepdim=True) > RESIDUAL_EPS, residual, p_row)
    salt = torch.where(rejected, RESAMPLE_SALT, BONUS_SALT)  # [R]
    pos = positions.gather(1, num_accepted[:, None])  # [R, 1]
    last = sample_from_probs(dist[:, None], seeds, pos, salt)[:, 0]  # [R]
    return VerifyResult(num_accepted, _assemble(draft_tokens, num_accepted, last))


def verify_mixed(
    draft_tokens: Tensor,
    num_draft: Tensor,
    target_logits: Tensor,
    draft_probs: Tensor | None,
    is_greedy: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    min_p: Tensor,
    seeds: Tensor,
    positions: Tensor,
    any_sampled: bool = True,
    filtered_rows: list[int] | None = None,
    coupled: bool = False,
) -> VerifyResult:
    """One batch of greedy and sampled rows. target_logits [R, n + 1, V]; is_greedy and params [R].

    Greedy rows take the argmax branch; sampled rows verify against processed_probs(target_logits).
    any_sampled=False (host data: no sampled row) skips the sampled branch; filtered_rows: see processed_probs.
    coupled (the deterministic mode): verify_coupled instead of min(1, p/q).
    """
    greedy = verify_greedy(draft_tokens, num_draft, target_logits)
    if not any_sampled:
        return greedy
    if coupled:
        return verify_greedy_ids(draft_tokens, num_draft, coupled_tokens(
            target_logits, is_greedy, temperature, top_k, top_p, min_p, seeds, positions, filtered_rows))
    p = processed_probs(target_logits, temperature, top_k, top_p, min_p, filtered_rows)  # [R, n + 1, V]
    sampled = verify_sampled(draft_tokens, num_draft, draft_probs, p, seeds, positions)
    return VerifyResult(
        torch.where(is_greedy, greedy.num_accepted, sampled.num_accepted),
        torch.where(is_greedy[:, None], greedy.output_tokens, sampled.output_tokens),
    )


def coupled_tokens(target_logits: Tensor, is_greedy: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor,
                   min_p: Tensor, seeds: Tensor, positions: Tensor, filtered_rows: list[int] | None) -> Tensor:
    """The target's token at every slot, decided by that slot alone -> [R, n + 1] int64: the argmax for greedy rows;
    for sampled rows argmax(log p + Gumbel(seed, position)), the noise plain sampling draws at that position (an
    exact sample of p). A row without top-k / top-p / min-p takes argmax(logits / T + Gumbel): log p differs from
    logits / T by the row's log-sum-exp, which moves no argmax, and elementwise arithmetic sees no batch shape, so
    such rows go several at a time; a filtered slot's p is computed on its own [1, 1, V] logits. Accepting
    drafts while they equal these tokens (verify_greedy_ids) is lossless, and the output equals plain decoding's
    whatever the drafts were; sampled drafts are accepted less often than min(1, p/q). Reads the rows' greedy flags
    on the host."""
    ids = target_logits.argmax(-1)  # [R, n + 1]
    filtered = set(range(ids.shape[0]) if filtered_rows is None else filtered_rows)
    sampled = [r for r, greedy in enumerate(is_greedy.tolist()) if not greedy]
    free = [r for r in sampled if r not in filtered]
    step = COUPLED_ROWS if ids.is_cuda else 1
    for i in range(0, len(free), step):
        rows = torch.tensor(free[i:i + step], device=ids.device)
        x = target_logits[rows].float() / temperature[rows].float()[:, None, None]  # [r, n + 1, V]
        ids[rows] = (x + keyed_gumbel(seeds[rows], positions[rows], x.shape[-1], BONUS_SALT)).argmax(-1)
    for r in sampled:
        if r not in filtered:
            continue
        one = slice(r, r + 1)
        for k in range(ids.shape[1]):
            p = processed_probs(target_logits[one, k:k + 1].clone(), temperature[one], top_k[one], top_p[one],
                                min_p[one], [0])  # [1, 1, V]
            ids[r, k] = sample_from_probs(p, seeds[one], positions[one, k:k + 1], BONUS_SALT)[0, 0]
    return ids
