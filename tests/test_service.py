"""The service end to end: real Ray actors (draft and verifier), the gloo step channel, real gRPC on 127.0.0.1."""

import json
import threading
import time

import grpc
import pytest
import torch
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from service import ServerProcess

from dspark_serve.cluster.grpc_client import DSparkClient
from dspark_serve.engine.llm import LLM
from dspark_serve.engine.sampling_params import SamplingParams
from dspark_serve.models.random_init import random_pair
from dspark_serve.protos.dspark.v1 import dspark_pb2 as pb

MAX_QUEUE = 24


ALL_DRAFTS = {"enable_adaptive_verification": False}


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    return random_pair(tmp_path_factory.mktemp("pair"), agree=0.005, block_size=6)


@pytest.fixture(scope="module")
def server(pair_dirs):
    # every capped draft verified, here and in `local`: served sampling is compared token for token with it
    srv = ServerProcess(*pair_dirs, "--max-queue", str(MAX_QUEUE), "--max-model-len", "4096", "--no-colocate",
                        "--speculative-config", json.dumps(ALL_DRAFTS))
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def local(pair_dirs):
    return LLM(str(pair_dirs[0]), str(pair_dirs[1]), ALL_DRAFTS, device="cpu", block_size=8)


@pytest.fixture
def client(server):
    c = DSparkClient(server.address)
    yield c
    c.close()


def _prompts(n):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 500, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _wait_blocks_free(client, timeout=5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        s = client.server_stats()
        if s.free_target_blocks == s.total_target_blocks and s.free_draft_blocks == s.total_draft_blocks:
            return s
        time.sleep(0.02)
    raise AssertionError(f"blocks not freed: {client.server_stats()}")


def test_single_request_equals_in_process_engine(client, local):
    prompt = _prompts(1)[0]
    out = client.generate(prompt, temperature=0.0, max_tokens=40)
    ref = local.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40))[0]
    assert out["token_ids"] == ref.token_ids and out["finish_reason"] == "length"
    assert out["stats"]["tau"] > 2.0 and out["stats"]["transfer_ms"] > 0


def test_concurrent_clients_equal_in_process_engine(server, local):
    prompts = _prompts(24)
    refs = local.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24))
    results = [None] * len(prompts)

    def run(i):
        c = DSparkClient(server.address)
        results[i] = c.generate(prompts[i], temperature=0.0, max_tokens=24)["token_ids"]
        c.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == [r.token_ids for r in refs]


def test_stream_order_and_final_stats(client, local):
    prompt = [5, 6, 7, 8]
    msgs = list(client.stream(prompt, temperature=0.0, max_tokens=30))
    chunks, final = msgs[:-1], msgs[-1]
    assert all(m.HasField("chunk") for m in chunks) and final.HasField("complete")
    ids = [t for m in chunks for t in m.chunk.token_ids]
    assert ids == list(final.complete.output_ids) == local.generate([prompt], SamplingParams(
        temperature=0.0, max_tokens=30))[0].token_ids
    counts = [m.chunk.num_output_tokens for m in chunks]
    assert counts == sorted(counts) and counts[-1] == 30
    s = final.complete.stats
    assert len(chunks) == s.num_spec_steps + 1  # the prefill token, then one message per verify step
    assert sum(s.accepted_per_step) == s.num_accepted_tokens and len(s.accepted_per_step) == s.num_spec_steps
    assert abs(s.mean_acceptance_length - (s.num_accepted_tokens + s.num_spec_steps) / s.num_spec_steps) < 1e-9
    assert s.draft_acceptance_rate == pytest.approx(s.num_accepted_tokens / s.num_draft_tokens)
    assert final.complete.finish_reason == pb.FINISH_REASON_LENGTH and final.complete.num_prompt_tokens == 4


def test_abort_returns_blocks_and_ends_the_stream(client):
    stream = client.stream([1, 2, 3], request_id="to-abort", temperature=0.0, max_tokens=3500, ignore_eos=True)
    first = next(stream)
    assert first.HasField("chunk")
    assert client.abort("to-abort", "unknown-id") == ["to-abort"]
    rest = list(stream)
    assert rest[-1].complete.finish_reason == pb.FINISH_REASON_ABORTED
    assert len(rest[-1].complete.output_ids) < 3500
    _wait_blocks_free(client, timeout=1.0)


def test_client_cancellation_returns_blocks(client):
    stream = client.stream([4, 5, 6], temperature=0.0, max_tokens=3500, ignore_eos=True)
    next(stream)
    stream.cancel()
    _wait_blocks_free(client, timeout=2.0)


