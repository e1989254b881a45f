"""Every metric builds in both sinks: Prometheus' client (the standalone server) and Ray's (a Serve replica, whose
histograms take positive boundaries only), and a histogram of zero drafts verified is read back."""

import pytest

from dspark_serve.cluster.metrics import PrometheusSink, RaySink, ServingMetrics

pytest.importorskip("ray")


def test_every_metric_builds_in_rays_sink():
    assert ServingMetrics(RaySink(), "m").verified is not None


def test_the_verified_histogram_counts_plain_steps_apart():
    sink = PrometheusSink()
    metrics = ServingMetrics(sink, "m")
    metrics.verified(0, model_name="m")
    metrics.verified(3, model_name="m")
    text = sink.text()[0].decode()
    assert 'spec_decode_verified_draft_tokens_per_step_bucket{le="0.5",model_name="m"} 1.0' in text
    assert 'spec_decode_verified_draft_tokens_per_step_bucket{le="3.0",model_name="m"} 2.0' in text
