"""bench/bench_routing_sim.py runs, and its prefix-affinity policy keeps more of the cache than power-of-two while
the load stays in balance (small trace, 2 and 8 replicas)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_routing_sim_smoke(tmp_path):
    out = tmp_path / "sim.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_routing_sim.py"), "--replicas", "2", "8",
                           "--conversations-per-replica", "20", "--json", str(out)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = {(r["replicas"], r["policy"]): r for r in json.loads(out.read_text())}
    for n in (2, 8):
        prefix, pow2 = rows[n, "prefix"], rows[n, "power_of_two"]
        assert prefix["hit_rate"] > pow2["hit_rate"] + 0.05 and prefix["hit_rate"] <= prefix["ideal_hit_rate"]
        assert prefix["max_over_mean_load"] < 1.3
