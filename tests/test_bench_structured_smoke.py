"""bench/bench_structured.py on the tiny pair for seconds: every row it reports, with its ms per step, the host ms in
the grammar's hooks and the Triton compiles counted during it (none on CPU)."""

import json

import pytest
from bench_scripts import BENCH
from byte_tokenizer import write_byte_tokenizer

from dspark_serve.models.random_init import random_pair

pytest.importorskip("xgrammar")


def test_bench_structured_reports_every_row(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_structured

    target, draft = random_pair(tmp_path, agree=0.005, block_size=6)
    write_byte_tokenizer(target, 512)
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    out = tmp_path / "structured.json"
    monkeypatch.setattr("sys.argv", ["bench_structured.py", "--target", str(target), "--draft", str(draft),
                                     "--device", "cpu", "--prompts", "2", "--speed-prompts", "1", "--max-tokens",
                                     "24", "--json", str(out)])
    bench_structured.main()
    r = json.loads(out.read_text())
    for name in ("plain_schema", "spec_schema", "plain", "spec", "spec_schema_unmasked_draft"):
        row = r[name]
        assert row["tokens"] > 0 and row["tok_s"] > 0 and row["ms_per_step"] > 0, (name, row)
        assert row["kernels_compiled"] == 0 and row["compiled"] == [], (name, row)  # no Triton compiles on CPU
    assert 0 <= r["valid_T0.0"] <= 1 and r["speedup_schema"] > 0
    for name in ("plain", "spec"):  # the draft walk's masks run only for constrained rows
        assert r[name]["allowed_ms_per_step"] == 0 and r[name]["advance_ms_per_step"] == 0
    assert r["plain_schema"]["apply_grammar_ms_per_step"] > 0 and r["spec_schema"]["allowed_ms_per_step"] > 0
