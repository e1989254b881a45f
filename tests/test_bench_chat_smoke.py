"""bench/bench_chat.py on the tiny pair for seconds: two conversations of two turns through the in-process engine and
through `dspark-serve serve` with the prefix cache on and off; with it on, every follow-up turn finds at least half
of its prompt cached, without it none."""

import json

from bench_scripts import BENCH
from byte_tokenizer import write_byte_tokenizer

from dspark_serve.models.random_init import random_pair

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_bench_chat_reports_prefix_cache_hits(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # the script imports its sibling bench_service
    import bench_chat

    target, draft = random_pair(tmp_path, agree=0.005, block_size=6)
    write_byte_tokenizer(target, 512)
    (target / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    out = tmp_path / "chat.json"
    bench_chat.main(["--target", str(target), "--draft", str(draft), "--speculative-config", "{}", "--device", "cpu",
                     "--conversations", "2", "--turns", "2", "--system-tokens", "128", "--max-tokens", "4",
                     "--num-kv-blocks", "256", "--max-model-len", "1024", "--warmup", "1", "--client-procs", "1",
                     "--layouts", "engine", "cache", "nocache", "--json", str(out)])
    r = json.loads(out.read_text())
    rows = {row["layout"]: row for row in r["rows"]}
    assert r["chat_template"].endswith("tokenizer_config.json") and r["system_tokens"] >= 128
    for row in rows.values():
        assert row["requests"] == 4 and row["errors"] == 0 and row["output_tokens"] == 16, row
        assert row["tokens_per_step"] >= 1.0
        for t in row["records"]:  # the step loop's time to a first token lies within the client's
            assert 0 < t["engine_ttft_ms"] <= 1e3 * (t["t_first"] - t["t0"]) + 0.01, t
    assert rows["nocache"]["hit_rate"] == 0 and rows["cache"]["hit_rate"] > 0
    for layout in ("cache", "engine"):
        follow_ups = [t for t in rows[layout]["records"] if t["turn"] == 1]
        assert len(follow_ups) == 2 and all(2 * t["cached_tokens"] >= t["prompt_tokens"] for t in follow_ups)
        assert rows[layout]["follow_ups_half_cached"] == 1.0
    assert [(s["baseline"], s["layout"]) for s in r["summary"]] == [("nocache", "cache"), ("cache", "engine")]
