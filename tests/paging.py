"""Test helper: lay sequences out in a paged cache, one fixed run of blocks per sequence."""

from __future__ import annotations

import torch

from dspark_serve.kernels.attention import AttentionMetadata


def metadata(context_lens: list[int], query_lens: list[int], block_size: int, blocks_per_seq: int,
             causal: bool = True, seq_ids: list[int] | None = None) -> AttentionMetadata:
    """Sequence b (cache row seq_ids[b]) already holds context_lens[b] tokens and adds query_lens[b] new ones."""
    seq_ids = seq_ids if seq_ids is not None else list(range(len(context_lens)))
    table = torch.tensor([[s * blocks_per_seq + j for j in range(blocks_per_seq)] for s in seq_ids])
    slots = []
    for s, c, q in zip(seq_ids, context_lens, query_lens):
        slots += [(s * blocks_per_seq + p // block_size) * block_size + p % block_size for p in range(c, c + q)]
    seq_lens = torch.tensor([c + q for c, q in zip(context_lens, query_lens)])
    cu = torch.tensor([0] + query_lens).cumsum(0)
    return AttentionMetadata(cu_seqlens_q=cu, seq_lens=seq_lens, slot_mapping=torch.tensor(slots),
                             block_table=table, max_query_len=max(query_lens), max_seq_len=int(seq_lens.max()),
                             causal=causal)


def positions(context_lens: list[int], query_lens: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(c, c + q) for c, q in zip(context_lens, query_lens)])


_POOLS: "weakref.WeakKeyDictionary" = None  # side -> its BlockAllocator, for tests that drive a side directly


def pool(side) -> "BlockAllocator":
    """A block pool over a TargetSide's or DraftSide's cache (the engine's KVCacheManager owns them otherwise)."""
    import weakref

    from dspark_serve.engine.kv_cache import BlockAllocator

    global _POOLS
    if _POOLS is None:
        _POOLS = weakref.WeakKeyDictionary()
    if side not in _POOLS:
        _POOLS[side] = BlockAllocator(side.num_blocks, side.block_size)
    return _POOLS[side]
