"""BlockPool: one cache's blocks with automatic prefix caching. A full block whose tokens are known is registered
under its chained hash (engine/block_hash.py) and shared by reference: a request whose prompt starts with the same
blocks takes them instead of computing them. A block nobody holds keeps its contents, evictable, until a new block
is needed: then the least recently freed goes first."""

from __future__ import annotations

from collections import OrderedDict, deque


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: deque[int] = deque(range(num_blocks))  # holding nothing
        self._evictable: OrderedDict[int, None] = OrderedDict()  # held by no request, contents cached; LRU first
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        """Blocks a request can be given: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._block_of)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_blocks(self, n: int) -> list[int]:
        if n > self.num_free:
            raise MemoryError(f"need {n} KV blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._evictable.popitem(last=False)  # the least recently freed cached block
                del self._block_of[self._hash_of.pop(b)]
            self._refs[b] = 1
            out.append(b)
        return out

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._hash_of:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    def cached_prefix(self, hashes: list[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes`."""
        out = []
        for h in hashes:
            b = self._block_of.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def take(self, blocks: list[int]) -> None:
        """Hold cached blocks (found by cached_prefix) for one more request."""
        for b in blocks:
            if self._refs[b] == 0:
                del self._evictable[b]
            self._refs[b] += 1

    def register(self, block: int, h: bytes) -> None:
        """`block` (held, full) holds the tokens of `h`: later prompts may share it. A hash already cached in another
        block keeps that one."""
        if h not in self._block_of and block not in self._hash_of:
            self._block_of[h] = block
            self._hash_of[block] = h
