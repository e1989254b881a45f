"""A step's per-request logits processing: logit_bias, penalties, min_tokens and grammars before verification,
logprobs after.
Host lists become tensors for the rows that ask only; a batch where none asks costs nothing."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .grammar_state import apply_grammar
from .logprobs import token_logprobs, unpack_row
from .penalties import add_logit_bias, apply_penalties, counts_before, mask_before_min, token_counts
from .request import Request


@dataclass(frozen=True)
class StepLogprobs:
    """The logprobs of one verify step's output tokens, for the rows that asked."""

    rows: list[int]  # batch rows
    num_top: list[int]  # per row: alternatives asked for (<= width)
    width: int  # alternatives computed per token
    values: Tensor  # [len(rows), W, 1 + 2 * width] fp32 (logprobs.token_logprobs)

    def of_row(self, values: list, row: int, tokens: list[int]) -> list[tuple] | None:
        """Host `values` (this.values.tolist()) -> batch row's per-token tuples for its tokens, or None."""
        if row not in self.rows:
            return None
        i = self.rows.index(row)
        return unpack_row(values[i], tokens, self.num_top[i], self.width)


def _upload(values: list, dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)  # no wait for the stream


def _padded(rows: list[list[int]]) -> list[list[int]]:
    width = max(1, max(map(len, rows)))
    return [r + [-1] * (width - len(r)) for r in rows]


def _prompt_mask(r: Request, vocab_size: int, device: torch.device) -> Tensor:
    """[V] bool: the prompt's ids, made once per request."""
    if r.prompt_mask is None:
        ids = _upload(r.prompt_ids, torch.int64, device)
        r.prompt_mask = torch.zeros(vocab_size, dtype=torch.bool, device=device).index_fill_(0, ids, True)
    return r.prompt_mask


def process_logits(reqs: list[Request], logits: Tensor, drafts: Tensor | None,
                   pending: list[list[int]] | None = None) -> Tensor:
    """logit_bias, min_tokens, the penalties and the grammar's masks (in that order) on the rows whose requests set
    them, in place. logits
    [R, W, V]: position j of row b is the token after its anchor and drafts[b, :j] (drafts [R, >= W - 1] on the
    device, or None when W = 1); pending[b]: tokens committed after r.output_ids that it does not hold yet (a step
    launched ahead; never for a constrained row, whose step is not launched ahead)."""
    rows = [i for i, r in enumerate(reqs) if r.params.has_penalties or r.params.min_tokens > 0 or r.params.logit_bias]
    if rows:
        _penalize(reqs, rows, logits, drafts, pending)
    return apply_grammar(reqs, logits, drafts)


def _penalize(reqs: list[Request], rows: list[int], logits: Tensor, drafts: Tensor | None,
              pending: list[list[int]] | None) -> None:
    dev, vocab_size = logits.device, logits.shape[-1]
    sub = [reqs[i] for i in rows]
    outputs = [r.output_ids + (pending[i] if pending is not None else []) for i, r in zip(rows, sub)]
    idx = _upload(rows, torch.int64, dev)
    floats = _upload([[r.params.repetition_penalty for r in sub], [r.params.presence_penalty for r in sub],
                      [r.params.frequency_penalty for r in sub]], torch.float32, dev)
    ints = _upload([[len(o) for o in outputs], [r.params.min_tokens for r in sub]], torch.int64, dev)
    x = logits[idx]  # [R', W, V]
    if any(r.params.logit_bias for r in sub):
        pairs = [r.params.logit_bias or ((0, 0.0),) for r in sub]
        ids = _upload(_padded([[t for t, _ in p] for p in pairs]), torch.int64, dev)  # [R', B]
        biases = _upload([[b for _, b in p] + [0.0] * (ids.shape[1] - len(p)) for p in pairs], torch.float32, dev)
        x = add_logit_bias(x, ids, biases)
    if any(r.params.min_tokens > 0 for r in sub):
        banned = torch.zeros(len(sub), vocab_size, dtype=torch.bool, device=dev)
        ids = _upload(_padded([list(r.banned_before_min) for r in sub]), torch.int64, dev)
        banned.scatter_(1, ids.clamp(min=0), ids >= 0)
        x = mask_before_min(x, banned, ints[0], ints[1])
    if any(r.params.has_penalties for r in sub):
        no_prompt = torch.zeros(vocab_size, dtype=torch.bool, device=dev)
        prompt = torch.stack([_prompt_mask(r, vocab_size, dev) if r.params.repetition_penalty != 1.0 else no_prompt
                              for r in sub])  # [R', V]
        counts = token_counts(_upload(_padded(outputs), torch.int64, dev), vocab_size)  # [R', V]
        d = drafts[idx, :x.shape[1] - 1] if drafts is not None else x.new_zeros(len(sub), 0, dtype=torch.int64)
        x = apply_penalties(x, prompt, counts_before(counts, d), floats[0], floats[1], floats[2])
    logits[idx] = x


def step_logprobs(reqs: list[Request], logits: Tensor, tokens: Tensor) -> StepLogprobs | None:
    """Logprobs of each row's output tokens for the requests that ask (None when none does). logits [R, W, V]
    processed; tokens [R, >= W] (-1: none)."""
    rows = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
    if not rows:
        return None
    num_top = [reqs[i].params.logprobs for i in rows]
    idx = _upload(rows, torch.int64, logits.device)
    t = _upload([reqs[i].params.temperature for i in rows], torch.float32, logits.device)
    values = token_logprobs(logits[idx], t, tokens[idx, :logits.shape[1]], max(num_top))
    return StepLogprobs(rows, num_top, max(num_top), values)
