"""Hostile input against a real server (with an API key): random and truncated bodies, wrong wire types, invalid
UTF-8, NaN/inf/negative values, oversized fields and bodies, bad metadata, to every method. Only client-error codes
may come back, the server keeps serving the right tokens, and every KV block is free afterwards. (The request
messages have no enum fields; unknown field numbers and wire types stand in for unknown values.)"""

import asyncio
import random
import struct
import time

import grpc
import pytest
from service import ServerProcess

from dspark_serve.cluster.grpc_client import DSparkClient
from dspark_serve.engine.llm import LLM
from dspark_serve.engine.sampling_params import SamplingParams
from dspark_serve.models.random_init import random_pair
from dspark_serve.protos.dspark.v1 import dspark_pb2 as pb

KEY = "fuzz-key-0123456789abcdef"
AUTH = (("authorization", f"Bearer {KEY}"),)
MAX_REQUEST, MAX_CONTROL = 64 << 10, 4 << 10
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
           grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.NOT_FOUND,
           grpc.StatusCode.UNAUTHENTICATED,
           grpc.StatusCode.ALREADY_EXISTS}  # copies of one request, with its request_id, run concurrently
INTERNALS = ("Traceback", "Unexpected", "ray", "Actor", "pid", "key:", "cert:", "peer:", "127.0.0.1")
METHODS = ("Generate", "Abort", "GetModelInfo", "GetServerStats")
NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    return random_pair(tmp_path_factory.mktemp("pair"), agree=0.005, block_size=6)


@pytest.fixture(scope="module")
def server(pair_dirs):
    srv = ServerProcess(*pair_dirs, "--api-key", KEY, "--max-model-len", "256", "--max-request-bytes",
                        str(MAX_REQUEST), "--max-control-request-bytes", str(MAX_CONTROL))
    yield srv
    srv.kill()


# Protobuf wire format, by hand: what the generated classes cannot produce.
def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _field(number: int, wire: int, payload: bytes) -> bytes:
    return _varint(number << 3 | wire) + payload


def _ld(number: int, data: bytes) -> bytes:
    return _field(number, 2, _varint(len(data)) + data)


def _valid(**sampling) -> pb.GenerateRequest:
    req = pb.GenerateRequest(sampling=pb.SamplingParams(**{"temperature": 0.0, "max_tokens": 4, **sampling}))
    req.token_ids.ids.extend([1, 2, 3])
    return req


def _hostile_requests() -> list[pb.GenerateRequest]:
    """Field values the schema allows and the server must refuse (or serve) by name."""
    bad_sampling = [dict(temperature=v) for v in (NAN, INF, -INF, -1.0, -1e-30)]
    bad_sampling += [dict(top_p=v) for v in (NAN, 0.0, -0.5, 1.5, INF)]
    bad_sampling += [dict(min_p=v) for v in (NAN, -0.1, 2.0)] + [dict(top_k=-1), dict(top_k=-(2 ** 31))]
    bad_sampling += [dict(max_tokens=v) for v in (0, -1, -(2 ** 31), 2 ** 31 - 1, 257)]
    bad_sampling += [dict(seed=-(2 ** 63)), dict(seed=2 ** 63 - 1), dict(ignore_eos=True)]
    bad_sampling += [dict(stop=[""]), dict(stop=["x"] * 65), dict(stop=["y" * 1025]), dict(stop=["ok"])]
    bad_sampling += [dict(stop_token_ids=[-1]), dict(stop_token_ids=list(range(257))),
                     dict(stop_token_ids=[2 ** 31 - 1])]
    reqs = [_valid(**kw) for kw in bad_sampling]
    for ids in ([], [-1], [512], [2 ** 31 - 1], [-(2 ** 31)], [1] * 300, [0] * 255):
        req = _valid()
        del req.token_ids.ids[:]
        req.token_ids.ids.extend(ids)
        reqs.append(req)
    for spec in (dict(num_speculative_tokens=0), dict(num_speculative_tokens=-5), dict(num_speculative_tokens=99),
                 dict(confidence_threshold=NAN), dict(confidence_threshold=-INF), dict(confidence_threshold=1.5),
                 dict(disable=True), dict(num_speculative_tokens=3, confidence_threshold=0.5)):
        req = _valid()
        req.speculative.CopyFrom(pb.SpeculativeOverrides(**spec))
        reqs.append(req)
    for text in ("", "hello", "\x00" * 10, "\U0001f600" * 100):
        reqs.append(pb.GenerateRequest(text=text, sampling=pb.SamplingParams(max_tokens=2)))
    reqs += [pb.GenerateRequest(), pb.GenerateRequest(request_id="r" * 300, token_ids=pb.TokenIds(ids=[1]))]
    reqs.append(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 20000)))  # over the byte limit
    return reqs