def test_deadline_exceeded_frees_blocks(client):
    with pytest.raises(grpc.RpcError) as e:
        list(client.stream([9, 9], temperature=0.0, max_tokens=3500, ignore_eos=True, timeout=0.3))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_blocks_free(client, timeout=2.0)


BAD = [
    (dict(prompt=[]), "prompt is empty"),
    (dict(prompt=""), "prompt is empty"),
    (dict(prompt=[1], temperature=-0.5), "temperature must be a finite number >= 0"),
    (dict(prompt=[1], temperature=float("nan")), "temperature must be a finite number >= 0"),
    (dict(prompt=[1], top_p=0.0), "top_p must be in (0, 1]"),
    (dict(prompt=[1], top_p=1.5), "top_p must be in (0, 1]"),
    (dict(prompt=[1], max_tokens=0), "max_tokens must be >= 1"),
    (dict(prompt=[1], max_tokens=-3), "max_tokens must be >= 1"),
    (dict(prompt=[1], max_tokens=10**6), "max_tokens must be <= 4096"),
    (dict(prompt=[1] * 5000), "prompt has 5000 tokens; the maximum is 4095"),
    (dict(prompt=[1, 512, 3]), "token_ids must be in [0, 512), got [512]"),
    (dict(prompt=[1, -1]), "token_ids must be in [0, 512), got [-1]"),
    (dict(prompt="hello"), "text input needs a tokenizer"),
    (dict(prompt=[1], stop=["x"]), "sampling.stop needs a tokenizer"),
    (dict(prompt=[1], num_speculative_tokens=9), "speculative.num_speculative_tokens must be in [1, 6]"),
    (dict(prompt=[1], confidence_threshold=2.0), "speculative.confidence_threshold must be in [0, 1]"),
    (dict(prompt="x" * (5 << 20)), "bytes; the limit is 4194304"),  # an oversized message
]


@pytest.mark.parametrize("kw,message", BAD, ids=[m[:40] for _, m in BAD])
def test_malformed_input_is_invalid_argument_and_server_keeps_serving(client, kw, message):
    with pytest.raises(grpc.RpcError) as e:
        client.generate(**kw)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in e.value.details()
    assert len(client.generate([1, 2], temperature=0.0, max_tokens=3)["token_ids"]) == 3


def test_model_info_health_and_reflection(client, server):
    info = client.model_info()
    assert info.vocab_size == 512 and info.num_speculative_tokens == 6 and info.method == "dspark"
    assert client.health() == "SERVING" and client.health("dspark.v1.Generation") == "SERVING"
    with grpc.insecure_channel(server.address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        reply = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in reply.list_services_response.service}
        assert {"dspark.v1.Generation", "grpc.health.v1.Health"} <= names
        req = reflection_pb2.ServerReflectionRequest(file_containing_symbol="dspark.v1.Generation")
        reply = next(stub.ServerReflectionInfo(iter([req])))
        assert reply.file_descriptor_response.file_descriptor_proto  # enough for grpcurl to build requests


def test_queue_full_is_resource_exhausted(client, server):
    streams = [client.stream([i + 1], temperature=0.0, max_tokens=3500, ignore_eos=True, request_id=f"q{i}")
               for i in range(MAX_QUEUE)]
    for s in streams:
        next(s)  # every one is admitted and running
    with pytest.raises(grpc.RpcError) as e:
        client.generate([1], max_tokens=2)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue full" in e.value.details()
    assert sorted(client.abort(*[f"q{i}" for i in range(MAX_QUEUE)])) == sorted(f"q{i}" for i in range(MAX_QUEUE))
    for s in streams:
        list(s)
    _wait_blocks_free(client)
    assert len(client.generate([1, 2], max_tokens=2)["token_ids"]) == 2


def test_bench_load_generator_reports_throughput_latency_and_tau(server, tmp_path):
    import json
    import subprocess
    import sys

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("1,2,3\n4,5,6,7\n")
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "dspark_serve.cluster.commands", "bench", "--server", server.address,
                           "--concurrency", "1", "4", "--num-requests", "8", "--max-tokens", "16",
                           "--prompt-file", str(prompts), "--json", str(out)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())
    assert [r["concurrency"] for r in rows] == [1, 4] and all(r["errors"] == 0 and r["requests"] == 8 for r in rows)
    assert all(r["tokens_per_s"] > 0 and r["ttft_ms_p50"] > 0 and r["tpot_ms_p50"] > 0 and r["tau"] > 1.5
               for r in rows)
    assert all(r["per_replica"] == {"-": 8} and 0 <= r["prefix_cache_hit_rate"] <= 1 for r in rows)  # not Serve


