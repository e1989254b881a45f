"""bench/bench_prompt_tokens.py on a tiny byte-level tokenizer whose chat template writes added tokens: every prompt's
ids equal the whole text's, and the shared system prompt is encoded once."""

import json

from bench_scripts import BENCH
from byte_tokenizer import write_byte_tokenizer

TEMPLATE = ("{% for m in messages %}<|special_0|>{{ m['role'] }}\n{{ m['content'] }}<|special_1|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|special_0|>assistant\n{% endif %}")


def test_bench_prompt_tokens(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_prompt_tokens

    write_byte_tokenizer(tmp_path, 512, specials=2)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    r = bench_prompt_tokens.main(["--target", str(tmp_path), "--conversations", "4", "--turns", "3",
                                  "--system-tokens", "400", "--json", str(tmp_path / "out.json")])
    assert r["exact"] and r["prompts"] == 12 and r["equal"] == 12
    assert r["piece_misses"] <= 1 + 12 and r["piece_hits"] >= 11  # the system prompt: encoded once, then found
    assert json.loads((tmp_path / "out.json").read_text())["equal"] == 12
