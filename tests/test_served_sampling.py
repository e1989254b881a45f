"""vLLM's sampling fields through the real service: penalties and logprobs as the engine computes them, n
sequences told apart by index (seeded: sequence i is the request with seed + i), include_stop_str_in_output,
skip_special_tokens, and validation errors naming the field."""

import math
import threading
import time

import grpc
import pytest
from byte_tokenizer import byte_tokenizer, write_byte_tokenizer
from service import ServerProcess

from dspark_serve.cluster.grpc_client import DSparkClient
from dspark_serve.engine.llm import LLM
from dspark_serve.engine.sampling_params import SamplingParams
from dspark_serve.models.random_init import random_pair
from dspark_serve.protos.dspark.v1 import dspark_pb2 as pb

VOCAB, SPECIALS = 512, 8  # the last 8 ids are special tokens
PROMPT = "你好 😀 hello"


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    target, draft = random_pair(tmp_path_factory.mktemp("pair"), agree=0.005, block_size=6, vocab=VOCAB)
    write_byte_tokenizer(target, VOCAB, SPECIALS)
    return target, draft


@pytest.fixture(scope="module")
def server(pair_dirs):
    srv = ServerProcess(*pair_dirs, "--max-model-len", "4096")
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def client(server):
    c = DSparkClient(server.address)
    yield c
    c.close()


def _collect(client, prompt=PROMPT, **kw) -> dict[int, dict]:
    """index -> its chunks' token ids, texts and logprobs, and its final message."""
    seqs: dict[int, dict] = {}
    for msg in client.stream(prompt, **kw):
        s = seqs.setdefault(msg.index, {"ids": [], "text": "", "logprobs": [], "final": None})
        assert s["final"] is None, "a message after the sequence's Complete"
        if msg.HasField("chunk"):
            s["ids"] += msg.chunk.token_ids
            s["text"] += msg.chunk.text
            s["logprobs"] += msg.chunk.logprobs
            assert msg.chunk.num_output_tokens == len(s["ids"])
        else:
            s["final"] = msg.complete
    return seqs


def test_penalties_and_logprobs_as_the_engine_computes_them(client, pair_dirs):
    params = dict(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.4, presence_penalty=0.5,
                  frequency_penalty=0.3, logprobs=3)
    seq = _collect(client, **params)[0]
    llm = LLM(*map(str, pair_dirs), device="cpu", block_size=8, num_kv_blocks=64)
    ids = llm.encode(PROMPT)
    want = llm.generate([ids], SamplingParams(**params))[0]
    plain = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0]
    assert seq["ids"] == list(seq["final"].output_ids) == want.token_ids != plain.token_ids
    assert len(seq["logprobs"]) == len(seq["ids"])  # one per token id
    for got, (tok, logprob, top), i in zip(seq["logprobs"], want.logprobs, seq["ids"]):
        assert got.token_id == tok == i and math.isclose(got.logprob, logprob, abs_tol=1e-4)
        assert [t.token_id for t in got.top] == [t for t, _ in top] and len(got.top) == 3
        assert got.top[0].token_id == i and got.top[0].logprob == got.logprob  # greedy: the top one
        assert all(a.logprob >= b.logprob for a, b in zip(got.top, got.top[1:]))
    assert not _collect(client, temperature=0.0, max_tokens=8)[0]["logprobs"]  # none unless asked


def test_logprobs_follow_a_stop_string(client):
    """Tokens dropped at a stop string take their logprobs with them."""
    full = _collect(client, temperature=0.0, max_tokens=40, ignore_eos=True)[0]
    stop = full["text"][12:14]
    cut = _collect(client, temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop], logprobs=0)[0]
    assert cut["final"].finish_reason == pb.FINISH_REASON_STOP
    assert len(cut["ids"]) < len(full["ids"]) and len(cut["logprobs"]) == len(cut["ids"])
    assert [x.token_id for x in cut["logprobs"]] == cut["ids"] and all(not x.top for x in cut["logprobs"])


