"""A request's grammar state under speculation, and the step's hooks: the token masks of every verified position
(position j: the state after the committed tokens and drafts d_0..d_{j-1}), applied to the target's logits so that
verification samples the masked target exactly; the state advances over the committed tokens only."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger(__name__)


def unpack_bitmask(bits: Tensor, vocab_size: int) -> Tensor:
    """xgrammar's packed mask -> bool. bits [..., ceil(V / 32)] int32 (bit b of word w: token 32 w + b) ->
    [..., V] bool."""
    shifts = torch.arange(32, device=bits.device, dtype=torch.int32)
    return ((bits[..., None] >> shifts) & 1).flatten(-2)[..., :vocab_size].bool()


class GrammarState:
    """One request's matcher (xgrammar.GrammarMatcher) at its committed output. `masks_for` looks ahead over drafts
    and leaves the state where it was; `advance` commits tokens; `rollback` undoes committed ones."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        import xgrammar

        self.matcher, self.vocab_size = matcher, vocab_size
        self._words = (vocab_size + 31) // 32
        self._alloc = xgrammar.allocate_token_bitmask
        self.failed = False  # a committed token the grammar refused: the mask is off from there (logged)

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    def masks_for(self, drafts: list[int]) -> Tensor:
        """[len(drafts) + 1, ceil(V / 32)] int32 on the host: row j is the mask after drafts[:j]. Rows past a draft
        the grammar refuses repeat that draft's row (verification rejects it there, so they are never used)."""
        bits = self._alloc(len(drafts) + 1, self.vocab_size)
        if self.failed or self.matcher.is_terminated():  # past the grammar's end (ignore_eos): unconstrained
            return bits
        taken = 0
        m = self.matcher
        for j in range(len(drafts) + 1):
            m.fill_next_token_bitmask(bits, j)
            if j == len(drafts):
                break
            if not m.accept_token(drafts[j]):
                bits[j + 1:] = bits[j]
                break
            taken += 1
            if m.is_terminated():  # a stop token: nothing follows it
                bits[j + 1:] = bits[j]
                break
        if taken:
            m.rollback(taken)
        return bits

    def advance(self, tokens: list[int]) -> bool:
        """Commit the accepted drafts and the correction or bonus token; False (and the mask off) if the grammar
        refuses one, which a token sampled from the masked target cannot be."""
        for i, t in enumerate(tokens):
            if self.failed or self.matcher.is_terminated():
                return not self.failed
            if not self.matcher.accept_token(t):
                self.failed = True
                log.warning("structured output: the grammar refused committed token %d; unconstrained from here", t)
                return False
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens committed tokens."""
        if num_tokens:
            self.matcher.rollback(num_tokens)


def grammar_rows(reqs: list) -> list[int]:
    return [i for i, r in enumerate(reqs) if getattr(r, "grammar", None) is not None]


def has_grammar(reqs: list) -> bool:
    """Whether any request of the batch is constrained (the step is then not launched ahead)."""
    return bool(grammar_rows(reqs))


def apply_grammar(reqs: list, logits: Tensor, drafts: Tensor | None) -> Tensor:
    """-inf where the grammar refuses, on the constrained rows, in place. logits [R, W, V]: position j of row b is
    the token after its anchor and drafts[b, :j] (drafts [R, >= W - 1] on the device, or None when W = 1)."""
    rows = grammar_rows(reqs)
    if not rows:
        return logits
    width, dev = logits.shape[1], logits.device
    host = drafts[rows, :width - 1].tolist() if drafts is not None and width > 1 else [[] for _ in rows]
    packed = []
    for i, d in zip(rows, host):
        valid = d[:next((k for k, t in enumerate(d) if t < 0), len(d))]
        bits = reqs[i].grammar.masks_for(valid)  # [len(valid) + 1, words]
        packed.append(torch.cat([bits, bits[-1:].expand(width - bits.shape[0], -1)]) if bits.shape[0] < width
                      else bits[:width])
    allowed = unpack_bitmask(torch.stack(packed).to(dev, non_blocking=True), logits.shape[-1])  # [R', W, V]
    idx = torch.tensor(rows, device=dev)
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
    return logits


def advance_grammar(req: Any, tokens: list[int]) -> None:
    """After a step appends `tokens` to req.output_ids: the grammar state follows."""
    if getattr(req, "grammar", None) is not None and tokens:
        req.grammar.advance(tokens)
