"""Serving metrics named after vLLM's, prefixed `dspark:`: counted from the final stats of every request that passes
GatewayCore, one JSON log line each, gauges from the verifier's stats. Exported as Prometheus text from a registry
per server, or through Ray's metrics API in the Serve app (where `:` becomes `_`, as Ray requires)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from dspark_serve.protos.dspark.v1 import dspark_pb2 as pb

PREFIX = "dspark:"
REQUEST_LOG = "dspark_serve.requests"  # one JSON line per finished sequence
FINISH_NAMES = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORTED: "abort"}
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
VERIFIED_BUCKETS = (0.5, 1, 2, 3, 4, 5, 6, 7, 8, 12, 16)  # drafts verified per step (le=0.5: none); Ray wants > 0
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0)
REFRESH_S = 1.0  # the gauges are read from the verifier at most this often

log = logging.getLogger(REQUEST_LOG)
Record = Callable[..., None]  # record(value, **labels): a counter's inc, a histogram's observe, a gauge's set


class PrometheusSink:
    """prometheus_client metrics on a registry of their own, so several servers in one process do not clash. With
    `multiproc_dir` (several gateway processes; prometheus_client's multiprocess mode, which its environment variable
    PROMETHEUS_MULTIPROC_DIR must have selected before it was imported) every process writes its values there and
    each one's /metrics reads them all: counters and histograms summed, gauges the latest."""

    def __init__(self, multiproc_dir: str | None = None) -> None:
        from prometheus_client import CollectorRegistry

        if multiproc_dir is not None and os.environ.get("PROMETHEUS_MULTIPROC_DIR") != multiproc_dir:
            raise RuntimeError("shared metrics need PROMETHEUS_MULTIPROC_DIR set to their folder before "
                               "prometheus_client is imported")
        self.registry = CollectorRegistry()
        self.multiproc_dir = multiproc_dir

    def metric(self, kind: str, name: str, doc: str, labels: tuple[str, ...],
               buckets: tuple[float, ...] = ()) -> Record:
        import prometheus_client as prom

        kw = {"buckets": buckets} if kind == "histogram" else {}
        if kind == "gauge" and self.multiproc_dir is not None:
            kw["multiprocess_mode"] = "mostrecent"
        m = getattr(prom, kind.capitalize())(PREFIX + name, doc, labels, registry=self.registry, **kw)
        op = {"counter": "inc", "histogram": "observe", "gauge": "set"}[kind]
        return lambda value, **tags: getattr(m.labels(**tags), op)(value)

    def text(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

        if self.multiproc_dir is None:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        from prometheus_client.multiprocess import MultiProcessCollector

        merged = CollectorRegistry()
        MultiProcessCollector(merged, path=self.multiproc_dir)
        return generate_latest(merged), CONTENT_TYPE_LATEST


class RaySink:
    """ray.util.metrics, which Ray's own exporter carries (names with `_` for `:`); `const_labels` (e.g. the Serve
    replica) ride on every metric."""

    def __init__(self, const_labels: dict[str, str] | None = None) -> None:
        self.const_labels = dict(const_labels or {})

    def metric(self, kind: str, name: str, doc: str, labels: tuple[str, ...],
               buckets: tuple[float, ...] = ()) -> Record:
        from ray.util import metrics as rm

        full = (PREFIX + name).replace(":", "_")
        labels = (*labels, *self.const_labels)
        if kind == "histogram":
            # Ray takes positive boundaries only; its first bucket holds the values up to the first one (0 too)
            m = rm.Histogram(full, doc, boundaries=[b for b in buckets if b > 0], tag_keys=labels)
        else:
            m = getattr(rm, kind.capitalize())(full, doc, tag_keys=labels)
        m.set_default_tags(self.const_labels)
        op = {"counter": "inc", "histogram": "observe", "gauge": "set"}[kind]
        return lambda value, **tags: getattr(m, op)(value, tags=tags)


class ServingMetrics:
    """Every metric carries model_name (as vLLM's do)."""

    def __init__(self, sink: Any, model_name: str) -> None:
        self.model = model_name

        def m(kind: str, name: str, doc: str, labels: tuple[str, ...] = (), buckets: tuple[float, ...] = ()) -> Record:
            return sink.metric(kind, name, doc, ("model_name", *labels), buckets)

        self.drafts = m("counter", "spec_decode_num_drafts", "Verify steps of finished sequences.")
        self.draft_tokens = m("counter", "spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.accepted = m("counter", "spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.per_pos = m("counter", "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at each "
                         "position of the block.", ("position",))
        self.requests = m("counter", "request_success", "Finished sequences by finish reason.", ("finished_reason",))
        self.prompt_tokens = m("counter", "prompt_tokens", "Prompt tokens of finished requests.")
        self.cache_queries = m("counter", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.cache_hits = m("counter", "prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.verified = m("histogram", "spec_decode_verified_draft_tokens_per_step", "Drafts a sequence verified in "
                          "one step (the length the speculation policy chose).", buckets=VERIFIED_BUCKETS)
        self.generation_tokens = m("counter", "generation_tokens", "Tokens generated by finished sequences.")
        self.ttft = m("histogram", "time_to_first_token_seconds", "Arrival at the gateway to the first token.",
                      buckets=TTFT_BUCKETS)
        self.tpot = m("histogram", "time_per_output_token_seconds", "Mean time per output token after the first.",
                      buckets=TPOT_BUCKETS)
        self.e2e = m("histogram", "e2e_request_latency_seconds", "Arrival at the gateway to the final message.",
                     buckets=E2E_BUCKETS)
        self.running = m("gauge", "num_requests_running", "Requests the step loop decodes.")
        self.waiting = m("gauge", "num_requests_waiting", "Requests queued in the step loop.")
        self.kv_usage = m("gauge", "kv_cache_usage_perc", "Fraction of the target's KV-cache blocks in use (0-1).")
        self.channel_ms = m("gauge", "step_channel_ms_per_step", "Step-channel time per verify step of the sequences "
                            "finished since the last refresh (0 with the draft inside the verifier).")
        self._channel = [0.0, 0]  # transfer ms, steps since the last refresh
        self._channel_ms = 0.0  # the last reading, kept while no sequence finishes

    def finished(self, request_id: str, index: int, final: pb.GenerateComplete, ttft_s: float | None,
                 e2e_s: float, reason: str | None = None) -> None:
        """One finished sequence; its request's prompt counts once (index 0). `reason` overrides the final's."""
        s, tags = final.stats, {"model_name": self.model}
        reason = reason or FINISH_NAMES.get(final.finish_reason, "unknown")
        for record, value in ((self.drafts, s.num_spec_steps), (self.draft_tokens, s.num_draft_tokens),
                              (self.accepted, s.num_accepted_tokens), (self.generation_tokens, len(final.output_ids)),
                              (self.prompt_tokens, final.num_prompt_tokens if index == 0 else 0),
                              (self.cache_queries, final.num_prompt_tokens if index == 0 else 0),
                              (self.cache_hits, s.cached_tokens if index == 0 else 0)):
            if value:
                record(value, **tags)
        for n in s.verified_per_step:
            self.verified(n, **tags)
        for pos, n in enumerate(s.per_position_accepted):
            if n:
                self.per_pos(n, position=str(pos), **tags)
        self.requests(1, finished_reason=reason, **tags)
        self.e2e(e2e_s, **tags)
        if ttft_s is not None:
            self.ttft(ttft_s, **tags)
            if len(final.output_ids) > 1:
                self.tpot((e2e_s - ttft_s) / (len(final.output_ids) - 1), **tags)
        self._channel[0] += s.transfer_ms
        self._channel[1] += s.num_spec_steps
        log.info(json.dumps({"request_id": request_id, "index": index, "prompt_tokens": final.num_prompt_tokens,
                             "output_tokens": len(final.output_ids), "tau": round(s.mean_acceptance_length, 3),
                             "ttft_s": None if ttft_s is None else round(ttft_s, 4), "e2e_s": round(e2e_s, 4),
                             "finish_reason": reason}))

    def load(self, stats: pb.ServerStats) -> None:
        tags = {"model_name": self.model}
        self.running(stats.num_running, **tags)
        self.waiting(stats.num_waiting, **tags)
        total = stats.total_target_blocks
        self.kv_usage(1.0 - stats.free_target_blocks / total if total else 0.0, **tags)
        ms, steps = self._channel
        if steps:
            self._channel_ms, self._channel = ms / steps, [0.0, 0]
        self.channel_ms(self._channel_ms, **tags)


class GaugeRefresher:
    """Reads the verifier's stats into the gauges: each REFRESH_S in the background, and on a scrape when the last
    reading is older than that."""

    def __init__(self, metrics: ServingMetrics, server_stats: Callable[[], Awaitable[pb.ServerStats]]) -> None:
        self.metrics, self.server_stats = metrics, server_stats
        self._last = -REFRESH_S

    async def refresh(self) -> None:
        now = time.monotonic()
        if now - self._last < REFRESH_S:
            return
        self._last = now
        try:
            self.metrics.load(await self.server_stats())
        except Exception:  # noqa: BLE001 - a pair that is gone or restarting keeps the last readings
            pass

    async def run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(REFRESH_S)


def log_requests_to_stderr() -> None:
    """At an entry point: the per-request JSON lines to stderr."""
    if not log.handlers:
        log.addHandler(logging.StreamHandler())
    log.setLevel(logging.INFO)
    log.propagate = False
