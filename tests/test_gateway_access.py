"""Access to the gateway: TLS and mutual TLS with certificates made here, API keys, request ids scoped to their
caller, and the embedded Ray bound to loopback with token auth. Real servers (`dspark-serve serve`) on 127.0.0.1."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from service import ServerProcess
from tls_certs import write_pki

from dspark_serve.cluster.grpc_client import DSparkClient
from dspark_serve.models.random_init import random_pair
from dspark_serve.protos.dspark.v1 import dspark_pb2 as pb
from dspark_serve.protos.dspark.v1 import dspark_pb2_grpc

KEY_A, KEY_B = "key-a-" + "7" * 26, "key-b-" + "9" * 26
LONG = dict(temperature=0.0, max_tokens=3500, ignore_eos=True)


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    return random_pair(tmp_path_factory.mktemp("pair"), agree=0.005, block_size=6)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return write_pki(tmp_path_factory.mktemp("pki"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tls_server(pair_dirs, pki):
    """TLS, two API keys (two callers), and the plaintext health port for probes."""
    health_port = _free_port()
    srv = ServerProcess(*pair_dirs, "--ssl-certfile", str(pki["server_cert"]), "--ssl-keyfile",
                        str(pki["server_key"]), "--api-key", KEY_A, KEY_B, "--health-port", str(health_port))
    srv.health_port = health_port
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def mtls_server(pair_dirs, pki):
    """Mutual TLS, no key: the client certificate names the caller."""
    srv = ServerProcess(*pair_dirs, "--ssl-certfile", str(pki["server_cert"]), "--ssl-keyfile",
                        str(pki["server_key"]), "--ssl-ca-certs", str(pki["ca"]))
    yield srv
    srv.kill()


def _client(srv, pki, key=None, cert=None):
    private_key, chain = pki[cert] if cert else (None, None)
    return DSparkClient(srv.address, root_certificates=pki["ca"].read_bytes(), api_key=key, private_key=private_key,
                        certificate_chain=chain)


def _code(fn):
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value.code(), e.value.details()


def test_tls_client_with_key_generates_and_plaintext_fails(tls_server, pki):
    c = _client(tls_server, pki, KEY_A)
    out = c.generate([1, 2, 3], temperature=0.0, max_tokens=8, timeout=60)
    assert len(out["token_ids"]) == 8 and out["finish_reason"] == "length"
    plain = DSparkClient(tls_server.address, api_key=KEY_A)
    assert _code(lambda: plain.generate([1, 2, 3], max_tokens=2, timeout=5))[0] == grpc.StatusCode.UNAVAILABLE
    plain.close()
    c.close()


def test_every_method_needs_the_key(tls_server, pki):
    for key, message in ((None, "missing metadata 'authorization"), ("wrong-key", "invalid API key")):
        c = _client(tls_server, pki, key)
        calls = [lambda: c.generate([1, 2], max_tokens=2, timeout=10), lambda: c.abort("x"), c.model_info,
                 c.server_stats]
        for call in calls:
            code, details = _code(call)
            assert code == grpc.StatusCode.UNAUTHENTICATED and message in details
        c.close()
    with grpc.secure_channel(tls_server.address, grpc.ssl_channel_credentials(pki["ca"].read_bytes())) as ch:
        stub = dspark_pb2_grpc.GenerationStub(ch)
        code, details = _code(lambda: stub.GetModelInfo(pb.GetModelInfoRequest(),
                                                        metadata=(("authorization", "Basic " + KEY_A),)))
        assert code == grpc.StatusCode.UNAUTHENTICATED and "must be 'Bearer <api key>'" in details
        assert stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=(("authorization", "bearer " + KEY_B),))


def test_health_and_reflection_stay_open_without_a_key(tls_server, pki):
    c = _client(tls_server, pki)
    assert c.health() == "SERVING" and c.health("dspark.v1.Generation") == "SERVING"
    stub = reflection_pb2_grpc.ServerReflectionStub(c.channel)
    reply = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    assert "dspark.v1.Generation" in {s.name for s in reply.list_services_response.service}
    c.close()


def test_the_health_port_answers_probes_in_plaintext_and_nothing_else(tls_server):
    with grpc.insecure_channel(f"127.0.0.1:{tls_server.health_port}") as ch:
        check = health_pb2_grpc.HealthStub(ch).Check
        for service in ("", "dspark.v1.Generation"):
            assert check(health_pb2.HealthCheckRequest(service=service), timeout=10).status == \
                health_pb2.HealthCheckResponse.SERVING
        code, _ = _code(lambda: dspark_pb2_grpc.GenerationStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=10))
        assert code == grpc.StatusCode.UNIMPLEMENTED


def _first(stream):
    msg = next(stream)
    assert msg.HasField("chunk")
    return msg


def test_two_keys_share_a_request_id_and_abort_only_their_own(tls_server, pki):
    a, b = _client(tls_server, pki, KEY_A), _client(tls_server, pki, KEY_B)
    sa = a.stream([1, 2, 3], request_id="same", timeout=120, **LONG)
    sb = b.stream([4, 5, 6], request_id="same", timeout=120, **LONG)
    assert _first(sa).request_id == "same" and _first(sb).request_id == "same"
    code, details = _code(lambda: a.generate([7], request_id="same", max_tokens=2, timeout=10))
    assert code == grpc.StatusCode.ALREADY_EXISTS and "'same'" in details  # the same caller cannot reuse it
    assert a.abort("same") == ["same"]
    rest = list(sa)
    assert rest[-1].complete.finish_reason == pb.FINISH_REASON_ABORTED and rest[-1].request_id == "same"
    assert a.abort("same") == []  # a's is gone; b's is not a's to abort
    time.sleep(0.3)
    assert b.server_stats().num_running == 1  # b's still runs in the step loop
    assert b.abort("same") == ["same"]
    assert list(sb)[-1].complete.finish_reason == pb.FINISH_REASON_ABORTED
    _wait_idle(a)
    a.close()
    b.close()


def test_an_id_reused_right_after_a_cancel_is_a_new_request(tls_server, pki):
    """The cancelled request may still be live in the step loop; the new one with its id must not meet it there."""
    c = _client(tls_server, pki, KEY_A)
    for _ in range(5):
        stream = c.stream([1, 2, 3], request_id="again", timeout=60, **LONG)
        _first(stream)
        stream.cancel()
        out = c.generate([1, 2, 3], request_id="again", temperature=0.0, max_tokens=4, timeout=60)
        assert len(out["token_ids"]) == 4 and out["finish_reason"] == "length" and out["request_id"] == "again"
    _wait_idle(c)
    c.close()


def test_server_assigned_ids_are_random_128_bit(tls_server, pki):
    c = _client(tls_server, pki, KEY_A)
    ids = []
    for _ in range(6):
        msgs = list(c.stream([1, 2], temperature=0.0, max_tokens=3, timeout=60))
        assert len({m.request_id for m in msgs}) == 1
        ids.append(msgs[-1].request_id)
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids) and len(set(ids)) == len(ids)
    c.close()


def test_cli_generate_over_tls_with_the_key_from_the_environment(tls_server, pki):
    cmd = [sys.executable, "-m", "dspark_serve.cluster.commands", "generate", "--server", tls_server.address,
           "--ssl-ca-certs", str(pki["ca"]), "--prompt-ids", "1,2,3", "--max-tokens", "4", "--json"]
    env = {**os.environ, "DSPARK_API_KEY": KEY_B}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["token_ids"]) == 4
    env["DSPARK_API_KEY"] = "wrong"
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode != 0 and "UNAUTHENTICATED: invalid API key" in out.stderr


def _grpcurl() -> str | None:
    """The grpcurl on PATH or beside this Python (the test extra installs one), if it runs here."""
    for path in (shutil.which("grpcurl"), str(Path(sys.executable).parent / "grpcurl")):
        try:
            if path and subprocess.run([path, "-version"], capture_output=True, timeout=30).returncode == 0:
                return path
        except OSError:
            pass
    return None


def test_grpcurl_over_tls_with_the_key(tls_server, pki):
    """The README's grpcurl call: reflection builds the request; the key goes in a header."""
    grpcurl = _grpcurl()
    if grpcurl is None:
        pytest.skip("grpcurl is not installed")
    base = [grpcurl, "-cacert", str(pki["ca"]), "-max-time", "60"]
    body = '{"token_ids": {"ids": [1, 2, 3]}, "sampling": {"temperature": 0, "max_tokens": 4}}'
    out = subprocess.run(base + ["-H", f"authorization: Bearer {KEY_A}", "-d", body, tls_server.address,
                                 "dspark.v1.Generation/Generate"], capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    final = json.loads("[" + re.sub(r"}\s*{", "},{", out.stdout) + "]")[-1]
    c = _client(tls_server, pki, KEY_A)
    assert final["complete"]["output_ids"] == c.generate([1, 2, 3], temperature=0.0, max_tokens=4)["token_ids"]
    assert final["complete"]["finish_reason"] == "FINISH_REASON_LENGTH"
    c.close()
    out = subprocess.run(base + ["-d", body, tls_server.address, "dspark.v1.Generation/Generate"],
                         capture_output=True, text=True, timeout=90)
    assert out.returncode != 0 and "Unauthenticated" in out.stderr


def test_mutual_tls_needs_a_client_certificate_from_the_ca(mtls_server, pki):
    for cert in (None, "mallory"):  # none, or one another CA signed
        c = _client(mtls_server, pki, cert=cert)
        assert _code(lambda: c.model_info())[0] == grpc.StatusCode.UNAVAILABLE
        c.close()
    c = _client(mtls_server, pki, cert="alice")
    assert c.model_info().vocab_size == 512
    c.close()
    folder = pki["ca"].parent
    out = subprocess.run([sys.executable, "-m", "dspark_serve.cluster.commands", "generate", "--server", mtls_server.address,
                          "--ssl-ca-certs", str(pki["ca"]), "--ssl-certfile", str(folder / "bob.pem"), "--ssl-keyfile",
                          str(folder / "bob.key"), "--prompt-ids", "1,2", "--max-tokens", "3", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and len(json.loads(out.stdout)["token_ids"]) == 3, out.stderr


def test_two_certificates_share_a_request_id(mtls_server, pki):
    alice, bob = _client(mtls_server, pki, cert="alice"), _client(mtls_server, pki, cert="bob")
    sa = alice.stream([1, 2, 3], request_id="r1", timeout=120, **LONG)
    sb = bob.stream([1, 2, 3], request_id="r1", timeout=120, **LONG)
    _first(sa), _first(sb)
    assert bob.abort("r1") == ["r1"]
    assert list(sb)[-1].complete.finish_reason == pb.FINISH_REASON_ABORTED
    time.sleep(0.3)
    assert alice.server_stats().num_running == 1  # alice's still runs
    assert alice.abort("r1") == ["r1"]
    assert list(sa)[-1].complete.finish_reason == pb.FINISH_REASON_ABORTED
    _wait_idle(alice)
    alice.close()
    bob.close()


def _wait_idle(client, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        s = client.server_stats()
        if not s.num_running and s.free_target_blocks == s.total_target_blocks:
            return
        time.sleep(0.05)
    raise AssertionError(f"not idle: {client.server_stats()}")


def _session_listeners(srv) -> list[tuple[str, str]]:
    """(process name, bound address) of every TCP listener in the server's process session (it and Ray's)."""
    procs = [p for p in psutil.process_iter(["pid", "name"]) if _session(p.pid) == srv.proc.pid]
    out = []
    for p in procs:
        try:
            out += [(p.info["name"], c.laddr.ip) for c in p.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
        except psutil.Error:
            pass
    return out


def _session(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def test_embedded_ray_listens_on_loopback_only_and_needs_its_token(mtls_server):
    listeners = _session_listeners(mtls_server)
    assert any(name == "gcs_server" for name, _ in listeners) and len(listeners) > 3
    loopback = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}
    assert all(ip in loopback for _, ip in listeners), listeners
    gcs = next(p for p in psutil.process_iter(["name"]) if p.info["name"] == "gcs_server"
               and _session(p.pid) == mtls_server.proc.pid)
    [port] = {c.laddr.port for c in gcs.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:  # a Ray call without Ray's auth token
        call = ch.unary_unary("/ray.rpc.NodeInfoGcsService/GetAllNodeInfo", request_serializer=lambda b: b,
                              response_deserializer=lambda b: b)
        assert _code(lambda: call(b"", timeout=10))[0] == grpc.StatusCode.UNAUTHENTICATED


def test_serve_flags_and_key_from_the_environment(monkeypatch):
    from dspark_serve.cluster.commands.cli import build_parser
    from dspark_serve.cluster.commands.serve_cmd import _api_keys
    from dspark_serve.cluster.config import GatewayConfig

    parser = build_parser()
    monkeypatch.setenv("DSPARK_API_KEY", "from-env")
    assert _api_keys(parser.parse_args(["serve", "--target", "t"])) == ("from-env",)
    assert _api_keys(parser.parse_args(["serve", "--target", "t", "--api-key", "k1", "k2"])) == ("k1", "k2")
    monkeypatch.delenv("DSPARK_API_KEY")
    assert _api_keys(parser.parse_args(["serve", "--target", "t"])) == ()
    cfg = GatewayConfig(api_keys=("secret-key",))
    assert "secret-key" not in repr(cfg)
    for bad in (dict(ssl_certfile="c"), dict(ssl_ca_certs="ca"), dict(api_keys=(" k",)), dict(max_abort_ids=0)):
        with pytest.raises(ValueError):
            GatewayConfig(**bad).validate()


def test_manifests_take_the_key_and_certificates_from_secrets():
    import yaml

    from dspark_serve.cluster.commands.cli import build_parser

    root = Path(__file__).resolve().parents[1] / "deploy" / "kuberay"
    head = yaml.safe_load((root / "raycluster.yaml").read_text())["spec"]["headGroupSpec"]["template"]["spec"]
    [gateway] = [c for c in head["containers"] if c["name"] == "gateway"]
    args = build_parser().parse_args(gateway["command"][1:])  # every flag exists
    env = {e["name"]: e for e in gateway["env"]}
    assert env["DSPARK_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] and args.api_key is None
    mounts = {m["mountPath"]: m["name"] for m in gateway["volumeMounts"]}
    volumes = {v["name"]: v for v in head["volumes"]}
    for path in (args.ssl_certfile, args.ssl_keyfile):
        assert "secret" in volumes[mounts[str(Path(path).parent)]]
    assert gateway["readinessProbe"]["grpc"]["port"] == gateway["livenessProbe"]["grpc"]["port"] == args.health_port
    service = yaml.safe_load((root / "rayservice.yaml").read_text())["spec"]["rayClusterConfig"]
    for group in service["workerGroupSpecs"]:  # where the Serve replica runs
        [container] = group["template"]["spec"]["containers"]
        assert any(e["name"] == "DSPARK_API_KEY" and "secretKeyRef" in e["valueFrom"] for e in container["env"])


class _ServeContext:
    """What Ray Serve's gRPC proxy hands a replica method: metadata, peer, and the code to answer with."""

    def __init__(self, metadata=()):
        self.metadata, self.code, self.details = list(metadata), None, None

    def invocation_metadata(self):
        return self.metadata

    def peer(self):
        return "ipv4:10.0.0.7:4242"

    def peer_identities(self):
        return None

    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        self.details = details


def test_the_serve_app_checks_the_key_from_the_environment(monkeypatch):
    """The replica's methods, without a pair: the key comes from the app's args or DSPARK_API_KEY, and a refusal is
    set on the context (what Serve's proxy answers with) before the request reaches the core."""
    import asyncio

    from dspark_serve.cluster import serve_app
    from dspark_serve.cluster.gateway import GatewayError

    monkeypatch.setenv("DSPARK_API_KEY", KEY_A)
    replica = object.__new__(serve_app.DSpark.func_or_class)

    async def reached():  # where a call with a good key goes next
        raise GatewayError("NOT_FOUND", "reached the core")

    replica._ready = reached
    for access, good in ((serve_app._access(None), KEY_A), (serve_app._access(KEY_B), KEY_B)):
        replica.access = access
        for metadata, details in (((), "missing metadata 'authorization: Bearer <api key>'"),
                                  ((("authorization", "Bearer nope"),), "invalid API key"),
                                  ((("authorization", f"Bearer {KEY_A if good == KEY_B else KEY_B}"),),
                                   "invalid API key"),
                                  ((("authorization", f"Bearer {good}"),), "reached the core")):
            ctx = _ServeContext(metadata)
            with pytest.raises(RuntimeError):
                asyncio.run(replica.GetModelInfo(pb.GetModelInfoRequest(), grpc_context=ctx))
            code = grpc.StatusCode.NOT_FOUND if details == "reached the core" else grpc.StatusCode.UNAUTHENTICATED
            assert (ctx.code, ctx.details) == (code, details)
    monkeypatch.delenv("DSPARK_API_KEY")
    assert serve_app._access(None).caller(_ServeContext()).startswith("peer:")  # no key asked for
