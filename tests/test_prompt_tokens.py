"""The gateway's prompt tokenizer (cluster/prompt_tokens.py): ids equal to the tokenizer's own for any text, the long
pieces between added tokens encoded once, and every text encoded whole where pieces would not be exact."""

import random

import pytest
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

from dspark_serve.cluster.prompt_tokens import PromptTokenizer
from dspark_serve.models.demo import demo_target_dir
from dspark_serve.models.tokenizer import QWEN_SPLIT

SPECIAL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
PIECES = list("ab cd\n\t  éü中文😀'sXY12.,!<>|") + SPECIAL + ["<tool_call>", "\n\n", "   ", "<|im_start", "|>",
                                                             "e\u0301"]


def _tokenizer(lstrip: bool = False, bos: bool = False) -> Tokenizer:
    from tokenizers import Regex

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.train_from_iterator([open(__file__).read() * 2, "hello world 中文 éü 😀 " * 20], trainers.BpeTrainer(
        vocab_size=500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens([AddedToken(t, normalized=False, lstrip=lstrip and t == "<|im_end|>") for t in SPECIAL])
    tok.add_tokens([AddedToken("<tool_call>", normalized=False, special=False)])
    if bos:
        eos = tok.token_to_id("<|endoftext|>")
        tok.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A",
                                                           special_tokens=[("<|endoftext|>", eos)])
    return tok


def _random_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(PIECES) for _ in range(rng.randint(0, 120))) for _ in range(n)]


@pytest.mark.parametrize("lstrip,bos", [(False, False), (True, False), (False, True)])
def test_ids_equal_the_tokenizer_s_own(lstrip, bos):
    tok = _tokenizer(lstrip, bos)
    pt = PromptTokenizer(tok, min_piece_chars=4)
    assert pt.exact is not lstrip  # an added token that strips whitespace: every text is encoded whole
    for text in _random_texts(1500):
        for add in (False, True):
            assert pt.encode(text, add) == tok.encode(text, add_special_tokens=add).ids, (text, add)
    if not lstrip:
        assert pt.hits > 100  # pieces came from the cache


def test_padding_or_truncation_encodes_whole_texts():
    padded, truncated = _tokenizer(), _tokenizer()
    padded.enable_padding(length=64)
    truncated.enable_truncation(max_length=20)
    for tok in (padded, truncated):
        pt = PromptTokenizer(tok, min_piece_chars=4)
        assert not pt.exact
        for text in _random_texts(50, seed=2):
            assert pt.encode(text, False) == tok.encode(text, add_special_tokens=False).ids


def test_a_chat_s_system_prompt_is_encoded_once_and_the_cache_is_bounded():
    tok = _tokenizer()
    system = "You are a careful assistant. " * 40  # 1160 characters

    def chat(q: str) -> str:
        return f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"

    pt = PromptTokenizer(tok, max_cached_chars=2000)
    for q in ("first question", "second question", "a third"):
        assert pt.encode(chat(q), False) == tok.encode(chat(q), add_special_tokens=False).ids
    assert (pt.misses, pt.hits) == (1, 2)  # the system prompt; short pieces are not kept
    other = "Another system prompt, as long. " * 40
    pt.encode(f"<|im_start|>system\n{other}<|im_end|>", False)
    pt.encode(chat("again"), False)
    assert pt.misses == 3  # 2000 characters hold one of the two: the first was dropped


def test_the_demo_target_s_tokenizer_on_chat_prompts():
    path = demo_target_dir() / "tokenizer.json"
    if not path.exists():
        pytest.skip("the demo target is not fetched (dspark-serve fetch)")
    tok = Tokenizer.from_file(str(path))
    pt = PromptTokenizer(tok, min_piece_chars=8)
    assert pt.exact
    for text in _random_texts(400, seed=1):
        for add in (False, True):
            assert pt.encode(text, add) == tok.encode(text, add_special_tokens=add).ids, (text, add)