def _cases(rng: random.Random) -> list[tuple[str, bytes, tuple]]:
    """(method, raw body, metadata)."""
    rich = _valid(stop=["ab", "cd"], stop_token_ids=[5, 6], seed=7)
    rich.request_id = "rich"
    rich.speculative.num_speculative_tokens = 3
    abort = pb.AbortRequest(request_ids=["a", "b", "\u00e9" * 10]).SerializeToString()
    cases = []
    for _ in range(350):  # random bytes, to every method
        for m in METHODS:
            cases.append((m, rng.randbytes(rng.choice([0, 1, 2, 5, 17, 64, 300])), AUTH))
    valid = rich.SerializeToString()
    cases += [("Generate", valid[:n], AUTH) for n in range(len(valid))]  # truncated
    cases += [("Abort", abort[:n], AUTH) for n in range(len(abort))]
    for _ in range(300):  # bit flips of valid messages
        m, body = rng.choice([("Generate", valid), ("Abort", abort)])
        b = bytearray(body)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        cases.append((m, bytes(b), AUTH))
    for _ in range(300):  # any field number and wire type, then a payload that may not fit it
        number, wire = rng.choice([1, 2, 3, 4, 5, 6, 7, 8, 99, 536870911]), rng.randrange(8)
        payload = rng.choice([_varint(rng.getrandbits(64)), struct.pack("<f", NAN), struct.pack("<d", -INF),
                              _varint(5) + b"\xff\xfe\xfd\xfc\xfb", _varint(2 ** 31) + b"x", b""])
        inner = _field(number, wire, payload)
        body = rng.choice([inner, _ld(4, inner), _ld(5, inner), _ld(3, inner), valid + inner])
        cases.append((rng.choice(METHODS), body, AUTH))
    for field in (1, 2):  # invalid UTF-8 in request_id and text; in a stop string; in an Abort id
        cases.append(("Generate", _ld(field, b"\xc3\x28\xff"), AUTH))
    cases.append(("Generate", _ld(3, _ld(1, b"\x01\x02")) + _ld(4, _ld(7, b"\xed\xa0\x80")), AUTH))
    cases.append(("Abort", _ld(1, b"\x80\x80"), AUTH))
    cases.append(("Generate", b"\x0b" * 100 + b"\x0c" * 100, AUTH))  # groups, unbalanced
    cases.append(("Generate", _ld(4, _ld(4, _ld(4, b"\x08" * 3))), AUTH))
    cases += [("Generate", r.SerializeToString(), AUTH) for r in _hostile_requests()]
    cases += [("Abort", pb.AbortRequest(request_ids=[str(i) for i in range(n)]).SerializeToString(), AUTH)
              for n in (1024, 1025, 5000)]
    for size in (MAX_CONTROL + 1, MAX_REQUEST + 1, 3 * MAX_REQUEST):  # oversized bodies
        for m in METHODS:
            cases.append((m, _ld(1, b"z" * size), AUTH))
    for md in ((), (("authorization", "Bearer wrong"),), (("authorization", "Bearer"),),
               (("authorization", "bearer  " + KEY + "x"),), (("authorization", KEY),),
               (("authorization-bin", KEY.encode()),), (("x-api-key", KEY),)):
        for m in METHODS:
            cases.append((m, valid if m == "Generate" else b"", md))
    cases += [("Nope", b"", AUTH), ("generate", valid, AUTH)]
    return cases


async def _run(address: str, cases: list, concurrency: int = 48) -> list:
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    async with grpc.aio.insecure_channel(address, options=options) as ch:
        sem = asyncio.Semaphore(concurrency)

        async def one(method: str, body: bytes, md: tuple):
            path = f"/dspark.v1.Generation/{method}"
            async with sem:
                try:
                    if method.lower() == "generate":
                        call = ch.unary_stream(path, request_serializer=lambda b: b,
                                               response_deserializer=pb.GenerateResponse.FromString)(
                            body, metadata=md, timeout=60)
                        async for _ in call:  # a valid request: one message is enough, then cancel it
                            call.cancel()
                            break
                    else:
                        await ch.unary_unary(path, request_serializer=lambda b: b,
                                             response_deserializer=lambda b: b)(body, metadata=md, timeout=60)
                    return grpc.StatusCode.OK, ""
                except grpc.aio.AioRpcError as e:
                    return e.code(), e.details() or ""
                except asyncio.CancelledError:
                    return grpc.StatusCode.OK, ""

        return await asyncio.gather(*(one(*c) for c in cases))


