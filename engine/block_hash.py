"""Prefix-cache block hashes: one per full block of a sequence, each chained over every block before it (as vLLM's
automatic prefix caching keys its blocks), so two sequences share a block's hash exactly when they share everything
up to the end of that block. The engine's prefix cache and the Serve router's affinity both key blocks by these."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT = b""  # the parent of a sequence's first block; a salt (another model, an adapter) gives another root
DIGEST_BYTES = 16  # 128-bit blake2b: a collision would hand one sequence another's cached K/V
_IDS = "I"  # token ids packed as 4-byte unsigned ints
assert array(_IDS).itemsize == 4


def chain_hashes(data: bytes, block_bytes: int, parent: bytes = ROOT) -> list[bytes]:
    """One hash per full `block_bytes` slice of `data`: h_i = blake2b(h_{i-1} || slice_i), h_0's parent being
    `parent` (the last hash of the sequence's earlier blocks, to extend it). A partial last slice has none."""
    if block_bytes < 1:
        raise ValueError(f"block_bytes must be >= 1, got {block_bytes}")
    out, h = [], parent
    view = memoryview(data)
    for start in range(0, len(data) - block_bytes + 1, block_bytes):
        h = hashlib.blake2b(h + view[start:start + block_bytes], digest_size=DIGEST_BYTES).digest()
        out.append(h)
    return out


def block_hashes(token_ids: Sequence[int], block_size: int, parent: bytes = ROOT) -> list[bytes]:
    """The hashes of every full block of `block_size` token ids: len(token_ids) // block_size of them. To extend a
    sequence's hashes, pass its last hash as `parent` and only the ids after its last full block."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return chain_hashes(array(_IDS, token_ids).tobytes(), 4 * block_size, parent)


def salted_root(salt: bytes) -> bytes:
    """A root for sequences that must never share blocks with unsalted ones (another model or adapter)."""
    return hashlib.blake2b(b"dspark-root:" + salt, digest_size=DIGEST_BYTES).digest()
