"""bench/bench_train.py on CPU with few rows: the trainer benchmark's fused and reference paths stay runnable."""

import importlib.util
import json
import math
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "bench_train.py"


def test_bench_train_cpu_runs_and_reports(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_train", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "r.json"
    mod.main(["--device", "cpu", "--batch-size", "2", "--num-anchors", "3", "--steps", "1", "--layers", "1",
              "--markov-rank", "16", "--json", str(out)])
    (row,) = json.loads(out.read_text())["rows"]
    assert row["fused_ms"] > 0 and row["reference_ms"] > 0
    assert all(math.isfinite(x) and x > 0 for x in row["last_loss"])
    assert row["phases_ms"]["rows"] == 2 * 3 * 7
    assert set(row["phases_ms"]) >= {"block forward", "draft logits", "target logits", "loss", "backward"}
