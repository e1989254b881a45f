"""Aborts are never lost, over real gRPC and HTTP: 200 rounds of Generate and an immediate Abort of its id all end
ABORTED (an Abort that overtakes its Generate is remembered for --abort-window), and every sequence the server
started is counted by reason in request_success_total and ServerStats.finished_by_reason: Abort calls, cancelled
calls, deadlines and clients that leave as "abort"."""

import json
import time
import urllib.request

import grpc
import pytest
from byte_tokenizer import byte_tokenizer
from prometheus_client.parser import text_string_to_metric_families
from service import ServerProcess

from dspark_serve.cluster.grpc_client import DSparkClient
from dspark_serve.cluster.recent_aborts import RecentAborts
from dspark_serve.models.random_init import random_pair
from dspark_serve.protos.dspark.v1 import dspark_pb2 as pb

LONG = dict(temperature=0.0, max_tokens=2000, ignore_eos=True)
WINDOW_S = 3.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pair = random_pair(tmp_path_factory.mktemp("pair"), agree=0.005, block_size=6)
    byte_tokenizer(512).save(str(pair[0] / "tokenizer.json"))  # streamed HTTP chunks carry text
    srv = ServerProcess(*pair, "--http-port", "0", "--max-model-len", "4096", "--abort-window", str(WINDOW_S),
                        "--served-model-name", "tiny")
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def client(server):
    c = DSparkClient(server.address)
    yield c
    c.close()


def _aborts(server, client) -> tuple[float, int]:
    """request_success_total{finished_reason="abort"} and ServerStats.finished_by_reason["abort"]."""
    with urllib.request.urlopen(f"http://{server.http_address}/metrics", timeout=30) as r:
        text = r.read().decode()
    metric = sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                 if s.name == "dspark:request_success_total" and s.labels.get("finished_reason") == "abort")
    return metric, client.server_stats().finished_by_reason["abort"]


def _wait_counts(server, client, want: tuple[float, int], timeout_s: float = 10.0) -> tuple[float, int]:
    end = time.monotonic() + timeout_s
    while (got := _aborts(server, client)) != want and time.monotonic() < end:
        time.sleep(0.05)
    return got


def _final(call) -> pb.GenerateComplete:
    finals = [m.complete for m in call if m.HasField("complete")]
    assert len(finals) == 1
    return finals[0]


def test_200_generates_each_aborted_at_once_all_end_aborted(server, client):
    before = _aborts(server, client)
    reasons, overtaken, tokens = [], 0, 0
    for i in range(200):
        req = DSparkClient.request([1 + i % 300, 2, 3], request_id=f"round-{i}", **LONG)
        call = client.stub.Generate(req, metadata=client.metadata, timeout=60)  # started: the request is on its way
        overtaken += not client.abort(f"round-{i}")  # [] when the Abort came first
        final = _final(call)
        reasons.append(final.finish_reason)
        tokens += len(final.output_ids)
    assert reasons == [pb.FINISH_REASON_ABORTED] * 200, sum(r == pb.FINISH_REASON_ABORTED for r in reasons)
    assert tokens < 200 * 50  # each stopped long before its 2000 tokens
    assert _wait_counts(server, client, (before[0] + 200, before[1] + 200)) == (before[0] + 200, before[1] + 200)
    print(f"{overtaken} of 200 Aborts arrived before their Generate was registered")


def test_an_abort_sent_first_ends_its_request_within_the_window_only(server, client):
    assert client.abort("early-1") == []  # not running: remembered
    assert _final(client.stream([4, 5, 6], request_id="early-1", timeout=60, **LONG)).finish_reason == \
        pb.FINISH_REASON_ABORTED
    # taken once: the same id runs again, and so does an id aborted longer ago than the window
    assert _final(client.stream([4, 5, 6], request_id="early-1", timeout=60, temperature=0.0, max_tokens=3)) \
        .finish_reason == pb.FINISH_REASON_LENGTH
    client.abort("early-2")
    time.sleep(WINDOW_S + 0.5)
    assert _final(client.stream([4, 5, 6], request_id="early-2", timeout=60, temperature=0.0, max_tokens=3)) \
        .finish_reason == pb.FINISH_REASON_LENGTH


def test_cancels_deadlines_and_disconnects_count_as_aborts(server, client):
    before = _aborts(server, client)
    for _ in range(3):  # a cancelled call
        call = client.stream([7, 8, 9], timeout=60, **LONG)
        assert next(call).HasField("chunk")
        call.cancel()
    for _ in range(2):  # a deadline
        with pytest.raises(grpc.RpcError) as e:
            list(client.stream([7, 8, 9], timeout=0.5, **LONG))
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    n = 2  # sequences of a request with n = 2 whose client leaves mid-stream
    body = json.dumps({"model": "tiny", "prompt": [7, 8], "stream": True, "n": n, **LONG}).encode()
    req = urllib.request.Request(f"http://{server.http_address}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        first = r.readline()
        assert first.startswith(b"data: {") and json.loads(first[6:])["choices"][0]["finish_reason"] is None
    want = (before[0] + 3 + 2 + n, before[1] + 3 + 2 + n)
    assert _wait_counts(server, client, want) == want


def test_recent_aborts_are_bounded_and_expire():
    ids = RecentAborts(window_s=0.2, capacity=3)
    for i in range(5):
        ids.remember("c", f"r{i}")
    assert len(ids) == 3 and not ids.take("c", "r0") and ids.take("c", "r4") and not ids.take("c", "r4")
    assert not ids.take("other", "r3")  # per caller
    time.sleep(0.3)
    assert not ids.take("c", "r3") and len(ids) == 0
