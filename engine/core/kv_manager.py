"""KVCacheManager: the only owner of KV blocks, for the target's cache and the draft's context cache. The scheduler
asks it for a request's blocks before a step and gives them back when the request ends. With prefix caching, full
blocks are shared between requests by the hash of everything up to their end (engine/core/block_pool.py): a
request is admitted with the longest prefix both caches hold, and needs no target or draft work for it."""

from __future__ import annotations

from ..block_hash import block_hashes
from ..request import Request
from .block_pool import BlockPool


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, draft_blocks: int | None = None,
                 enable_prefix_caching: bool = True) -> None:
        """`draft_blocks`: the draft cache's blocks (None: no draft)."""
        self.block_size, self.caching = block_size, enable_prefix_caching
        self.target = BlockPool(num_blocks, block_size)
        self.draft: BlockPool | None = None
        self.queries = self.hits = 0  # prompt tokens looked up in the cache, and found there
        self.set_draft(draft_blocks)

    def set_draft(self, num_blocks: int | None) -> None:
        """A new draft cache (None: none). The requests' draft blocks must have been dropped (drop_draft)."""
        self.draft = BlockPool(num_blocks, self.block_size) if num_blocks is not None else None

    def drop_draft(self, req: Request) -> None:
        """Forget the request's draft blocks without returning them (their pool is being replaced)."""
        req.draft_blocks, req.registered_draft, req.draft_context_len = [], 0, 0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def fits_alone(self, target_tokens: int, draft_tokens: int) -> bool:
        """Whether a request needing these many cache slots fits the empty pools at all."""
        return self.blocks_for(target_tokens) <= self.target.num_blocks and \
            (self.draft is None or self.blocks_for(draft_tokens) <= self.draft.num_blocks)

    def admit(self, req: Request, prefill_end: int, target_tokens: int, draft_tokens: int) -> bool:
        """Blocks for a request about to prefill positions [0, prefill_end): the longest cached prefix both caches
        hold (at least the last position is left to compute), then new blocks up to target_tokens / draft_tokens.
        Sets num_computed (and num_cached_tokens) to the cached prefix; False, holding nothing, when short."""
        hit: list[int] = []
        if self.caching and req.params.prompt_logprobs is None:  # prompt logprobs need every position computed
            hashes = self._hashes(req, (prefill_end - 1) // self.block_size)
            hit = self.target.cached_prefix(hashes)
            if self.draft is not None:
                hit = hit[:len(self.draft.cached_prefix(hashes[:len(hit)]))]
            self.queries += prefill_end
            self.hits += len(hit) * self.block_size
        n = len(hit)
        self.target.take(hit)
        req.target_blocks = list(hit)
        if self.draft is not None:
            drafted = self.draft.cached_prefix(req.block_hashes[:n])
            self.draft.take(drafted)
            req.draft_blocks = list(drafted)
        if not self.grow(req, target_tokens, draft_tokens):
            self.free(req)
            if self.caching and req.params.prompt_logprobs is None:
                self.queries -= prefill_end
                self.hits -= n * self.block_size
            return False
        req.num_computed = req.num_cached_tokens = req.draft_context_len = n * self.block_size
        req.registered_target = req.registered_draft = n
        return True

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

    def commit(self, req: Request) -> None:
        """Register the request's blocks that became full of computed K/V (target: below num_computed; draft:
        below its context written so far), so later prompts may share them."""
        if not self.caching:
            return
        bs = self.block_size
        full_t = min(min(req.num_computed, req.num_tokens) // bs, len(req.target_blocks))
        full_d = min(req.draft_context_len // bs, full_t, len(req.draft_blocks)) if self.draft is not None else 0
        if full_t <= req.registered_target and full_d <= req.registered_draft:
            return
        hashes = self._hashes(req, full_t)
        for j in range(req.registered_target, full_t):
            self.target.register(req.target_blocks[j], hashes[j])
        req.registered_target = full_t
        if self.draft is not None:
            for j in range(req.registered_draft, full_d):
                self.draft.register(req.draft_blocks[j], hashes[j])
            req.registered_draft = max(req.registered_draft, full_d)

    def free(self, req: Request) -> None:
        self.target.free(req.target_blocks)
        req.target_blocks = []
        if self.draft is not None:
            self.draft.free(req.draft_blocks)
        req.draft_blocks = []
        req.registered_target = req.registered_draft = 0

    def all_free(self) -> bool:
        return self.target.num_free == self.target.num_blocks and \
            (self.draft is None or self.draft.num_free == self.draft.num_blocks)

    def _hashes(self, req: Request, num_blocks: int) -> list[bytes]:
        """The hashes of the request's first num_blocks full blocks of tokens, extended as it grows."""
        have = len(req.block_hashes)
        if num_blocks > have:
            bs = self.block_size
            tokens = (req.prompt_ids + req.output_ids)[have * bs:num_blocks * bs]
            req.block_hashes.extend(block_hashes(tokens, bs, req.block_hashes[-1] if have else b""))
        return req.block_hashes[:num_blocks]
