"""bench/bench_service.py on a tiny pair for seconds: fixed concurrency (two alternated rounds) and Poisson arrivals,
in the engine and through a real server of two gateway processes, with TTFT/TPOT percentiles and goodput per row."""

import json
import subprocess
import sys

from bench_scripts import BENCH, load_bench
from byte_tokenizer import byte_tokenizer

from dspark_serve.models.random_init import random_pair


def test_bench_service_runs_concurrency_and_request_rates(tmp_path):
    target, draft = random_pair(tmp_path, agree=0.005, block_size=6)
    byte_tokenizer(256).save(str(target / "tokenizer.json"))  # the prompts are text (bench/prompts, chat-rendered)
    bench = load_bench("bench_service")
    assert bench.arrivals(4, 2.0, seed=1) == bench.arrivals(4, 2.0, seed=1) and bench.arrivals(4, 2.0)[0] == 0.0
    out = tmp_path / "service.json"  # its client processes import it by name: a script run, not an import
    subprocess.run([sys.executable, str(BENCH / "bench_service.py"), "--target", str(target), "--draft", str(draft),
                    "--speculative-config", "{}", "--device", "cpu", "--levels", "2", "--request-rates", "8",
                    "--requests", "4", "--max-tokens", "6", "--layouts", "engine", "gateways", "--api-server-count", "2", "--num-kv-blocks", "256",
                    "--max-model-len", "512", "--client-procs", "2", "--rounds", "2", "--step-trace", str(tmp_path),
                    "--json", str(out)], check=True, timeout=600)
    r = json.loads(out.read_text())
    loads = {(row["layout"], row["concurrency"], row["mode"]) for row in r["rows"]}
    assert loads == {(layout, level, mode) for layout in ("engine", "gateways") for level in (2, "8/s")
                     for mode in ("plain", "spec")}
    for row in r["rows"]:
        assert row["requests"] == 4 and row["errors"] == 0 and row["tokens"] == 24, row
        assert 0.0 <= row["goodput_frac"] <= 1.0 and row["tpot_ms_p99"] >= row["tpot_ms_p50"] > 0
        if row["layout"] == "gateways":  # a served TTFT split into where it went
            assert row["gateway_intake_ms_p50"] > 0 and row["outside_gateway_ms_p50"] > 0
            assert row["add_wait_ms_p50"] >= 0 and row["loop_ttft_ms_p50"] > 0
        # the step loop's own end to end and TPOT, and at a fixed concurrency its time per step
        assert row["e2e_ms_p50"] >= row["loop_e2e_ms_p50"] > row["loop_ttft_ms_p50"] and row["loop_tpot_ms_p50"] > 0
        if row["concurrency"] == 2:
            # (the warm-up's last outputs leave before their step's publish time is counted: a hair over 1 may be)
            assert row["loop_steps"] >= 6 and row["loop_step_ms"] > 0 and 0 < row["loop_busy_frac"] <= 1.02, row
            assert (row["loop_intake_ms"] > 0 and row["loop_publish_ms"] > 0) == (row["layout"] == "gateways")
    rounds = sorted((row["layout"], row["mode"], row["round"]) for row in r["rows"] if row["concurrency"] == 2)
    assert rounds == sorted((layout, mode, rnd) for layout in ("engine", "gateways") for mode in ("plain", "spec")
                            for rnd in (0, 1))  # each level's runs twice, alternating; the rates once
    assert sorted((s["layout"], s["round"]) for s in r["summary"] if s["concurrency"] == 2) == \
        [("engine", 0), ("engine", 1), ("gateways", 0), ("gateways", 1)]
    # the step loop's trace: one line a step, every request's first token in one of them (the warm-up waves too)
    steps = [json.loads(line) for line in (tmp_path / "steps_gateways.jsonl").read_text().splitlines()]
    served = [row for row in r["rows"] if row["layout"] == "gateways"]
    answered = sum(row["requests"] for row in served) + 2 * 2
    assert sum(x["first_tokens"] for x in steps) == answered and sum(x["adds"] for x in steps) == answered
    assert all(x["step_ms"] > 0 and x["prefill_tokens"] >= x["first_tokens"] for x in steps)
    assert all(row["t_first_sent"] <= steps[-1]["t"] for row in served)
