"""The grammar's masks for the draft's eager Markov walk: step k of a constrained row may only pick what the grammar
allows after that row's drafts d_0..d_{k-1}, so its drafts stay inside the grammar (more of them are accepted). q
is the masked distribution each draft was drawn from; a row whose allowed set has nothing the draft can say stays
unmasked at that step (then q is the unmasked one). The states are left where they were.

A step where the grammar allows one token only, which the draft can say, drafts it for certain, and the masked
target emits it for certain: its conditional confidence is 1 (FORCED_LOGIT), so the policy verifies a JSON key or
any other forced run as the sure thing it is. Whether step k is forced depends on d_0..d_{k-1} only, never on d_k,
as the policy's losslessness asks."""

from __future__ import annotations

import torch
from torch import Tensor

from .grammar_state import GrammarState, unpack_bitmask


class DraftMasks:
    def __init__(self, states: tuple[GrammarState | None, ...], vocab_size: int, device: torch.device) -> None:
        """states: per batch row, its grammar at the committed output (None: unconstrained)."""
        self.rows = [i for i, s in enumerate(states) if s is not None and not s.failed and not s.terminated]
        self.states = [states[i] for i in self.rows]
        self.num_rows, self.vocab_size, self.device = len(states), vocab_size, device
        self.taken = [0] * len(self.rows)  # drafts accepted into each state so far
        self.alive = [True] * len(self.rows)  # False once a state is past its end or refused a draft

    def __bool__(self) -> bool:
        return bool(self.rows)

    def allowed(self, k: int, prev: Tensor) -> Tensor:
        """[R, V] bool (target vocab): what step k may draft; prev [R] the tokens drafted at k - 1 (ignored at k = 0,
        where they are the anchors). Unconstrained rows allow everything."""
        if k > 0:
            for j, tok in enumerate(prev[self.rows].tolist()):
                m = self.states[j].matcher
                if self.alive[j] and not m.is_terminated() and m.accept_token(tok):
                    self.taken[j] += 1
                else:
                    self.alive[j] = False
        bits = self.states[0]._alloc(self.num_rows, self.vocab_size)  # all allowed
        for j, i in enumerate(self.rows):
            m = self.states[j].matcher
            if self.alive[j] and not m.is_terminated():
                m.fill_next_token_bitmask(bits, i)
        return unpack_bitmask(bits.to(self.device, non_blocking=True), self.vocab_size)

    def close(self) -> None:
        """Undo the drafts accepted into the states."""
        for state, n in zip(self.states, self.taken):
            state.rollback(n)
        self.taken = [0] * len(self.rows)


FORCED_LOGIT = 40.0  # a confidence logit whose sigmoid is 1.0 in fp32


def forced_rows(allowed: Tensor, sayable: Tensor) -> Tensor:
    """allowed [R, V] bool (target vocab), sayable [R, C] bool (those of the draft's C columns) -> [R] bool: the
    grammar allows exactly one token and the draft can say it."""
    return (allowed.sum(-1) == 1) & sayable.any(-1)


def with_forced(conf_logits: Tensor, allowed: Tensor, sayable: Tensor) -> Tensor:
    """[R] confidence logits, FORCED_LOGIT on the forced rows."""
    return torch.where(forced_rows(allowed, sayable), FORCED_LOGIT, conf_logits)


def keep(allowed: Tensor) -> Tensor:
    """allowed [R, C] bool -> [R, C] the columns each row may pick: its allowed ones, or every one where it allows
    none (the row stays unmasked)."""
    return allowed | ~allowed.any(-1, keepdim=True)


def masked(logits: Tensor, allowed: Tensor) -> Tensor:
    """logits [R, C] over C columns, allowed [R, C] bool -> -inf where refused, on the rows that allow any column."""
    return logits.masked_fill(~keep(allowed), float("-inf"))
