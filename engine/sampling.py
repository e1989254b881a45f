"""Keyed (seed, position) randomness and the target's processed distribution; pure tensor functions.

No host syncs and no generator state, so every function here can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .sampling_params import GREEDY_TEMPERATURE

# Salts keep the noise streams disjoint: a draft and the residual it is resampled from never share noise.
DRAFT_SALT = 1 << 30
VERIFY_SALT = (1 << 30) + 1
RESAMPLE_SALT = (1 << 30) + 2
BONUS_SALT = (1 << 30) + 3


def _s64(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


_GAMMA = _s64(0x9E3779B97F4A7C15)
_M1 = _s64(0xBF58476D1CE4E5B9)
_M2 = _s64(0x94D049BB133111EB)
_SEED_KEY = _s64(0xD1B54A32D192ED03)


def _srl(z: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix64(z: Tensor) -> Tensor:
    """splitmix64 finalizer: a bijection on 64 bits with full avalanche; int64 ops wrap mod 2^64."""
    z = (z ^ _srl(z, 30)) * _M1
    z = (z ^ _srl(z, 27)) * _M2
    return z ^ _srl(z, 31)


def _absorb(h: Tensor, x: Tensor | int) -> Tensor:
    step = _s64(x * _GAMMA % (1 << 64)) if isinstance(x, int) else x * _GAMMA  # Python ints do not wrap
    return _mix64(h + step)


def _keyed_bits(seeds: Tensor, positions: Tensor, salt: int | Tensor) -> Tensor:
    """64 random bits per (seed, salt, position). seeds [R], salt int or [R], positions [R, n] -> [R, n]."""
    h = _absorb(_mix64(seeds.long() ^ _SEED_KEY), salt)  # [R]
    return _absorb(h[:, None], positions.long())  # [R, n]


def keyed_uniform(seeds: Tensor, positions: Tensor, salt: int | Tensor) -> Tensor:
    """Uniform in (0, 1) keyed by (seed, position, salt). seeds [R] int64, positions [R, n] -> [R, n] fp32."""
    top23 = _srl(_keyed_bits(seeds, positions, salt), 41)
    return (top23.float() + 0.5) * 2.0**-23  # midpoints of a 2^-23 grid: exact in fp32, never 0 or 1


def keyed_gumbel(seeds: Tensor, positions: Tensor, vocab_size: int, salt: int | Tensor) -> Tensor:
    """Gumbel noise keyed by (seed, position, token id, salt). seeds [R], positions [R, n] -> [R, n, V] fp32."""
    return keyed_gumbel_at(seeds, positions, torch.arange(vocab_size, device=positions.device), salt)


def keyed_gumbel_at(seeds: Tensor, positions: Tensor, token_ids: Tensor, salt: int | Tensor) -> Tensor:
    """keyed_gumbel's noise at the given token ids only: token_ids [V] or [R, n, K] -> [R, n, V or K] fp32."""
    bits = _absorb(_keyed_bits(seeds, positions, salt)[..., None], token_ids.long())  # [R, n, V]
    # The argmax is decided where -log1p(-w) ~ Exp(1) is small, i.e. w near 0: a 53-bit integer rounded to
    # fp32 keeps 24 significant bits there, where a fixed-point uniform would tie at large vocab sizes.
    w = (_srl(bits, 11).float() * 2.0**-53).clamp(2.0**-60, 1.0 - 2.0**-24)
    return -torch.log(-torch.log1p(-w))


def sample_from_probs(probs: Tensor, seeds: Tensor, positions: Tensor, salt: int | Tensor) -> Tensor:
    """Gumbel-max sample. probs [R, n, V] (need not be normalized), positions [R, n] -> tokens [R, n] int64."""
    noise = keyed_gumbel(seeds, positions, probs.shape[-1], salt)  # [R, n, V]
    return (probs.log() + noise).argmax(-1)  # log 0 = -inf: zero-probability tokens are never chosen


def processed_probs(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor,
                    filtered_rows: list[int] | None = None) -> Tensor:
    """The target's p: temperature, then top-k, top-p, min-p, renormalized. logits [R, n, V]; params [R].

    Greedy rows (temperature < 1e-5) get the untempered softmax; they never use p. `filtered_rows` (host data):
    the rows that set top-k, top-p or min-p; the others get the tempered softmax without the sort. None: treat
    every row as filtered. Each row's arithmetic depends on its own parameters only, so p is batch-invariant.
    """
    t = torch.where(temperature < GREEDY_TEMPERATURE, 1.0, temperature.float())
    x = logits.float() / t[:, None, None]  # [R, n, V]
    if filtered_rows is None:
        return _filtered(x, top_k, top_p, min_p)
    out = x.softmax(-1)
    if filtered_rows:
        rows = torch.tensor(filtered_rows, device=x.device)
        out[rows] = _filtered(x[rows], top_k[rows], top_p[rows], min_p[rows])
    return out


def _filtered(x: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor) -> Tensor:
    """Tempered logits [R, n, V] -> top-k, then top-p, then min-p, renormalized."""
    vocab_size = x.shape[-1]
    sorted_x, order = x.sort(-1, descending=True)  # [R, n, V]
    rank = torch.arange(vocab_size, device=x.device)
    k = torch.where(top_k > 0, top_k, vocab_size)[:, None, None]
    probs = sorted_x.masked_fill(rank >= k, float("-inf")).softmax(-1)  # renormalized over the top k
    mass_before = probs.cumsum(-1) - probs
    top_p = top_p[:, None, None]
    keep = (mass_before < top_p) | (top_p >= 1.0)  # smallest prefix with mass >= top_p; rank 0 always
    keep &= probs >= min_p[:, None, None] * probs[..., :1]  # p/max p is unchanged by renormalizing
    keep[..., 0] = True
    probs = probs * keep
    probs = probs / probs.sum(-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(-1, order, probs)
