"""Text out of token ids as they are generated: each step's delta costs what its new tokens cost, the deltas
concatenate to exactly what `tokenizer.decode` gives for the whole output, and stop strings are matched on a
bounded tail. No torch: the gateway uses it too."""

from __future__ import annotations

import codecs
import copy
from dataclasses import dataclass, field
from typing import Any


MARKUP_TOKENS = frozenset({"<tool_call>", "</tool_call>"})  # text a parser reads: kept even where a converted
# tokenizer marks them special (Qwen's own tokenizers do not)


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte <-> printable character map, as the ByteLevel pre-tokenizer and decoder use it."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_CHAR_BYTES = _byte_level_chars()


def _token_bytes(token: str) -> bytes:
    """What the ByteLevel decoder makes of one token: its mapped bytes, or its UTF-8 when a character is not in
    the map (added tokens written in plain text)."""
    try:
        return bytes(_CHAR_BYTES[c] for c in token)
    except KeyError:
        return token.encode("utf-8")


class TokenText:
    """A tokenizer's decoding, prepared once. For byte-level BPE (Qwen, GPT-2 families) every id maps to its
    bytes; other decoders go through `tokenizers.decoders.DecodeStream`."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        from tokenizers import decoders

        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.table: list[bytes] | None = None
        self._variants = {skip_special_tokens: self}  # shared by every variant of this tokenizer
        if isinstance(tokenizer.decoder, decoders.ByteLevel):
            vocab = tokenizer.get_vocab(with_added_tokens=True)
            self.table = [b""] * (max(vocab.values()) + 1)
            for token, i in vocab.items():
                self.table[i] = _token_bytes(token)
            self._set_added_tokens()

    def _set_added_tokens(self) -> None:
        for i, added in self.tokenizer.get_added_tokens_decoder().items():
            skip = added.special and self.skip_special_tokens and added.content not in MARKUP_TOKENS
            self.table[i] = b"" if skip else _token_bytes(added.content)

    def variant(self, skip_special_tokens: bool) -> TokenText:
        """This tokenizer's decoding with skip_special_tokens so; the other variant is prepared once, when first
        asked for (a copy of this table with the special tokens' entries changed)."""
        other = self._variants.get(skip_special_tokens)
        if other is None:
            other = copy.copy(self)
            other.skip_special_tokens = skip_special_tokens
            if self.table is not None:
                other.table = list(self.table)
                other._set_added_tokens()
            self._variants[skip_special_tokens] = other
        return other

    def stream(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


class IncrementalDetokenizer:
    """One request's text, step by step. An incomplete UTF-8 sequence at the end is held back until the token
    that completes it; `flush` ends the output as a whole decode would (U+FFFD for what never completed)."""

    def __init__(self, text: TokenText) -> None:
        self.text = text
        if text.table is not None:
            self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        else:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=text.skip_special_tokens)
            self._ids: list[int] = []  # only for the last flush of a non-byte-level decoder
            self._emitted = 0

    def push(self, ids: list[int]) -> str:
        table = self.text.table
        if table is not None:
            n = len(table)
            return self._utf8.decode(b"".join(table[i] if 0 <= i < n else b"" for i in ids))
        out = []
        for i in ids:
            self._ids.append(i)
            piece = self._stream.step(self.text.tokenizer, i)
            if piece:
                out.append(piece)
        delta = "".join(out)
        self._emitted += len(delta)
        return delta

    def flush(self) -> str:
        if self.text.table is not None:
            return self._utf8.decode(b"", final=True)
        return self.text.decode(self._ids)[self._emitted:]


class StopStrings:
    """Finds the first stop string in text that arrives piece by piece. Text is released as soon as no stop can
    start in it: the last len(longest stop) - 1 characters are held back, so each search covers the new text and
    that tail only."""

    def __init__(self, stops: tuple[str, ...], include: bool = False) -> None:
        self.stops, self.include = stops, include
        self.hold = max(map(len, stops)) - 1 if stops else 0
        self._pending = ""
        self._inert = 0  # leading characters of _pending pushed with match=False: no stop may end inside them

    def push(self, text: str, match: bool = True) -> tuple[str, bool]:
        """-> (text to release, whether a stop string ended the output). match=False: text that cannot end the
        output (before min_tokens); a stop ending in it is never matched later either."""
        buf = self._pending + text
        hit, end = -1, 0
        for s in self.stops if match else ():
            i = buf.find(s, max(0, self._inert - len(s) + 1))
            if i >= 0 and (hit < 0 or i < hit):
                hit, end = i, i + len(s)
        if hit >= 0:
            self._pending, self._inert = "", 0
            return buf[:end if self.include else hit], True
        cut = max(len(buf) - self.hold, 0)
        self._pending = buf[cut:]
        self._inert = max(0, self._inert - cut) if match else len(self._pending)
        return buf[:cut], False

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out


@dataclass
class TextStream:
    """One request's tokens -> text deltas, with its stop strings; keeps the committed ids and the text pieces
    (joined once, at the end)."""

    detok: IncrementalDetokenizer | None  # None: no tokenizer, token ids only
    stops: StopStrings | None = None
    min_tokens: int = 0  # stop strings end the output only once it has this many tokens
    token_ids: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    stopped: bool = False

    def push(self, ids: list[int]) -> tuple[list[int], str]:
        """A step's new ids -> (the ids kept, the text delta). After a stop string the rest of the step is dropped
        and `stopped` is set."""
        if self.detok is None:
            self.token_ids.extend(ids)
            return ids, ""
        if self.stops is None:
            self.token_ids.extend(ids)
            delta = self.detok.push(ids)
            self.pieces.append(delta)
            return ids, delta
        out = []
        for k, tok in enumerate(ids):  # token by token: the token that completes a stop is the last one kept
            piece, hit = self.stops.push(self.detok.push([tok]), len(self.token_ids) + k + 1 >= self.min_tokens)
            out.append(piece)
            if hit:
                self.stopped = True
                ids = ids[:k + 1]
                break
        self.token_ids.extend(ids)
        delta = "".join(out)
        self.pieces.append(delta)
        return ids, delta

    def finish(self) -> str:
        """The text still held back (incomplete UTF-8, a possible stop's prefix); nothing after a stop."""
        if self.detok is None or self.stopped:
            return ""
        delta = self.detok.flush()
        if self.stops is not None:
            piece, hit = self.stops.push(delta, len(self.token_ids) >= self.min_tokens)
            delta = piece if hit else piece + self.stops.flush()
            self.stopped = hit
        self.pieces.append(delta)
        return delta

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def text_stream(text: TokenText | None, stop: tuple[str, ...] = (), include_stop: bool = False, min_tokens: int = 0,
                skip_special_tokens: bool = True) -> TextStream:
    if text is None:
        return TextStream(None)
    return TextStream(text.variant(skip_special_tokens).stream(),
                      StopStrings(tuple(stop), include_stop) if stop else None, min_tokens)
