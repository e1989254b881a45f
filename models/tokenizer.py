"""The Qwen BPE tokenizer through HF `tokenizers`: from tokenizer.json, or rebuilt from vocab.json + merges.txt."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from .config import CheckpointError

# The Qwen2/Qwen3 pre-tokenizer split (as in their tokenizer.json).
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def load_tokenizer(path: str | Path) -> Tokenizer:
    path = Path(path)
    if (path / "tokenizer.json").is_file():
        return Tokenizer.from_file(str(path / "tokenizer.json"))
    if (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
        return _from_vocab_merges(path)
    raise CheckpointError(f"{path}: no tokenizer.json, nor vocab.json + merges.txt")


def _from_vocab_merges(path: Path) -> Tokenizer:
    tok = Tokenizer(BPE.from_file(str(path / "vocab.json"), str(path / "merges.txt"), fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    config = path / "tokenizer_config.json"
    if config.is_file():
        added = json.loads(config.read_text()).get("added_tokens_decoder", {})
        from tokenizers import AddedToken

        for _, spec in sorted(added.items(), key=lambda kv: int(kv[0])):
            tok.add_special_tokens([AddedToken(spec["content"], special=spec.get("special", True), normalized=False)])
    return tok


def eos_token_ids(path: str | Path) -> list[int]:
    """EOS ids from generation_config.json / config.json (int or list); empty when neither says."""
    for name in ("generation_config.json", "config.json"):
        f = Path(path) / name
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if eos is not None:
                return [eos] if isinstance(eos, int) else list(eos)
    return []
