"""A real byte-level BPE tokenizer for the tiny test pairs: ids 0-255 are the 256 bytes (so a random model's
output splits UTF-8 characters anywhere), ids from 256 merges learnt from emoji and CJK text."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = ["你好，世界！今天天气很好。", "😀😃😄😁🤖👍🏽🎉✨🚀", "日本語のテキストとかな漢字", "한국어 문장입니다",
          "naïve café — déjà vu", "def f(x):\n    return x * 2\n", "emoji 🙂 and 中文 mixed 🧪 text"] * 20 + \
    ["".join(chr(0x4E00 + 7 * i + j) for j in range(7)) for i in range(400)] + \
    ["".join(chr(0x1F300 + 5 * i + j) for j in range(5)) for i in range(150)]


def byte_tokenizer(vocab_size: int = 256, specials: int = 0) -> Tokenizer:
    """`specials`: the last ids are special tokens <|special_0|>, ... (the BPE learns vocab_size - specials)."""
    special = [f"<|special_{i}|>" for i in range(specials)]
    vocab_size -= specials
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: _byte(c))
    if vocab_size > 256:
        tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=alphabet,
                                                            show_progress=False))
    vocab = {c: _byte(c) for c in alphabet}  # id == byte value
    merges: list[tuple[str, str]] = []
    if vocab_size > 256:
        spec = json.loads(tok.to_str())["model"]
        for m in spec["merges"]:
            a, b = m if isinstance(m, list) else m.split(" ")
            if len(vocab) < vocab_size and a in vocab and b in vocab and a + b not in vocab:
                vocab[a + b] = len(vocab)
                merges.append((a, b))
    tok.model = models.BPE(vocab=vocab, merges=merges)
    tok.add_special_tokens(special)
    return tok


def _byte(c: str) -> int:
    from dspark_serve.engine.detokenize import _CHAR_BYTES

    return _CHAR_BYTES[c]


def write_byte_tokenizer(folder: str | Path, vocab_size: int, specials: int = 0) -> Path:
    path = Path(folder) / "tokenizer.json"
    byte_tokenizer(vocab_size, specials).save(str(path))
    return path
