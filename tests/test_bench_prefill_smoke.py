"""bench/bench_prefill.py on tiny shapes on CPU: eager against prefill-graph time to first token, and the path the
prompt_graph_work rule picks for each length."""

import json

import pytest
import torch
from bench_scripts import BENCH

from dspark_serve.engine.runner import prompt_graphs
from dspark_serve.kernels.config import KernelConfig


def test_bench_prefill_tiny_runs_and_reports(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # the script imports its siblings bench_gpu and bench_step
    import bench_prefill
    w = prompt_graphs.layer_weights(bench_prefill.make_target("tiny", "cpu", torch.float32).config)
    monkeypatch.setenv("DSPARK_PROMPT_GRAPH_WORK", str(48 * w))  # buckets 32 and 48 take graphs, 64 eagerly
    out = tmp_path / "r.json"
    bench_prefill.main(["--device", "cpu", "--models", "tiny", "--lens", "5", "40", "60", "--repeat", "1",
                        "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["tokens"], r["bucket"], r["rule"]) for r in rows] == [(5, 32, "graph"), (40, 48, "graph"),
                                                                      (60, 64, "eager")]
    assert all(r["eager_ms"] > 0 and r["graph_ms"] > 0 and len(r["eager_all"]) == 1 for r in rows)
    with pytest.raises(SystemExit):
        bench_prefill.main(["--device", "cpu", "--models", "tiny", "--lens", "0"])


@pytest.mark.parametrize("text", ["abc", "-1", "nan"])
def test_prompt_graph_work_refuses_bad_values(text):
    with pytest.raises(ValueError, match="prompt_graph_work takes a number"):
        KernelConfig.from_env(environ={"DSPARK_PROMPT_GRAPH_WORK": text})
    assert KernelConfig.from_env(environ={"DSPARK_PROMPT_GRAPH_WORK": "inf"}).prompt_graph_work == float("inf")
    assert KernelConfig.from_env(environ={"DSPARK_PROMPT_GRAPH_WORK": "0"}).prompt_graph_work == 0
