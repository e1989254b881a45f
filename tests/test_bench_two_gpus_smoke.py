"""bench/bench_two_gpus.py on CPU: the split pair (two Ray actors, the gloo step channel) and the co-located engine
both decode, and the report carries the split / co-located ratio and the coordination time."""

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_two_gpu_bench_runs_on_cpu(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # the script imports its sibling bench_step
    import bench_two_gpus

    out = tmp_path / "r.json"
    bench_two_gpus.main(["--device", "cpu", "--tokens", "6", "--prompts", "1", "--json", str(out)])
    r = json.loads(out.read_text())
    for key in ("split", "colocated_actor", "colocated"):
        assert r[key]["tok_s"] > 0 and r[key]["steps"] >= 1 and 1.0 <= r[key]["tau"] <= 8.0
    assert r["split"]["coordination_ms_per_step"] > 0  # the channel's time is measured where it exists
    assert r["colocated"]["coordination_ms_per_step"] == 0 and r["colocated_actor"]["coordination_ms_per_step"] == 0
    assert abs(r["split_over_colocated"] - r["split"]["tok_s"] / r["colocated"]["tok_s"]) < 1e-9
    sys.modules.pop("bench_two_gpus", None)
