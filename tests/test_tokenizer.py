"""The Qwen tokenizer: tokenizer.json and vocab.json + merges.txt agree; the real Qwen3 files give known ids."""

import json
import os
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from dspark_serve.models.config import CheckpointError
from dspark_serve.models.tokenizer import QWEN_SPLIT, load_tokenizer

TEXT = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\nHello, world! I'm Qwen3. 2024年"
QWEN_DIR = Path(os.environ.get("DSPARK_QWEN_TOKENIZER", Path.home() / ".cache/dspark-serve/qwen3-tokenizer"))


def _save_vocab_merges(tok_json: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "vocab.json").write_text(json.dumps(tok_json["model"]["vocab"], ensure_ascii=False))
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok_json["model"]["merges"]]
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")


def test_vocab_merges_rebuild_equals_tokenizer_json(tmp_path):
    from tokenizers import Regex

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.train_from_iterator([TEXT * 3, open(__file__).read()], trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    (tmp_path / "json").mkdir()
    tok.save(str(tmp_path / "json" / "tokenizer.json"))
    _save_vocab_merges(json.loads((tmp_path / "json" / "tokenizer.json").read_text()), tmp_path / "vm")
    a, b = load_tokenizer(tmp_path / "json"), load_tokenizer(tmp_path / "vm")
    ids = a.encode(TEXT).ids
    assert len(ids) < len(TEXT) and b.encode(TEXT).ids == ids
    assert b.decode(ids) == TEXT


def test_missing_tokenizer_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="no tokenizer.json, nor vocab.json"):
        load_tokenizer(tmp_path)


@pytest.mark.skipif(not (QWEN_DIR / "tokenizer.json").is_file(), reason=f"real Qwen3 tokenizer not at {QWEN_DIR}")
def test_real_qwen3_tokenizer(tmp_path):
    tok = load_tokenizer(QWEN_DIR)
    assert tok.encode("Hello, world! I'm Qwen3.").ids == [9707, 11, 1879, 0, 358, 2776, 1207, 16948, 18, 13]
    assert tok.token_to_id("<|im_end|>") == 151645 and tok.get_vocab_size() == 151669
    _save_vocab_merges(json.loads((QWEN_DIR / "tokenizer.json").read_text()), tmp_path)
    (tmp_path / "tokenizer_config.json").write_bytes((QWEN_DIR / "tokenizer_config.json").read_bytes())
    rebuilt = load_tokenizer(tmp_path)
    text = TEXT + "<|im_start|>user\nhi<|im_end|>"
    assert rebuilt.encode(text).ids == tok.encode(text).ids
