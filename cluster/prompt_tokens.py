"""Prompt text -> token ids for the gateway, the long pieces between added tokens cached. A tokenizer takes its added
tokens (<|im_start|>, <|im_end|>, ...) out of the text first and encodes each piece between them on its own, so a
prompt's ids are its pieces' ids in order: a chat's system prompt and earlier turns, sent again with every turn, are
encoded once. Used only where that holds exactly (no added token strips the whitespace beside it, matches whole words
only or is matched after normalization, nothing is added around the text, no padding or truncation); otherwise every
text is encoded whole."""

from __future__ import annotations

import re
import threading
from array import array
from collections import OrderedDict
from typing import Any

MIN_PIECE_CHARS = 256  # shorter pieces are encoded each time (cheaper than the bookkeeping)
MAX_CACHED_CHARS = 32 << 20  # pieces kept, by their characters (least recently used dropped first): ~100 MB with
# their ids (4 bytes each)


class PromptTokenizer:
    def __init__(self, tokenizer: Any, max_cached_chars: int = MAX_CACHED_CHARS,
                 min_piece_chars: int = MIN_PIECE_CHARS) -> None:
        """tokenizer: a `tokenizers.Tokenizer`."""
        self.tokenizer, self.max_cached_chars, self.min_piece_chars = tokenizer, max_cached_chars, min_piece_chars
        added = list(tokenizer.get_added_tokens_decoder().items())
        post = tokenizer.post_processor
        self.exact = bool(added) and tokenizer.padding is None and tokenizer.truncation is None and \
            all(not (t.lstrip or t.rstrip or t.single_word or t.normalized) for _, t in added)
        self._adds_tokens = post is not None and post.num_special_tokens_to_add(False) > 0
        self._ids = {t.content: i for i, t in added}
        # leftmost, then longest: the order the tokenizer's own matcher takes them in
        contents = sorted(self._ids, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, contents)) + ")") if contents else None
        self._cache: OrderedDict[str, array] = OrderedDict()  # piece -> its ids
        self._chars = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0  # long pieces found in the cache, and encoded

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """What `tokenizer.encode(text, add_special_tokens)` gives, in a thread that may run beside others (the
        tokenizer releases the GIL in encode_batch)."""
        if not self.exact or (add_special_tokens and self._adds_tokens) or len(text) < 2 * self.min_piece_chars:
            return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        pieces = self._split.split(text)  # text, added token, text, ..., text
        found: dict[str, list[int] | array] = {}
        with self._lock:
            for p in pieces[::2]:
                ids = self._cache.get(p) if len(p) >= self.min_piece_chars else None
                if ids is not None:
                    self._cache.move_to_end(p)
                    found[p] = ids
                    self.hits += 1
        todo = list(dict.fromkeys(p for p in pieces[::2] if p and p not in found))
        if todo:
            for p, enc in zip(todo, self.tokenizer.encode_batch(todo, add_special_tokens=False)):
                found[p] = enc.ids
            self._remember([p for p in todo if len(p) >= self.min_piece_chars], found)
        out: list[int] = []
        for i, p in enumerate(pieces):
            if i % 2:
                out.append(self._ids[p])
            elif p:
                out += found[p]
        return out

    def _remember(self, pieces: list[str], found: dict[str, list[int] | array]) -> None:
        with self._lock:
            self.misses += len(pieces)
            for p in pieces:
                if p not in self._cache and len(p) <= self.max_cached_chars:
                    self._cache[p] = array("i", found[p])
                    self._chars += len(p)
            while self._chars > self.max_cached_chars:
                old, _ = self._cache.popitem(last=False)
                self._chars -= len(old)
