"""bench/bench_gpu.py on tiny shapes on CPU: the GPU harness's code path (static and eager target steps, draft
blocks in bf16 and NVFP4) stays runnable where CI can see it."""

import json

from bench_scripts import load_bench


def test_bench_gpu_tiny_runs_and_reports(tmp_path):
    mod = load_bench("bench_gpu")
    out = tmp_path / "r.json"
    mod.main(["--tiny", "--device", "cpu", "--kernels", "5", "--draft-kernels", "5", "--token-map", "100",
              "--json", str(out)])
    r = json.loads(out.read_text())
    assert r["copy_GBps"] > 0
    assert sorted((t["graphs"], t["batch"]) for t in r["target"]) == [(False, 1), (False, 3), (True, 1), (True, 3)]
    assert all(t["plain_ms"] > 0 and t["verify_ms"] > 0 and t["floor_ms"] > 0 for t in r["target"])
    assert sorted((d["format"], d["graphs"], d["batch"]) for d in r["draft"]) == [
        (f, g, b) for f in ("bf16", "nvfp4", "nvfp4+head", "nvfp4+head+map", "nvfp4+map") for g in (False, True)
        for b in (1, 3)]
    assert all(d["draft_over_verify"] > 0 for d in r["draft"])
    table = r["kernels"]["tiny"]
    assert table and all(k["us_per_step"] >= 0 and k["calls_per_step"] > 0 for k in table)
    assert any("linear" in k["kernel"] or "mm" in k["kernel"] for k in table)   # the CPU profile names torch ops
    draft = r["draft_kernels"]["tiny"]
    assert draft and all(k["us_per_step"] >= 0 and k["calls_per_step"] > 0 for k in draft)
    assert any("topk" in k["kernel"] for k in draft)  # the candidates of the top-k Markov walk