def _wait_blocks_free(client: DSparkClient, timeout_s: float = 10.0) -> pb.ServerStats:
    end = time.monotonic() + timeout_s
    while True:
        s = client.server_stats()
        free = s.free_target_blocks == s.total_target_blocks and s.free_draft_blocks == s.total_draft_blocks
        if (free and not s.num_running and not s.num_waiting) or time.monotonic() > end:
            return s
        time.sleep(0.05)


def test_malformed_bodies_and_values_get_client_errors_only(server, pair_dirs):
    cases = _cases(random.Random(0))
    assert len(cases) >= 2000
    t0 = time.monotonic()
    results = asyncio.run(_run(server.address, cases))
    elapsed = time.monotonic() - t0
    bad = [(m, body[:40], code.name, details) for (m, body, _), (code, details) in zip(cases, results)
           if code not in ALLOWED]
    assert not bad, f"{len(bad)} unexpected codes, e.g. {bad[:5]}"
    leaks = [d for _, d in results if any(w in d for w in INTERNALS)]
    assert not leaks, leaks[:5]
    codes = {code for code, _ in results}
    assert {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED,
            grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNIMPLEMENTED} <= codes
    assert elapsed < 45, f"{len(cases)} calls took {elapsed:.1f} s"

    client = DSparkClient(server.address, api_key=KEY)
    try:
        assert client.health() == "SERVING"
        local = LLM(str(pair_dirs[0]), str(pair_dirs[1]), device="cpu", block_size=8)
        ref = local.generate([[3, 1, 4, 1, 5]], SamplingParams(temperature=0.0, max_tokens=12))[0]
        assert client.generate([3, 1, 4, 1, 5], temperature=0.0, max_tokens=12, timeout=60)["token_ids"] == \
            ref.token_ids
        s = _wait_blocks_free(client)
        assert s.free_target_blocks == s.total_target_blocks and s.free_draft_blocks == s.total_draft_blocks, s
        assert s.num_running == 0 and s.num_waiting == 0, s
    finally:
        client.close()


@pytest.mark.parametrize("method,body,message", [
    ("Generate", _valid(stop=["x"] * 65).SerializeToString(), "sampling.stop has 65 strings; the limit is 64"),
    ("Generate", _valid(stop=["y" * 1025]).SerializeToString(), "sampling.stop has a string of 1025 characters"),
    ("Generate", _valid(stop_token_ids=list(range(257))).SerializeToString(),
     "sampling.stop_token_ids has 257 ids; the limit is 256"),
    ("Generate", b"\x12\x03\xc3\x28\xff", "not a valid dspark.v1.GenerateRequest"),
    ("Generate", _ld(3, b"\x08" * (MAX_REQUEST + 1)), f"bytes; the limit is {MAX_REQUEST}"),
    ("Abort", pb.AbortRequest(request_ids=["i"] * 1025).SerializeToString(),
     "request_ids has 1025 ids; the limit is 1024"),
    ("Abort", _ld(1, b"z" * MAX_CONTROL), f"bytes; the limit is {MAX_CONTROL}"),
    ("GetServerStats", b"\xff\xff", "not a valid dspark.v1.GetServerStatsRequest"),
])
def test_limits_and_undecodable_bodies_are_named(server, method, body, message):
    code, details = asyncio.run(_run(server.address, [(method, body, AUTH)]))[0]
    assert code == grpc.StatusCode.INVALID_ARGUMENT and message in details, (code, details)


def test_a_huge_body_is_refused_without_reading_it(server):
    """grpc's own limit (twice the largest of ours) answers from the length prefix: 64 MB costs no 64 MB read."""
    t0 = time.monotonic()
    code, details = asyncio.run(_run(server.address, [("Abort", _ld(1, b"z" * (64 << 20)), AUTH)]))[0]
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
    assert time.monotonic() - t0 < 5
