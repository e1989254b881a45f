"""The gateway's edges in time: a drain that runs out ends streams with FINISH_REASON_ABORTED before the server stops;
a gone pair and faults inside a method reach the client as clean status messages, never internals."""

import asyncio
import time

import grpc
import pytest
from service import ServerProcess

from dspark_serve.cluster.auth import Access
from dspark_serve.cluster.grpc_client import DSparkClient
from dspark_serve.cluster.config import GatewayConfig
from dspark_serve.cluster.gateway import UNAVAILABLE, GatewayCore, GatewayError
from dspark_serve.cluster.gateway_request import GatewayRequest
from dspark_serve.cluster.grpc_methods import SERVICE_NAME, GenerationServicer, rpc_handlers
from dspark_serve.models.random_init import random_pair
from dspark_serve.protos.dspark.v1 import dspark_pb2 as pb


def test_sigterm_after_the_drain_timeout_aborts_running_streams(tmp_path):
    pair_dirs = random_pair(tmp_path, agree=0.005, block_size=6)
    srv = ServerProcess(*pair_dirs, "--drain-timeout", "0.5")
    c = DSparkClient(srv.address)
    try:
        stream = c.stream([3, 1, 4], temperature=0.0, max_tokens=3500, ignore_eos=True, timeout=60)
        assert next(stream).HasField("chunk")
        t0 = time.monotonic()
        srv.terminate()
        rest = list(stream)  # ends with a final message, not an error
        final = rest[-1].complete
        assert final.finish_reason == pb.FINISH_REASON_ABORTED and 0 < len(final.output_ids) < 3500
        assert time.monotonic() - t0 < 20
        assert srv.wait(60) == 0 and "dspark-serve: stopped" in "".join(srv.log)
    finally:
        c.close()
        srv.kill()


class _GonePair:
    """A verifier whose actor died: every call fails with what Ray would say."""

    class _Method:
        def remote(self):
            raise RuntimeError("ActorDiedError: actor 5f3c... (pid 4242, ip 10.1.2.3) died unexpectedly")

    def __getattr__(self, name):
        return self._Method()


INFO = dict(target="t", draft="d", method="dspark", vocab_size=512, max_model_len=256, num_speculative_tokens=6,
            eos_token_ids=[0], has_tokenizer=False)


def test_a_gone_pair_is_unavailable_on_every_method():
    """No request stream (the pair is gone): UNAVAILABLE with the same plain message from each method."""
    core = GatewayCore(_GonePair(), INFO, GatewayConfig())

    async def calls():
        for call in (lambda: core.server_stats(), lambda: core.abort(["x"], "caller"), core.model_info):
            with pytest.raises(GatewayError) as e:
                result = call()
                if asyncio.iscoroutine(result):
                    await result
            assert e.value.code == "UNAVAILABLE" and e.value.message == UNAVAILABLE
        with pytest.raises(GatewayError) as e:
            [m async for m in core.generate(GatewayRequest((1,)), None, "caller")]
        assert e.value.code == "UNAVAILABLE"

    asyncio.run(calls())


class _BrokenCore:
    """A core whose stats call hits a fault that names internals."""

    async def server_stats(self):
        raise RuntimeError("actor 5f3c at 10.1.2.3 pid 4242")

    def model_info(self):
        raise GatewayError("UNAVAILABLE", UNAVAILABLE)


def test_the_servicer_maps_faults_to_clean_status():
    async def run():
        server = grpc.aio.server()
        server.add_registered_method_handlers(
            SERVICE_NAME, rpc_handlers(GenerationServicer(_BrokenCore(), Access()), GatewayConfig()))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                out = []
                for method, cls in (("GetServerStats", pb.ServerStats), ("GetModelInfo", pb.ModelInfo)):
                    call = ch.unary_unary(f"/{SERVICE_NAME}/{method}", request_serializer=lambda m: m.SerializeToString(),
                                          response_deserializer=cls.FromString)
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await call(pb.GetServerStatsRequest(), timeout=10)
                    out.append((e.value.code(), e.value.details()))
                return out
        finally:
            await server.stop(0)

    (stats_code, stats_details), (info_code, info_details) = asyncio.run(run())
    assert stats_code == grpc.StatusCode.INTERNAL and stats_details == "internal error; the request did not complete"
    assert info_code == grpc.StatusCode.UNAVAILABLE and info_details == UNAVAILABLE