def test_sigterm_drains(pair_dirs):
    """Runs its own server: NOT_SERVING and UNAVAILABLE while draining, the running request still finishes."""
    srv = ServerProcess(*pair_dirs)
    c = DSparkClient(srv.address)
    try:
        stream = c.stream([3, 1, 4], temperature=0.0, max_tokens=1500, ignore_eos=True)
        next(stream)
        srv.terminate()
        end = time.monotonic() + 10
        while c.health() != "NOT_SERVING" and time.monotonic() < end:
            time.sleep(0.02)
        assert c.health() == "NOT_SERVING" and c.health("dspark.v1.Generation") == "NOT_SERVING"
        with pytest.raises(grpc.RpcError) as e:
            c.generate([1], max_tokens=2)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in e.value.details()
        rest = list(stream)
        assert rest[-1].complete.finish_reason == pb.FINISH_REASON_LENGTH
        assert srv.wait(60) == 0 and "dspark-serve: stopped" in "".join(srv.log)
    finally:
        c.close()
        srv.kill()


def test_seeded_sampling_equals_in_process_engine(client, local):
    """T > 0 with q crossing the channel: (seed, position)-keyed randomness gives the same tokens."""
    for seed in (1, 2, 3):
        out = client.generate([7, 8, 9], temperature=0.9, top_p=0.95, seed=seed, max_tokens=24)
        ref = local.generate([[7, 8, 9]], SamplingParams(temperature=0.9, top_p=0.95, seed=seed, max_tokens=24))[0]
        assert out["token_ids"] == ref.token_ids


@pytest.mark.parametrize("device,gpus,draft,num_gpus,expected", [
    ("auto", 0, True, None, ("cpu", 0, "gloo")),
    ("auto", 2, True, None, ("cuda", 1, "nccl")),
    ("auto", 8, True, None, ("cuda", 1, "nccl")),
    ("auto", 1, True, None, ("cuda", 0.5, "gloo")),  # one GPU shared: NCCL cannot pair a device with itself
    ("auto", 1, False, None, ("cuda", 1, "nccl")),
    ("cpu", 4, True, None, ("cpu", 0, "gloo")),
    ("auto", 1, False, 0.5, ("cuda", 0.5, "gloo")),  # two replicas' pairs on one GPU
    ("cuda", 4, True, 2, ("cuda", 2, "nccl")),
    ("cpu", 1, False, 0.5, ("cpu", 0, "gloo")),
])
def test_device_plan(device, gpus, draft, num_gpus, expected):
    from dspark_serve.cluster.pair import plan_devices

    plan = plan_devices(device, gpus, draft, num_gpus)
    assert (plan.device, plan.gpus_per_actor, plan.backend) == expected


@pytest.mark.parametrize("colocate,device,gpus,placement,resources,expected", [
    (None, "cuda", 1, "PACK", (), True),  # one GPU: the draft runs inside the verifier
    (None, "cuda", 2, "PACK", (), False),  # a GPU each
    (None, "cpu", 0, "PACK", (), True),
    (None, "cpu", 0, "SPREAD", (), False),  # across nodes
    (None, "cpu", 0, "PACK", (("draft_node", 1.0),), False),
    (False, "cuda", 1, "PACK", (), False),  # an explicit choice stands
    (True, "cuda", 2, "PACK", (), True),
])
def test_default_placement(colocate, device, gpus, placement, resources, expected):
    from dspark_serve.cluster.config import PairConfig
    from dspark_serve.cluster.pair import plan_devices, resolve_colocate
    from dspark_serve.engine.engine_config import EngineConfig

    cfg = PairConfig(EngineConfig(target="t", draft="d", device=device), placement=placement, colocate=colocate,
                     draft_resources=resources)
    assert resolve_colocate(cfg, plan_devices(device, gpus, True)) is expected


