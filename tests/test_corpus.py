"""The prompt corpus: code prompts are real documented function heads, prose prompts paragraph openings,
and the held-out sets never overlap the training set."""

import json
from pathlib import Path

from dspark_serve.train.corpus import code_prompts, main
from dspark_serve.train.data import read_prompt_texts


def test_corpus_from_stdlib_sources_and_text(tmp_path):
    stdlib = Path(json.__file__).parent.parent / "email"  # real, installed Python sources
    text = tmp_path / "wiki.txt"
    text.write_text("\n\n".join(f"Topic {i} is a subject of study. It has a long history of {i} parts "
                                f"and many more details that follow here." for i in range(40)))
    assert main(["--python-src", str(stdlib), "--text", str(text), "--out", str(tmp_path / "c"),
                 "--heldout", "4"]) == 0
    rows = {n: [json.loads(x) for x in (tmp_path / "c" / n).read_text().splitlines()]
            for n in ("train.jsonl", "heldout_code.jsonl", "heldout_prose.jsonl")}
    code = [r for r in rows["train.jsonl"] if r["kind"] == "code"]
    assert len(code) >= 20 and len(rows["heldout_code.jsonl"]) == 4 and len(rows["heldout_prose.jsonl"]) == 4
    assert all(r["prompt"].startswith(("def ", "async def ")) and '"""' in r["prompt"] for r in code)
    train_prompts = {r["prompt"] for r in rows["train.jsonl"]}
    assert not train_prompts & {r["prompt"] for r in rows["heldout_code.jsonl"] + rows["heldout_prose.jsonl"]}
    # train-draft reads it as it is
    assert len(read_prompt_texts(tmp_path / "c" / "train.jsonl")) == len(rows["train.jsonl"])


def test_code_prompts_skip_undocumented_functions(tmp_path):
    (tmp_path / "m.py").write_text('def a(x):\n    return x\n\n\ndef b(y):\n    """Double y, the long way round."""\n'
                                   '    return 2 * y\n')
    rows = code_prompts(tmp_path, 10)
    assert [r["prompt"] for r in rows] == ['def b(y):\n    """Double y, the long way round."""\n']


def test_exclude_keeps_earlier_held_out_prompts_out_and_repeats_are_dropped(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    body = 'def f{i}(x):\n    """Return x plus {i}, a documented helper number {i}."""\n    return x + {i}\n\n\n'
    (src / "a.py").write_text("".join(body.format(i=i) for i in range(30)))
    (src / "b.py").write_text(body.format(i=3) + body.format(i=4))  # the same two functions again
    assert main(["--python-src", str(src), "--out", str(tmp_path / "one"), "--heldout", "5"]) == 0
    held = [json.loads(x)["prompt"] for x in (tmp_path / "one" / "heldout_code.jsonl").read_text().splitlines()]
    train = [json.loads(x)["prompt"] for x in (tmp_path / "one" / "train.jsonl").read_text().splitlines()]
    assert len(held) == 5 and len(train) == 25  # 32 functions, 30 distinct
    assert main(["--python-src", str(src), "--out", str(tmp_path / "two"), "--heldout", "0",
                 "--exclude", str(tmp_path / "one" / "heldout_code.jsonl")]) == 0
    again = [json.loads(x)["prompt"] for x in (tmp_path / "two" / "train.jsonl").read_text().splitlines()]
    assert len(again) == 25 and not set(again) & set(held)
