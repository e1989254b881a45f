"""The router's own count of requests in flight (cluster/inflight.py): what it counts, and that with it a burst on one
shared prompt spreads even while the replicas' reported counts lag, as Serve's cache does under a burst."""

import random

import pytest

from dspark_serve.cluster.affinity import AffinityConfig, AffinityTable, choose, token_keys
from dspark_serve.cluster.inflight import InFlight


def test_counts_follow_a_request_from_choice_to_finish():
    f = InFlight(unconfirmed_ttl_s=5.0)
    f.chosen(1, "a", now=0.0)
    f.chosen(2, "a", now=0.0)
    assert f.counts(0.0) == {"a": 2}
    f.chosen(2, "b", now=1.0)  # chosen again (the first refused): moves
    assert f.counts(1.0) == {"a": 1, "b": 1}
    f.routed(2, "b")
    f.routed(None, "b")  # a request this router did not choose (no prompt keys)
    assert f.counts(1.0) == {"a": 1, "b": 2}
    f.finished("b")
    f.finished("b")
    f.finished("b")  # never below zero
    assert f.counts(1.0) == {"a": 1}
    assert f.counts(5.5) == {}  # chosen at 0 and never sent: expired
    f.routed(3, "c")
    f.forget("c")
    assert f.counts(6.0) == {}
    with pytest.raises(ValueError, match="unconfirmed_ttl_s"):
        InFlight(unconfirmed_ttl_s=0)


@pytest.mark.parametrize("threshold", [0, 2, 4])
def test_a_burst_spreads_while_reported_counts_lag(threshold):
    """12 requests of one prompt at once; every reply so far says both replicas are idle. The cache alone
    keeps the holder in balance and sends it all 12; with the router's own count the holder ends at most one request
    past the line (`threshold` + 0.5 over the mean)."""
    cfg = AffinityConfig(block_size=4, imbalance_threshold=threshold)
    keys = token_keys(list(range(1, 33)), cfg)
    stale = {"holder": 0, "other": 0}

    def burst(use_inflight: bool) -> dict:
        table, rng, f, sent = AffinityTable(100), random.Random(0), InFlight(), {"holder": 0, "other": 0}
        table.insert(keys, "holder")
        for token in range(12):
            ours = f.counts(0.0)
            loads = {r: max(n, ours[r]) if use_inflight else n for r, n in stale.items()}
            chosen, _ = choose(keys, loads, table, cfg, rng)
            f.chosen(token, chosen, 0.0)
            sent[chosen] += 1
        return sent

    assert burst(use_inflight=False) == {"holder": 12, "other": 0}
    sent = burst(use_inflight=True)
    assert sent["holder"] - (sent["holder"] + sent["other"]) / 2 <= threshold + 0.5  # one past the line, at most
    assert sent["holder"] >= sent["other"]