def test_a_dead_verifier_fails_streams_and_health(pair_dirs):
    """Kill the verifier actor mid-stream: the client gets UNAVAILABLE at once, health reads NOT_SERVING (not a
    ping that lies), and the server still shuts down cleanly."""
    import os
    import signal
    import subprocess

    srv = ServerProcess(*pair_dirs)
    c = DSparkClient(srv.address)
    try:
        stream = c.stream([1, 2, 3], temperature=0.0, max_tokens=3000, ignore_eos=True)
        next(stream)
        pids = subprocess.run(["pgrep", "-s", str(srv.proc.pid), "-f", "ray::VerifierActor"],  # this server only
                              capture_output=True, text=True).stdout.split()
        assert pids
        for pid in pids:
            os.kill(int(pid), signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as e:
            list(stream)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "unavailable" in e.value.details()
        end = time.monotonic() + 15
        while c.health() != "NOT_SERVING" and time.monotonic() < end:
            time.sleep(0.1)
        assert c.health() == "NOT_SERVING"
        srv.terminate()
        assert srv.wait(60) == 0
    finally:
        c.close()
        srv.kill()


def test_colocated_draft_serves_the_same_tokens(pair_dirs, local):
    """The default on one device: the draft inside the verifier actor (no draft actor, no step channel); same
    greedy tokens, no channel time, the draft's blocks accounted on the same server."""
    srv = ServerProcess(*pair_dirs)
    try:
        c = DSparkClient(srv.address)
        prompts = _prompts(4)
        refs = local.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24))
        for prompt, ref in zip(prompts, refs):
            out = c.generate(prompt, temperature=0.0, max_tokens=24)
            assert out["token_ids"] == ref.token_ids
            assert out["stats"]["tau"] > 2.0 and out["stats"]["transfer_ms"] == 0
        s = _wait_blocks_free(c)
        assert s.total_draft_blocks == 1024 and s.tokens_generated == 4 * 24
        c.close()
    finally:
        srv.kill()


def test_an_idle_split_pair_outlives_its_channel_timeout(pair_dirs, local):
    """Idle for twice the step channel's operation timeout: the keepalive pings keep the pair serving."""
    srv = ServerProcess(*pair_dirs, "--no-colocate", "--channel-timeout", "2", "--keepalive", "0.5")
    c = DSparkClient(srv.address)
    try:
        prompt = _prompts(1)[0]
        ref = local.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16))[0].token_ids
        assert c.generate(prompt, temperature=0.0, max_tokens=16)["token_ids"] == ref
        time.sleep(5)
        assert c.health() == "SERVING"
        out = c.generate(prompt, temperature=0.0, max_tokens=16, timeout=20)
        assert out["token_ids"] == ref and out["stats"]["transfer_ms"] > 0
    finally:
        c.close()
        srv.kill()


def test_cancelled_and_expired_requests_never_run_on(client):
    """Deadlines that expire while a request is admitted, tokenized or decoding: none keeps running for nobody."""
    def one(i):
        try:
            client.generate(_prompts(1)[0], temperature=0.0, max_tokens=3000, ignore_eos=True,
                            timeout=0.005 * (i % 20 + 1))
        except grpc.RpcError as e:  # 40 clients against a queue of MAX_QUEUE: some are turned away
            assert e.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    end = time.monotonic() + 5
    while (s := client.server_stats()).num_running + s.num_waiting and time.monotonic() < end:
        time.sleep(0.05)
    assert s.num_running == s.num_waiting == 0


def test_a_request_past_the_context_limit_is_refused_naming_it(client):
    with pytest.raises(grpc.RpcError) as e:
        client.generate([1] * 4000, max_tokens=200)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_model_len (4096)" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        client.generate([1, 2], max_tokens=5000)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "4096" in e.value.details()


def test_serve_refuses_a_context_limit_past_the_models(pair_dirs):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "dspark_serve.cluster.commands", "serve", "--target", str(pair_dirs[0]),
                        "--max-model-len", "999999", "--port", "0"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--max-model-len must be in [2, 4096]" in r.stderr


def test_serve_takes_vllm_style_arguments(pair_dirs, local):
    """`dspark-serve serve MODEL --speculative-config '{"model": DRAFT}' --dtype auto`, as with `vllm serve`."""
    import json

    target, draft = pair_dirs
    srv = ServerProcess(None, None, str(target), "--speculative-config", json.dumps({"model": str(draft)}),
                        "--dtype", "auto")
    try:
        c = DSparkClient(srv.address)
        prompt = _prompts(1)[0]
        out = c.generate(prompt, temperature=0.0, max_tokens=24)
        ref = local.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24))[0]
        assert out["token_ids"] == ref.token_ids and out["stats"]["tau"] > 1.5
        c.close()
    finally:
        srv.kill()


def test_every_serve_flag_has_help():
    from dspark_serve.cluster.commands.cli import build_parser

    serve = next(a for a in build_parser()._subparsers._group_actions[0].choices.items() if a[0] == "serve")[1]
    missing = [a.option_strings or a.dest for a in serve._actions if not a.help]
    assert not missing, missing
