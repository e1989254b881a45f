"""Paged KV bookkeeping: a block allocator, per-sequence block lists, and attention metadata for a batch."""

from __future__ import annotations

from collections import deque

import torch

from dspark_serve.kernels.attention import AttentionMetadata


class BlockAllocator:
    """Fixed pool of cache blocks; rollback is by sequence length, so blocks only move on growth and release."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= len(self._free)

    def allocate(self, num_tokens: int) -> list[int]:
        return self.allocate_blocks(self.blocks_for(num_tokens))

    def allocate_blocks(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"need {n} KV blocks, {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)


def slots_of(blocks: list[int], start: int, n: int, block_size: int) -> list[int]:
    """Cache slots of positions start .. start + n - 1 of a sequence with these blocks."""
    return [blocks[p // block_size] * block_size + p % block_size for p in range(start, start + n)]


def batch_metadata(block_tables: list[list[int]], starts: list[int], query_lens: list[int], block_size: int,
                   device: torch.device, causal: bool = True) -> AttentionMetadata:
    """Sequence b writes query_lens[b] tokens at positions starts[b].. and sees everything before them."""
    width = max(len(t) for t in block_tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int64)
    slots = [slot for t, s, q in zip(block_tables, starts, query_lens) for slot in slots_of(t, s, q, block_size)]
    seq_lens = [s + q for s, q in zip(starts, query_lens)]
    cu = [0]
    for q in query_lens:
        cu.append(cu[-1] + q)
    as_dev = lambda x: torch.tensor(x, dtype=torch.int64).to(device, non_blocking=True)  # noqa: E731
    return AttentionMetadata(cu_seqlens_q=as_dev(cu), seq_lens=as_dev(seq_lens), slot_mapping=as_dev(slots),
                             block_table=table.to(device, non_blocking=True), max_query_len=max(query_lens),
                             max_seq_len=max(seq_lens), causal=causal, all_slots_valid=True,  # slots from tables
                             prompt_lens=tuple(query_lens) if causal and not any(starts) else ())


def positions_of(starts: list[int], query_lens: list[int], device: torch.device) -> torch.Tensor:
    pos = torch.tensor([p for s, q in zip(starts, query_lens) for p in range(s, s + q)], dtype=torch.int64)
    return pos.to(device, non_blocking=True)  # a pageable copy without waiting for the stream
