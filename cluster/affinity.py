"""Prefix affinity, the routing policy without Ray: the prompt's chained block hashes (engine/block_hash.py), a table
of which replica last took each block, and the choice: the replica holding the longest prefix while load is in
balance (the holder at most imbalance_threshold requests above the mean), else the less loaded of two. The Serve router (prefix_router.py) and bench/bench_routing_sim.py run it."""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from dspark_serve.engine.block_hash import block_hashes, chain_hashes

Replica = Hashable


@dataclass(frozen=True)
class AffinityConfig:
    block_size: int = 16  # tokens per key block for a token-id prompt: the engine's block_size, so keys are its blocks
    chunk_bytes: int = 64  # UTF-8 bytes per key block for a text or chat prompt (the router has no tokenizer)
    imbalance_threshold: int = 2  # ongoing requests the holder may have beyond the mean replica's
    max_keys: int = 1 << 20  # block hashes remembered (least recently used go first): ~100 MB at most

    def __post_init__(self) -> None:
        for name in ("block_size", "chunk_bytes", "max_keys"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        if not isinstance(self.imbalance_threshold, int) or self.imbalance_threshold < 0:
            raise ValueError(f"imbalance_threshold must be an int >= 0, got {self.imbalance_threshold!r}")


def token_keys(token_ids: Sequence[int], cfg: AffinityConfig) -> list[bytes]:
    """The engine's own prefix-cache block hashes of a tokenized prompt."""
    return block_hashes(token_ids, cfg.block_size)


def text_keys(text: str, cfg: AffinityConfig) -> list[bytes]:
    """A stand-in for the tokens' hashes: fixed-size byte chunks of the text, chained the same way. Two prompts share
    a chunk's key exactly when they share every byte up to its end, as their token blocks do (up to a block)."""
    return chain_hashes(text.encode("utf-8", "surrogatepass"), cfg.chunk_bytes)


def chat_text(messages: Sequence[tuple[str, str, str]]) -> str:
    """(role, content, tool_calls_json) per message, joined with separators no message holds: a conversation's next
    turn (its messages plus new ones) starts with the same text, as its chat-templated prompt does."""
    return "".join(f"{role}\x1f{content}\x1f{calls}\x1e" for role, content, calls in messages)


def session_keys(session_id: str) -> list[bytes]:
    """One key for a client-named session (Serve's session id), when the router cannot see the prompt."""
    return [hashlib.blake2b(b"session:" + session_id.encode(), digest_size=16).digest()] if session_id else []


class AffinityTable:
    """block hash -> the replica that last took it, least recently used evicted beyond max_keys."""

    def __init__(self, max_keys: int) -> None:
        self.max_keys = max_keys
        self._owner: OrderedDict[bytes, Replica] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owner)

    def match(self, keys: Sequence[bytes], alive: Mapping[Replica, int]) -> tuple[Replica | None, int]:
        """The live replica holding the longest prefix of `keys`, and how many blocks it holds (0: none). Chained
        hashes make a held block imply its prefix, so the walk goes from the last block back."""
        for i in range(len(keys) - 1, -1, -1):
            owner = self._owner.get(keys[i])
            if owner is not None and owner in alive:
                return owner, i + 1
        return None, 0

    def insert(self, keys: Sequence[bytes], replica: Replica) -> None:
        owner = self._owner
        for k in keys:
            owner[k] = replica
            owner.move_to_end(k)
        while len(owner) > self.max_keys:
            owner.popitem(last=False)

    def forget(self, replica: Replica) -> None:
        for k in [k for k, r in self._owner.items() if r == replica]:
            del self._owner[k]


def less_loaded_of_two(loads: Mapping[Replica, int], rng: random.Random) -> Replica:
    replicas = list(loads)
    if len(replicas) == 1:
        return replicas[0]
    a, b = rng.sample(replicas, 2)
    return a if loads[a] <= loads[b] else b


def choose(keys: Sequence[bytes], loads: Mapping[Replica, int], table: AffinityTable, cfg: AffinityConfig,
           rng: random.Random) -> tuple[Replica, Replica | None]:
    """(the replica to use, the holder of the prompt's prefix if any). `loads`: ongoing requests per live replica.
    The holder wins while its load is at most imbalance_threshold above the mean replica's."""
    holder, _ = table.match(keys, loads)
    if holder is not None and loads[holder] - sum(loads.values()) / len(loads) <= cfg.imbalance_threshold:
        return holder, holder
    return less_loaded_of_two(loads, rng), holder
