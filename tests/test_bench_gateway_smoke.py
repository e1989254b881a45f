"""bench/bench_gateway.py for seconds: the real gRPC gateway and request stream against a stand-in step loop."""

import json
import subprocess
import sys

from bench_scripts import BENCH
from byte_tokenizer import byte_tokenizer


def test_bench_gateway_delivers_every_token_of_the_stand_in(tmp_path):
    byte_tokenizer(256).save(str(tmp_path / "tokenizer.json"))
    out = tmp_path / "gateway.json"
    subprocess.run([sys.executable, str(BENCH / "bench_gateway.py"), "--target", str(tmp_path), "--levels", "2",
                    "--requests", "4", "--max-tokens", "7", "--tokens-per-step", "3", "--step-ms", "5", "--rounds", "1",
                    "--client-procs", "1", "--json", str(out)], check=True, timeout=300)
    (row,) = json.loads(out.read_text())["rows"]
    assert row["requests"] == 4 and row["errors"] == 0 and row["tokens"] == 28, row
    # 7 tokens at 3 a step: the stand-in's finals come in its third step, 10 ms after the first tokens
    assert row["loop_e2e_ms_p50"] - row["loop_ttft_ms_p50"] >= 9.5 and row["loop_tpot_ms_p50"] > 0
    assert row["e2e_ms_p50"] >= row["loop_e2e_ms_p50"] and row["final_late_ms_p50"] >= 0
    assert row["gateway_cpu_s"] >= 0  # in clock ticks: a run this short may take none