def test_n_sequences_with_seed_are_the_seeded_requests(client):
    kw = dict(temperature=1.0, max_tokens=12, ignore_eos=True)
    seqs = _collect(client, n=3, seed=11, **kw)
    assert sorted(seqs) == [0, 1, 2]
    for i, s in seqs.items():
        assert s["final"] is not None and s["ids"] == list(s["final"].output_ids) and len(s["ids"]) == 12
        assert s["ids"] == _collect(client, seed=11 + i, **kw)[0]["ids"], i
    assert len({tuple(s["ids"]) for s in seqs.values()}) == 3
    unseeded = _collect(client, n=2, **kw)
    assert sorted(unseeded) == [0, 1] and unseeded[0]["ids"] != unseeded[1]["ids"]


def _idle_within(client, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        s = client.server_stats()
        if not s.num_running and not s.num_waiting:
            return True
        time.sleep(0.02)
    return False


def test_n_sequences_end_together(client):
    """A cancelled stream, a deadline and an Abort end all n sequences at once (running to the end would take
    seconds); after an Abort each sequence still gets its own Complete."""
    kw = dict(temperature=1.0, max_tokens=3000, ignore_eos=True, n=3)
    stream = client.stream(PROMPT, **kw)
    next(stream)
    stream.cancel()
    assert _idle_within(client, 1.0)
    with pytest.raises(grpc.RpcError) as e:
        _collect(client, timeout=1.0, **kw)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert _idle_within(client, 1.0)
    stream = client.stream(PROMPT, request_id="three", **kw)
    first = next(stream)
    threading.Timer(0.2, client.abort, ("three",)).start()
    finals = [m for m in stream if m.HasField("complete")]
    assert first.request_id == "three" and sorted(m.index for m in finals) == [0, 1, 2]
    assert all(m.complete.finish_reason == pb.FINISH_REASON_ABORTED for m in finals)


def test_include_stop_str_in_output(client):
    full = _collect(client, temperature=0.0, max_tokens=40, ignore_eos=True)[0]["text"]
    stop = full[10:12]
    at = full.find(stop)
    for include, want in ((False, full[:at]), (True, full[:at + len(stop)])):
        s = _collect(client, temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop],
                     include_stop_str_in_output=include)[0]
        assert s["text"] == s["final"].text == want and s["final"].finish_reason == pb.FINISH_REASON_STOP
    late = _collect(client, temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop], min_tokens=40)[0]
    assert late["text"].startswith(full[:at + len(stop)])  # no stop string before min_tokens


def test_skip_special_tokens(client):
    tokenizer = byte_tokenizer(VOCAB, SPECIALS)
    kw = dict(temperature=1.0, max_tokens=200, ignore_eos=True)
    seed = next(s for s in range(20) if any(t >= VOCAB - SPECIALS for t in _collect(client, seed=s, **kw)[0]["ids"]))
    skipped = _collect(client, seed=seed, **kw)[0]
    kept = _collect(client, seed=seed, skip_special_tokens=False, **kw)[0]
    assert skipped["ids"] == kept["ids"]
    assert skipped["text"] == skipped["final"].text == tokenizer.decode(skipped["ids"]) and "<|special_" not in \
        skipped["text"]
    assert kept["text"] == kept["final"].text == tokenizer.decode(kept["ids"], skip_special_tokens=False)
    assert "<|special_" in kept["text"]


@pytest.mark.parametrize("field, value", [("repetition_penalty", 0.0), ("presence_penalty", 2.5),
                                          ("frequency_penalty", -3.0), ("min_tokens", 17), ("logprobs", 21),
                                          ("n", 0), ("n", 17)])
def test_bad_values_are_refused_naming_the_field(client, field, value):
    with pytest.raises(grpc.RpcError) as e:
        _collect(client, max_tokens=16, **{field: value})
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details(), e.value.details()
