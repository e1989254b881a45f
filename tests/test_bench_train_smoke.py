"""bench/bench_train.py on CPU with few rows: the trainer benchmark's fused and reference paths stay runnable."""

import json
import math

from bench_scripts import load_bench


def test_bench_train_cpu_runs_and_reports(tmp_path):
    mod = load_bench("bench_train")
    out = tmp_path / "r.json"
    mod.main(["--device", "cpu", "--batch-size", "2", "--num-anchors", "3", "--steps", "1", "--layers", "1",
              "--markov-rank", "16", "--json", str(out)])
    (row,) = json.loads(out.read_text())["rows"]
    assert row["fused_ms"] > 0 and row["reference_ms"] > 0
    assert all(math.isfinite(x) and x > 0 for x in row["last_loss"])
    assert row["phases_ms"]["rows"] == 2 * 3 * 7
    assert set(row["phases_ms"]) >= {"block forward", "draft logits", "target logits", "loss", "backward"}
