"""bench/bench_soak.py for a few seconds: the real server under concurrent streams, outputs equal to solo runs."""

from bench_scripts import load_bench


def test_soak_runs_and_checks_outputs(tmp_path):
    soak = load_bench("bench_soak")
    r = soak.main(["--minutes", "0.1", "--concurrency", "4", "--distinct", "8", "--max-tokens", "16", "--all-drafts",
                   "--json", str(tmp_path / "soak.json")])
    assert r["requests"] > 8 and r["errors"] == 0 and r["mismatches"] == 0
    assert len(r["rss_mb"]) >= 2 and r["rss_mb"][0] > 50 and abs(r["rss_growth"]) < 0.5
