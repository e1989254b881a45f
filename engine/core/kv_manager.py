"""KVCacheManager: the only owner of KV blocks, for the target's cache and the draft's context cache. The
scheduler asks it for a request's blocks before a step and gives them back when the request ends."""

from __future__ import annotations

from ..kv_cache import BlockAllocator
from ..request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, draft_blocks: int | None = None) -> None:
        """`draft_blocks`: the draft cache's blocks (None: no draft)."""
        self.block_size = block_size
        self.target = BlockAllocator(num_blocks, block_size)
        self.draft: BlockAllocator | None = None
        self.set_draft(draft_blocks)

    def set_draft(self, num_blocks: int | None) -> None:
        """A new draft cache (None: none). The requests' draft blocks must have been dropped (drop_draft)."""
        self.draft = BlockAllocator(num_blocks, self.block_size) if num_blocks is not None else None

    def drop_draft(self, req: Request) -> None:
        """Forget the request's draft blocks without returning them (their pool is being replaced)."""
        req.draft_blocks = []

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def fits_alone(self, target_tokens: int, draft_tokens: int) -> bool:
        """Whether a request needing these many cache slots fits the empty pools at all."""
        return self.blocks_for(target_tokens) <= self.target.num_blocks and \
            (self.draft is None or self.blocks_for(draft_tokens) <= self.draft.num_blocks)

    def grow(self, req: Request, target_tokens: int, draft_tokens: int) -> bool:
        """Give the request blocks for `target_tokens` target slots and `draft_tokens` draft slots (it keeps what
        it has), or nothing when a pool is short."""
        need_t = max(0, self.blocks_for(target_tokens) - len(req.target_blocks))
        need_d = max(0, self.blocks_for(draft_tokens) - len(req.draft_blocks)) if self.draft is not None else 0
        if need_t > self.target.num_free or (self.draft is not None and need_d > self.draft.num_free):
            return False
        if need_t:
            req.target_blocks.extend(self.target.allocate_blocks(need_t))
        if need_d:
            req.draft_blocks.extend(self.draft.allocate_blocks(need_d))
        return True

    def free(self, req: Request) -> None:
        self.target.free(req.target_blocks)
        req.target_blocks = []
        if self.draft is not None:
            self.draft.free(req.draft_blocks)
        req.draft_blocks = []

    def all_free(self) -> bool:
        return self.target.num_free == self.target.num_blocks and \
            (self.draft is None or self.draft.num_free == self.draft.num_blocks)
